#!/usr/bin/env bash
# The runs of one device call, edited per session (logs under $OUT). As left by the twelfth session, for the
# next one: the first GPU runs of the backward that accumulates dQ in its key-major kernel (Triton,
# BwdConfig(fused_dq=True)): its GPU test (turns under real concurrency, bitwise reruns), then an A/B
# against the default backward (float64 fuzz, then timings) at head dims 128 and 64, in the two tile shapes
# per head dim whose sm_90 builds spill least with the H200's Triton 3.6 (56-112 B of stack at D=128,
# 32-40 B at 64).
set -u
OUT="${OUT:-out}"; mkdir -p "$OUT"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
[ -d .fa4/A ] && cp -r .fa4/A /tmp/fa4A
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm --format=csv | tee "$OUT/gpu.txt"
timeout 200 python -m pytest -q -p no:cacheprovider -rfE tests/test_gpu_backward.py -k "fused" \
  2>&1 | tail -n 15 | tee "$OUT/pytest_fused.log"
timeout 180 python scripts/ab.py --fuzz 12 --cases full-8k,causal-8k,doc128-32k --reps 11 \
  --bwd main:default --bwd "main:32,64,8,2,64,64,4,2,fused" --bwd "main:16,128,8,2,64,64,4,2,fused" \
  > "$OUT/ab128.log" 2>&1
grep -v "^$" "$OUT/ab128.log" | tail -n 8
timeout 130 python scripts/ab.py --fuzz 8 --fuzz-d 64 --cases full-8k-d64,causal-8k-d64 --reps 11 \
  --bwd main:default --bwd "main:64,128,8,2,64,64,4,2,fused" --bwd "main:64,64,4,2,64,64,4,2,fused" \
  > "$OUT/ab64.log" 2>&1
grep -v "^$" "$OUT/ab64.log" | tail -n 6
# The Hopper forward at head dim 64 (the Triton kernel is the default there; the Gluon one has gained the
# softmax overlap, merged tiles and the reciprocal epilogue since it last lost there, eighth session).
timeout 80 python scripts/ab.py --fuzz 6 --fuzz-d 64 --cases full-8k-d64,causal-8k-d64 --reps 11 \
  --fwd main:default --fwd main:sm90pppm_m128_n128_w4_s3 > "$OUT/ab_fwd64.log" 2>&1
grep -v "^$" "$OUT/ab_fwd64.log" | tail -n 6
