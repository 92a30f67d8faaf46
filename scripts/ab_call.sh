#!/usr/bin/env bash
# The runs of one device call, edited per session (logs under $OUT). Twelfth session, second call: the GPU
# tests of the by-rows dK/dV default at every head dim padded to 128, the A/B of D=128 with Dv=64 (the
# one such dim not timed before the default changed), and each kernel's share of the public call.
set -u
OUT="${OUT:-out}"; mkdir -p "$OUT"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm --format=csv | tee "$OUT/gpu.txt"
timeout 90 python scripts/ab.py --cases full-8k-d128v64,doc128-32k --reps 15 \
  --bwd "main:32,128,8,3,128,64,8,3,dkdv+dq+persistent" --bwd main:default > "$OUT/ab.log" 2>&1
tail -n 5 "$OUT/ab.log"
timeout 270 python -m pytest -q -p no:cacheprovider -rfE tests/test_gpu_backward.py \
  -k "by_rows or default_and_builds or (gluon_backward_fuzz and persistent) or gluon_backward_realistic" \
  2>&1 | tail -n 15 | tee "$OUT/pytest_bwd.log"
timeout 100 python scripts/profile_call.py --cases full-8k,full-8k-d64,doc16-32k --reps 10 > "$OUT/profile.log" 2>&1
grep -A8 "^---" "$OUT/profile.log" | cut -c1-90 | head -n 60
