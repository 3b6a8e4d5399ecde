#!/bin/bash
# What the GPU machine's image lacks for a math run, as wheels for its Python 3.12, downloaded here
# into launch/device-check/wheels/ (ignored by git; a device call carries it): math-verify, which
# answers.is_equiv builds on, and its two dependencies. All three are pure Python, so no platform
# is named. gguf, z3-solver and vllm are not fetched: a math run with models given as folders and
# the kv sampler imports none of them (run.sh's checks fail if one is imported).
set -euo pipefail
DEST="$(cd "$(dirname "$0")" && pwd)/wheels"
mkdir -p "$DEST"
rm -f "$DEST"/*.whl  # one version of each: two would stop the install there
python3 -m pip download -q --python-version 3.12 --only-binary=:all: --no-deps -d "$DEST" \
    math-verify==0.9.0 latex2sympy2_extended==1.11.0 antlr4-python3-runtime==4.13.2
bytes=$(cat "$DEST"/*.whl | wc -c)
ls -l "$DEST"
echo "wheels: $(ls "$DEST"/*.whl | wc -l) files, $bytes bytes in $DEST"
if (( bytes > 2 * 1024 * 1024 )); then  # the three are about 0.4 MB; a call carries 64 MiB in all
    echo "the wheels are over 2 MiB: a pure-Python wheel was expected for each" >&2
    exit 1
fi
