#!/bin/bash
# The device check: t3rl at the paper's sizes on one GPU, with random weights, in at most 8 minutes,
# on a machine without network, vllm, gguf or z3 (not yet run on a GPU). Each check runs under its
# own timeout, one line each with its result and time; exit status 1 when one fails, whose log's end
# is printed. The calls into t3rl are in check.py beside this file, which says what each check does.
#
#   bash launch/device-check/fetch-wheels.sh      # here, once: math-verify and its two dependencies
#   bash launch/device-check/run.sh               # there, with launch/device-check/wheels carried
#   bash launch/device-check/run.sh --dry         # here: tiny models on the CPU (its test's run)
#
# Work files (two random 1.5B models, 6 GB; a run's two checkpoints, 37 GB, removed once checked)
# and the logs go to WORK_DIR, by default a new temporary folder.
set -uo pipefail
HERE=$(cd "$(dirname "$0")" && pwd)
cd "$HERE/../.."
DRY=0
[[ ${1:-} == --dry ]] && DRY=1
export T3RL_DEVICE_CHECK_DRY=$DRY PYTHONUNBUFFERED=1
WORK=${WORK_DIR:-$(mktemp -d)}
mkdir -p "$WORK" && WORK=$(cd "$WORK" && pwd)
BUDGET=480  # seconds for the whole script
TORCHRUN=(python3 -m torch.distributed.run --standalone --nproc_per_node 1)
CHECK="$HERE/check.py"
failed=0

# check NAME LIMIT COMMAND...: the command under `timeout` (at most what is left of the budget),
# its output in WORK/NAME.log; ok when it exits 0; the log's "result: " lines follow the verdict
check() {
    local name=$1 limit=$2 start=$SECONDS left rc said
    shift 2
    left=$((BUDGET - SECONDS))
    (( limit > left )) && limit=$left
    if (( limit < 5 )); then
        echo "check $name: FAILED (not run: the script's $BUDGET s are spent)"
        failed=1
        return
    fi
    timeout -k 10 "$limit" "$@" >"$WORK/$name.log" 2>&1
    rc=$?
    # (a progress bar may have left its last state before a \r on the line)
    said=$(awk '{ sub(/.*\r/, "") } sub(/^result: /, "") { printf "%s%s", sep, $0; sep = "; " }' \
        "$WORK/$name.log")
    if (( rc == 0 )); then
        echo "check $name: ok in $((SECONDS - start)) s: $said"
    else
        (( rc == 124 || rc == 137 )) && rc="$rc, timed out after $limit s"
        echo "check $name: FAILED (exit $rc) in $((SECONDS - start)) s; the end of $WORK/$name.log:"
        tail -n 25 "$WORK/$name.log"
        # a progress bar's last state (its rate), which a launcher's traceback may push out of view
        tr '\r' '\n' <"$WORK/$name.log" | grep -E '[0-9.]+(tok|it)/s' | tail -n 1
        failed=1
    fi
}

if (( DRY )); then
    echo "device check, dry: tiny models on the CPU"
else
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
fi
python3 -c 'import sys, torch, transformers, accelerate
print(f"python {sys.version.split()[0]}, torch {torch.__version__}, transformers "
      f"{transformers.__version__}, accelerate {accelerate.__version__}")'

# math-verify and its two dependencies from the carried wheels (dry without them: this machine's)
SITE=""
if compgen -G "$HERE/wheels/*.whl" >/dev/null; then
    SITE="$WORK/site"
    echo "wheels: $(cat "$HERE"/wheels/*.whl | wc -c) bytes in $(ls "$HERE"/wheels | wc -l) files"
    export PYTHONPATH="$SITE${PYTHONPATH:+:$PYTHONPATH}"
fi
check math-verify 60 bash -c '[[ -z $1 ]] || python3 -m pip install -q --no-index --no-deps \
    --no-compile --no-cache-dir --target "$1" "$2"/wheels/*.whl && python3 "$3" math-verify "$1"' \
    _ "$SITE" "$HERE" "$CHECK"
check sandbox 60 python3 "$CHECK" sandbox
check models 120 python3 "$CHECK" models "$WORK"
# (a) the kv sampler, (b) one GRPO update, (c) a run stopped and resumed
check sample-policy 150 "${TORCHRUN[@]}" "$CHECK" sample policy "$WORK"
check sample-verifier 100 "${TORCHRUN[@]}" "$CHECK" sample verifier "$WORK"
check update-ddp 120 "${TORCHRUN[@]}" "$CHECK" update ddp "$WORK"
check update-fsdp 120 "${TORCHRUN[@]}" "$CHECK" update fsdp "$WORK"
check run-stopped 150 python3 "$CHECK" stopped-run "$WORK"
check run-resumed 150 python3 "$CHECK" resumed-run "$WORK"
echo "device check: $( (( failed )) && echo FAILED || echo ok) in $SECONDS s; logs in $WORK"
exit $failed
