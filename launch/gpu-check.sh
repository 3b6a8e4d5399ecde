#!/bin/bash
# The GPU path in one short call, sized for at most 8 minutes on one GPU (not yet run on one): the
# paper preset at reduced size (4 questions, 2 a step, N = 4, 256 tokens, 2 steps), both roles on
# vLLM, stopped in its second update and resumed from its step-1 checkpoint, then both roles on kv,
# and on two GPUs or more the kv run under --parallel fsdp on two processes.
# One line per check with its time and the GPU's peak memory (nvidia-smi, polled); exit status 1
# when a check fails, whose log's end is printed.
#
#   bash launch/gpu-check.sh                                   # models from the Hub or its cache
#   MODEL=/models/math-1.5b VERIFIER=/models/coder-1.5b T3RL_DATA_DIR=/data bash launch/gpu-check.sh
#
# Needs requirements.txt and requirements-vllm.txt installed, and MATH-500 (T3RL_DATA_DIR or the
# Hub). Run folders (a checkpoint of the 1.5B policy and its AdamW state is 18.5 GB) go to OUT_DIR,
# by default a new temporary folder, and each is removed once checked; the logs stay there.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT_DIR:-$(mktemp -d)}
MODEL=${MODEL:-Qwen/Qwen2.5-Math-1.5B}
VERIFIER=${VERIFIER:-Qwen/Qwen2.5-Coder-1.5B-Instruct}
SMALL=(--preset paper --model "$MODEL" --verifier-model "$VERIFIER" --bench math500 --limit 4
       --questions-per-step 2 --n-votes 4 --n-train 2 --max-new-tokens 256
       --verifier-max-new-tokens 256 --eval-samples 1 --max-steps 2 --out-dir "$OUT")
# Ctrl-C in the second GRPO update (step 1's), after the step-1 checkpoint: the resume line
STOPPED='import sys, t3rl
real, calls = t3rl.grpo_step, []
def stopped(*args, **kwargs):
    calls.append(1)
    if len(calls) == 2:
        raise KeyboardInterrupt
    return real(*args, **kwargs)
t3rl.grpo_step = stopped
t3rl.main(sys.argv[1:])'
failed=0

# steps RUN: the train steps in RUN/metrics.jsonl, and "final" after a final evaluation
steps() {
    python -c 'import json, sys
rows = [json.loads(line) for line in open(sys.argv[1] + "/metrics.jsonl")]
steps = [str(r["step"]) for r in rows if r["kind"] == "train"]
print(" ".join(steps + ["final"] * bool(rows[-1].get("final"))))
' "$1"
}

# check NAME RUN EXPECTED COMMAND...: run the command (log: NAME.log), then compare `steps RUN`
check() {
    local name=$1 run=$2 expected=$3 start=$SECONDS peak=0 used job rc got
    shift 3
    "$@" >"$OUT/$name.log" 2>&1 &
    job=$!
    while kill -0 "$job" 2>/dev/null; do
        used=$(nvidia-smi --query-gpu=memory.used --format=csv,noheader,nounits | head -n 1)
        (( ${used:-0} > peak )) && peak=$used
        sleep 0.5
    done
    wait "$job"
    rc=$?
    got=$(steps "$OUT/$run" 2>/dev/null)
    if [[ $got == "$expected" ]]; then
        echo "check $name: ok (exit $rc, steps '$got') in $((SECONDS - start)) s," \
             "peak GPU memory $peak MiB"
    else
        echo "check $name: FAILED (exit $rc, steps '$got', expected '$expected') in" \
             "$((SECONDS - start)) s, peak GPU memory $peak MiB; the end of $OUT/$name.log:"
        tail -n 15 "$OUT/$name.log"
        failed=1
    fi
}

nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
check vllm-stopped vllm "0" python -c "$STOPPED" "${SMALL[@]}" --backend vllm \
    --verifier-backend vllm --save-every 1 --run-name vllm
grep -h "^\[t3rl\] GPU memory" "$OUT/vllm-stopped.log"
check vllm-resumed vllm "0 1 final" python t3rl.py --resume "$OUT/vllm"
rm -rf "${OUT:?}/vllm"
check kv kv "0 1 final" python t3rl.py "${SMALL[@]}" --backend kv --verifier-backend kv \
    --run-name kv
rm -rf "${OUT:?}/kv"
# FSDP shards over processes of a GPU each (NCCL takes one process a GPU): two GPUs or more
if (( $(nvidia-smi -L | wc -l) >= 2 )); then
    check fsdp fsdp "0 1 final" python -m torch.distributed.run --standalone --nproc_per_node 2 \
        t3rl.py "${SMALL[@]}" --backend kv --verifier-backend kv --parallel fsdp --run-name fsdp
    rm -rf "${OUT:?}/fsdp"
else
    echo "check fsdp: skipped (one GPU; --parallel fsdp needs two processes, each on its own GPU)"
fi
echo "logs in $OUT"
exit $failed
