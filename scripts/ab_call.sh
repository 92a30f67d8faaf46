#!/usr/bin/env bash
# The runs of one device call, edited per session (logs under $OUT). Left by the seventeenth session for the
# next (it ran out of device time before this call): the persistent Gluon kernels' consumers loading each work
# item's plan entries ahead, forward and backward (scripts/pending/prefetch_block.patch; built offline for
# sm_90, not yet run on a GPU), against main. Before the call:
#   bash scripts/ab_export.sh HEAD prev && git apply scripts/pending/prefetch_block.patch     (carry "ab")
# The patch touches no arithmetic: bits equal to prev on every case (ab.py says "bitwise"). Then the GPU suite.
# Also the per-item trace of the forward in three block orders (is the short documents' slower tile an L2
# effect? BENCHMARKS.md, seventeenth session): before the call, also python scripts/trace_items.py --export
# (it copies HEAD's kernels, not the patched tree).
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
  --fwd prev:default --fwd main:default
ab bwd --reps 7 --fuzz 4 --cases doc128-32k,doc1024-32k,doc16-32k,causal-8k,full-8k \
  --bwd prev:default --bwd main:default
timeout 200 python scripts/trace_items.py --cases doc16-32k,doc128-32k,causal-8k,swa2048-32k \
  --orders heavy,grouped,bucketed --out "$OUT/trace" > "$OUT/trace.log" 2>&1
echo "trace rc=$?" | tee -a "$OUT/rc.txt"; grep -v "^\s*$" "$OUT/trace.log" | tail -40
