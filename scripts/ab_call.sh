#!/usr/bin/env bash
# The runs of one device call, edited per session (logs under $OUT; carry "ab" for the plan step). Left by the
# twenty-second session, which timed the dynamic schedule on an H100 (BENCHMARKS.md: the forward 21% faster
# on 16 documents in 32k, 9% slower on 128) but could not run its GPU tests, the GPU suite or a bar table:
#   tests  the GPU tests of the dynamic schedule and merged tiles (bitwise equal to the default);
#   fwd    the forward A/B, default against dynamic, with a fuzz, on the bar and document cases (H200 numbers);
#          beside it dynt (scripts/pending/dynamic_ticket_only.patch: the consumers read only the ticket and
#          decode the item themselves, as the fixed schedule does; bash scripts/ab_export.sh HEAD dynt <patch>)
#          and dynf (scripts/pending/posted_fixed_share.patch: the dynamic schedule's posting, the fixed share's
#          items: what the posting costs apart from the schedule); and the split key and value barriers
#          (sm90pppmk, two slots; sm90pppmkq, with two query blocks) once their bitwise GPU tests pass;
#   bwd    the same for the backward;
#   plan   the plan's group maximum by integer atomics (ab/atomic, exported from
#          scripts/pending/plan_group_atomic.patch: bash scripts/ab_export.sh HEAD atomic <patch>).
# The most needed first, as device time may run out mid-call; STEPS picks (e.g. STEPS="tests fwd").
# Then scripts/gpu_suite.sh, and FlashAttention-4's bench (scripts/fa4_bench.sh, PICK=1 to bench the forward
# A/B's pick through the public call).
set -u
OUT="${OUT:-out}"; mkdir -p "$OUT"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm --format=csv | tee "$OUT/gpu.txt"
ab() {  # name, time limit (s), ab.py args...
  local name=$1; shift
  local limit=$1; shift
  timeout "$limit" python scripts/ab.py --reps 11 --out "$OUT/$name" "$@" > "$OUT/ab_$name.log" 2>&1
  echo "$name rc=$?" | tee -a "$OUT/rc.txt"; grep -E "^\| |ms  \(|^!!!" "$OUT/ab_$name.log"; grep -i "fail\|error" "$OUT/ab_$name.log" | head -5
}
STEPS="${STEPS:-tests fwd bwd plan}"
has() { [[ " $STEPS " == *" $1 "* ]]; }
if has tests; then
  timeout 200 python -m pytest -q -p no:cacheprovider -rfE -m gpu tests/test_gpu_forward.py tests/test_gpu_backward.py \
    -k "dynamic or merg or many_short" > "$OUT/pytest_dyn.log" 2>&1
  echo "pytest rc=$?" | tee -a "$OUT/rc.txt"; tail -5 "$OUT/pytest_dyn.log"
fi
split=""
if has fwd; then
  # The split key and value barriers join the A/B only once their bitwise GPU tests pass (a kernel that hangs
  # would take the whole A/B with it).
  timeout 120 python -m pytest -q -p no:cacheprovider -rfE -x -m gpu tests/test_gpu_forward.py \
    -k "split_kv and d128 and packed and not three" > "$OUT/pytest_split.log" 2>&1
  rc=$?; echo "pytest split rc=$rc" | tee -a "$OUT/rc.txt"; tail -3 "$OUT/pytest_split.log"
  [ $rc = 0 ] && split="--fwd main:sm90pppmk_m128_n128_w4_s2 --fwd main:sm90pppmkq_m128_n128_w4_s2"
  ab fwd 300 --fuzz 2 --fwd main:default --fwd main:sm90pppmd_m128_n128_w4_s3 --fwd dynt:sm90pppmd_m128_n128_w4_s3 \
    --fwd dynf:sm90pppmd_m128_n128_w4_s3 $split \
    --cases doc16-32k,doc128-32k,causal-8k,full-8k,doc16-128k
  # Kept on the warm machine for a second call (FlashAttention-4's bench of the pick; scripts/fa4_bench.sh).
  # The packages made from pending patches may be picked (scripts/pick_default.py --patch).
  patches="--patch dynt=scripts/pending/dynamic_ticket_only.patch --patch dynf=scripts/pending/posted_fixed_share.patch"
  mkdir -p /tmp/keep && cp "$OUT/fwd/ab.json" /tmp/keep/fwd_ab.json && echo "$patches" > /tmp/keep/pick_args.txt
  python scripts/pick_default.py "$OUT/fwd/ab.json" $patches
fi
if has bwd; then
  ab bwd 160 --fuzz 3 --bwd main:default --bwd "main:64,128,8,3,128,64,8,3,dkdv+dq+persistent+dynamic" \
    --cases doc16-32k,doc128-32k,longshort-32k,causal-8k,full-8k
fi
if has plan; then
  timeout 90 python scripts/plan_cost.py --against atomic > "$OUT/plan.log" 2>&1
  echo "plan rc=$?" | tee -a "$OUT/rc.txt"; grep -E "^\| " "$OUT/plan.log"
fi
