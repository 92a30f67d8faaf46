#!/usr/bin/env bash
# The runs of one device call, edited per session (logs under $OUT). Fifteenth session, first call: the
# split-heads GPU test, then A/Bs of register operands for the Gluon backward's score matmuls (packages
# exported by scripts/ab_export.sh, carried as "ab") and of BwdConfig.kv_head_chunks.
set -u
OUT="${OUT:-out}"; mkdir -p "$OUT"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm --format=csv | tee "$OUT/gpu.txt"
timeout 150 python -m pytest -q -p no:cacheprovider -rfE -m gpu tests/test_gpu_backward.py -k split_query_heads \
  > "$OUT/pytest_split.log" 2>&1; echo "split rc=$?" | tee -a "$OUT/rc.txt"
tail -n 5 "$OUT/pytest_split.log"
ab() {  # name, ab.py args...
  local name=$1; shift
  timeout 200 python scripts/ab.py --reps 11 --out "$OUT/$name" "$@" > "$OUT/ab_$name.log" 2>&1
  echo "$name rc=$?" | tee -a "$OUT/rc.txt"; tail -n 14 "$OUT/ab_$name.log"
}
ab d64 --fuzz 6 --fuzz-d 64 --cases full-8k-d64,causal-8k-d64 --bwd main:default --bwd rsk:default \
  --bwd rskv:default --bwd rsq:default
ab d128 --fuzz 6 --cases full-8k,causal-8k,doc128-32k --bwd main:default --bwd rsq:default
ab chunks --cases causal-8k-mqa,full-4k-gqa16:2 --bwd main:default \
  --bwd "main:64,128,8,3,128,64,8,3,dkdv+dq+persistent+chunks2" --bwd "main:64,128,8,3,128,64,8,3,dkdv+dq+persistent+chunks4"
