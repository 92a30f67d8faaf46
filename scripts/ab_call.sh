#!/usr/bin/env bash
# The runs of one device call (edit per session; logs under $OUT). Carry "ab" and ".fa4/A".
set -u
OUT="${OUT:-out}"; mkdir -p "$OUT"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
# FlashAttention-4's first half, kept for the next call (scripts/h200.sh).
[ -d .fa4/A ] && cp -r .fa4/A /tmp/fa4A
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm --format=csv | tee "$OUT/gpu.txt"
timeout 150 python scripts/ab.py --fuzz 16 --fuzz-d 128 --reps 11 \
  --cases full-8k,causal-8k,doc128-32k,full-16k-gqa32:8 \
  --bwd "main:default" --bwd "rows2:64,128,8,3,128,64,8,3,dkdv+dq+persistent" \
  --bwd "rows2:64,128,8,2,128,64,8,3,dkdv+dq+persistent" \
  --out "$OUT/bwd128" 2>&1 | tee "$OUT/bwd128.log" | grep -v "^bwd "
timeout 170 python -m pytest -q -p no:cacheprovider -x tests/test_gpu_forward.py \
  -k "fuzz_1000 or (fuzz_hopper and pppm) or nan_in" 2>&1 | tail -n 4 | tee "$OUT/pytest_fwd.log"
timeout 130 python -m pytest -q -p no:cacheprovider -x tests/test_gpu_backward.py \
  -k "default_and_builds or (gluon_backward_fuzz and persistent)" 2>&1 | tail -n 4 | tee "$OUT/pytest_bwd.log"
