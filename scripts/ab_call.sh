#!/usr/bin/env bash
# The runs of one device call, edited per session (logs under $OUT). Twelfth session, third call: the
# dK/dV kernel at head dim 64 holding 128-row tiles by rows, against the default 64-row tiles held by keys
# (float64 fuzz, bitwise check, timings), and the GPU test that the two give the same bits.
set -u
OUT="${OUT:-out}"; mkdir -p "$OUT"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm --format=csv | tee "$OUT/gpu.txt"
timeout 170 python scripts/ab.py --fuzz 24 --fuzz-d 64 --cases full-8k-d64,causal-8k-d64 --reps 15 \
  --bwd main:default --bwd "main:128,128,8,3,128,128,8,3,dkdv+dq+persistent" \
  --bwd "main:128,128,8,2,128,128,8,3,dkdv+dq+persistent" > "$OUT/ab.log" 2>&1
grep -v "^$" "$OUT/ab.log" | tail -n 14
timeout 130 python -m pytest -q -p no:cacheprovider -rfE tests/test_gpu_backward.py -k "by_rows and d64" \
  2>&1 | tail -n 8 | tee "$OUT/pytest.log"
