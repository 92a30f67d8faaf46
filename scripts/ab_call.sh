#!/usr/bin/env bash
# The runs of one device call, edited per session (logs under $OUT). As left by the thirteenth session,
# for the next one: the whole GPU test suite (the 1000-case fuzz included), which two calls on fresh
# machines could not finish within their limit this session (compiles dominate: give it the whole call),
# after the head-dim-64 forward became the Gluon kernel and planning took the eager path.
set -u
OUT="${OUT:-out}"; mkdir -p "$OUT"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm --format=csv | tee "$OUT/gpu.txt"
timeout 560 python -m pytest -q -p no:cacheprovider -rfE -m gpu tests --durations=15 \
  > "$OUT/pytest_gpu.log" 2>&1
tail -n 40 "$OUT/pytest_gpu.log"
