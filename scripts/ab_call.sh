#!/usr/bin/env bash
# The runs of one device call, edited per session (logs under $OUT). Fifteenth session, second call: the
# automatic head chunks against none, the pipeline depth of the Gluon backward kernels, and the cost of the
# per-slice bounded descriptors (a scratch package exported by scripts/ab_export.sh, carried as "ab").
set -u
OUT="${OUT:-out}"; mkdir -p "$OUT"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm --format=csv | tee "$OUT/gpu.txt"
ab() {  # name, ab.py args...
  local name=$1; shift
  timeout 200 python scripts/ab.py --reps 11 --out "$OUT/$name" "$@" > "$OUT/ab_$name.log" 2>&1
  echo "$name rc=$?" | tee -a "$OUT/rc.txt"; grep "^| " "$OUT/ab_$name.log"; grep -i "fail\|error" "$OUT/ab_$name.log" | head -5
}
P=dkdv+dq+persistent
ab chunks --cases causal-8k-mqa,full-4k-gqa16:2 --bwd main:default --bwd "main:64,128,8,3,128,64,8,3,$P"
ab bound --cases doc128-32k,doc16-32k,doc1024-32k,swa2048-32k,causal-8k --fwd main:default --fwd nobound:default \
  --bwd main:default --bwd nobound:default
ab stages128 --cases full-8k,causal-8k,doc128-32k --bwd main:default --bwd "main:64,128,8,3,128,64,8,4,$P" \
  --bwd "main:64,128,8,4,128,64,8,3,$P"
ab stages64 --cases full-8k-d64,causal-8k-d64 --bwd main:default --bwd "main:64,128,8,4,128,128,8,3,$P" \
  --bwd "main:64,128,8,6,128,128,8,4,$P" --bwd "main:64,128,8,3,128,128,8,2,$P"
