#!/usr/bin/env bash
# The runs of one device call, edited per session (logs under $OUT). Eighteenth session: the plan's block
# order with the blocks of one window start (one document) kept together (working tree, "main") against the
# plain heavy-first order (HEAD before it, exported as "prev"), forward and backward. Before it:
#   bash scripts/ab_export.sh HEAD prev                                          (then carry "ab")
set -u
OUT="${OUT:-out}"; mkdir -p "$OUT"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm --format=csv | tee "$OUT/gpu.txt"
ab() {  # name, ab.py args...
  local name=$1; shift
  timeout 330 python scripts/ab.py --reps 11 --out "$OUT/$name" "$@" > "$OUT/ab_$name.log" 2>&1
  echo "$name rc=$?" | tee -a "$OUT/rc.txt"; grep "^| " "$OUT/ab_$name.log"; grep -i "fail\|error" "$OUT/ab_$name.log" | head -5
}
ab fwd --reps 9 --fuzz 4 --cases doc16-32k,doc128-32k,doc1024-32k,longshort-32k,doc16-128k,sharedq-32k,blockcausal-32k,causal-8k \
  --fwd main:default --fwd prev:default
ab bwd --reps 7 --fuzz 3 --cases doc16-32k,doc128-32k,longshort-32k,causal-8k \
  --bwd main:default --bwd prev:default
