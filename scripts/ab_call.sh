#!/usr/bin/env bash
# The runs of one device call, edited per session (logs under $OUT). Fifteenth session, last call: what the
# Gluon kernels' epilogues cost (a scratch package whose output stores are predicated off, exported by
# scripts/ab_export.sh and carried as "ab").
set -u
OUT="${OUT:-out}"; mkdir -p "$OUT"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm --format=csv | tee "$OUT/gpu.txt"
ab() {  # name, ab.py args...
  local name=$1; shift
  timeout 200 python scripts/ab.py --reps 11 --out "$OUT/$name" "$@" > "$OUT/ab_$name.log" 2>&1
  echo "$name rc=$?" | tee -a "$OUT/rc.txt"; grep "^| " "$OUT/ab_$name.log"; grep -i "fail\|error" "$OUT/ab_$name.log" | head -5
}
ab epilogue --cases doc128-32k,doc1024-32k,doc16-32k,causal-8k --fwd main:default --fwd noepi:default \
  --bwd main:default --bwd noepi:default
