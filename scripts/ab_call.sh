#!/usr/bin/env bash
# The runs of one device call, edited per session (logs under $OUT). Left by the eighteenth session for the
# next (it ran out of device time before this call): the plan's group work by integer atomics
# (scripts/pending/plan_group_atomic.patch: two fewer serial passes in the block scan; CPU-tested, built for
# sm_90, never run on a GPU) against main's running maxima; same plans (plan_cost.py checks bitwise). Before it:
#   bash scripts/ab_export.sh HEAD atomic scripts/pending/plan_group_atomic.patch   (then carry "ab")
# Then, if it is cheaper: apply the patch, run the GPU suite (scripts/gpu_suite.sh), land it.
set -u
OUT="${OUT:-out}"; mkdir -p "$OUT"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm --format=csv | tee "$OUT/gpu.txt"
ab() {  # name, ab.py args...
  local name=$1; shift
  timeout 120 python scripts/ab.py --reps 11 --out "$OUT/$name" "$@" > "$OUT/ab_$name.log" 2>&1
  echo "$name rc=$?" | tee -a "$OUT/rc.txt"; grep "^| " "$OUT/ab_$name.log"; grep -i "fail\|error" "$OUT/ab_$name.log" | head -5
}
timeout 150 python scripts/plan_cost.py --against atomic --profile > "$OUT/plan_cost.log" 2>&1
echo "plan_cost rc=$?" | tee -a "$OUT/rc.txt"; tail -17 "$OUT/plan_cost.log"
