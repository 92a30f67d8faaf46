#!/usr/bin/env bash
# The runs of one device call, edited per session (logs under $OUT). Left by the seventeenth session for the
# next (it ran out of device time before this call). (1) The persistent Gluon kernels' consumers loading each
# work item's plan entries ahead, forward and backward, two ways, against main: "pf" loads the block two items
# ahead and the slice window one ahead (scripts/pending/prefetch_block.patch), "lite" the block one item ahead
# only (prefetch_block_lite.patch: one more loop-carried value; the default builds' stack unchanged). Both
# built offline for sm_90, never run on a GPU; no arithmetic changes (ab.py should say "bitwise"). Before it:
#   bash scripts/ab_export.sh HEAD pf scripts/pending/prefetch_block.patch
#   bash scripts/ab_export.sh HEAD lite scripts/pending/prefetch_block_lite.patch
#   python scripts/trace_items.py --export                                       (then carry "ab")
# (2) The forward's per-item trace in three block orders (is the short documents' slower tile an L2 effect?
# BENCHMARKS.md, seventeenth session). Land the faster patch, then run the GPU suite on it.
set -u
OUT="${OUT:-out}"; mkdir -p "$OUT"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm --format=csv | tee "$OUT/gpu.txt"
ab() {  # name, ab.py args...
  local name=$1; shift
  timeout 280 python scripts/ab.py --reps 11 --out "$OUT/$name" "$@" > "$OUT/ab_$name.log" 2>&1
  echo "$name rc=$?" | tee -a "$OUT/rc.txt"; grep "^| " "$OUT/ab_$name.log"; grep -i "fail\|error" "$OUT/ab_$name.log" | head -5
}
ab fwd --reps 9 --fuzz 4 --cases doc128-32k,doc1024-32k,doc16-32k,causal-8k,full-8k,swa2048-32k \
  --fwd main:default --fwd pf:default --fwd lite:default
ab bwd --reps 7 --fuzz 4 --cases doc128-32k,doc1024-32k,doc16-32k,causal-8k,full-8k \
  --bwd main:default --bwd pf:default --bwd lite:default
timeout 200 python scripts/trace_items.py --cases doc16-32k,doc128-32k,causal-8k,swa2048-32k \
  --orders heavy,grouped,bucketed --out "$OUT/trace" > "$OUT/trace.log" 2>&1
echo "trace rc=$?" | tee -a "$OUT/rc.txt"; grep -v "^\s*$" "$OUT/trace.log" | tail -40
