#!/usr/bin/env bash
# The A/B runs of one device call (edit per session; logs under $OUT). Carry "ab".
set -u
OUT="${OUT:-out}"; mkdir -p "$OUT"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm --format=csv | tee "$OUT/gpu.txt"
timeout 400 python scripts/ab.py --fuzz 24 --fuzz-d 128 --reps 11 \
  --cases full-8k,causal-8k,doc16-32k,doc128-32k,swa2048-32k,full-16k-gqa32:8 \
  --bwd "main:default" --bwd "rows:64,128,8,3,128,64,8,3,dkdv+dq+persistent" \
  --bwd "rows:64,128,8,2,128,64,8,3,dkdv+dq+persistent" --bwd "rows:default" \
  --out "$OUT/bwd128" 2>&1 | tee "$OUT/bwd128.log" | grep -v "^bwd "
