#!/usr/bin/env bash
# The runs of one device call, edited per session (logs under $OUT; carry "ab"). Left by the nineteenth to
# twenty-second sessions, which could not start a GPU: the forward's dynamic schedule (programs take their items
# from a counter; config sm90pppmd), with and without passes over the heads (ab/unroll: before them), and the
# output sent by TMA from each item's last key tile (sm90pppmo, and both: sm90pppmdo) against the default, and
# the default against the tree before the consumers' unrolled window walk (ab/prev), then their GPU tests
# (bitwise equal to the default on every call),
# then the backward's dynamic schedule (flag "dynamic"), then the plan's atomic group maximum (ab/atomic) -
# the most needed first, as device time may run out mid-call. If a variant wins: make it the default
# (forward._SM90_DEFAULTS, backward._default_config), run scripts/gpu_suite.sh, then FlashAttention-4's bench
# (scripts/fa4_bench.sh).
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
# STEPS picks the runs, in this order (fwd, tests, bwd and plan by default); e.g. STEPS="fwd tests" when
# little device time is left, STEPS=mini with a few minutes.
STEPS="${STEPS:-fwd tests bwd plan}"
has() { [[ " $STEPS " == *" $1 "* ]]; }
# The dynamic schedule and the output-through-the-ring configs have never run: one bitwise test of each first
# (it also fills Triton's cache), so that a hang or a wrong result drops them from the A/B instead of costing
# the whole A/B. RING=0 leaves the ring out (a call with little device time left).
smoke() {
  local k="dynamic_schedule_is_bitwise_the_same and doc16"
  [ "${RING:-1}" = 1 ] && k="($k) or (output_through_the_ring and doc16-d128)"
  timeout "$1" python -m pytest -v -p no:cacheprovider -rfE -m gpu tests/test_gpu_forward.py -k "$k" \
    > "$OUT/pytest_smoke.log" 2>&1
  echo "smoke rc=$?" | tee -a "$OUT/rc.txt"; grep -E "PASSED|FAILED|ERROR" "$OUT/pytest_smoke.log" | head -5
  dyn=""; ring=""
  grep -q "dynamic_schedule_is_bitwise_the_same\[doc16\] PASSED" "$OUT/pytest_smoke.log" && \
    dyn="--fwd main:sm90pppmd_m128_n128_w4_s3 --fwd unroll:sm90pppmd_m128_n128_w4_s3"
  grep -q "output_through_the_ring_is_bitwise_the_same\[doc16-d128\] PASSED" "$OUT/pytest_smoke.log" && \
    ring="--fwd main:sm90pppmo_m128_n128_w4_s3 --fwd main:sm90pppmdo_m128_n128_w4_s3"
}
if has mini; then
  # For a call with a few minutes of device time: the unrolled window walk and the dynamic schedule (with and
  # without passes over the heads) on four cases, no fuzz (each variant is still compared with the default's
  # output).
  RING=0 smoke 90
  ab mini 200 --fwd main:default --fwd prev:default $dyn --cases doc16-32k,doc128-32k,causal-8k,doc16-128k
  mkdir -p /tmp/keep && cp "$OUT/mini/ab.json" /tmp/keep/fwd_ab.json && python scripts/pick_default.py "$OUT/mini/ab.json"
fi
if has fwd; then
  smoke 200
  # prev: the tree before the consumers' unrolled window walk (bash scripts/ab_export.sh 3374239 prev);
  # unroll: the tree before the passes over the heads, which only the dynamic schedule takes
  # (bash scripts/ab_export.sh c637790 unroll).
  ab dyn 330 --fuzz 4 --fwd main:default --fwd prev:default $dyn $ring \
    --cases doc16-32k,doc128-32k,doc1024-32k,causal-8k,full-8k,swa2048-32k,doc16-128k
  # Kept on the warm machine for a second call (FlashAttention-4's bench of the pick; scripts/fa4_bench.sh).
  mkdir -p /tmp/keep && cp "$OUT/dyn/ab.json" /tmp/keep/fwd_ab.json && python scripts/pick_default.py "$OUT/dyn/ab.json"
fi
if has tests; then
  timeout 200 python -m pytest -q -p no:cacheprovider -rfE -m gpu tests/test_gpu_forward.py tests/test_gpu_backward.py \
    -k "dynamic or ring or merg or many_short or passes" > "$OUT/pytest_dyn.log" 2>&1
  echo "pytest rc=$?" | tee -a "$OUT/rc.txt"; tail -5 "$OUT/pytest_dyn.log"
fi
if has bwd; then
  ab dynb 160 --fuzz 3 --bwd main:default --bwd "main:64,128,8,3,128,64,8,3,dkdv+dq+persistent+dynamic" \
    --bwd "unroll:64,128,8,3,128,64,8,3,dkdv+dq+persistent+dynamic" \
    --cases doc16-32k,doc128-32k,longshort-32k,causal-8k,full-8k
fi
if has plan; then
  # The plan's group maximum by integer atomics (scripts/pending/plan_group_atomic.patch, exported as ab/atomic).
  timeout 90 python scripts/plan_cost.py --against atomic > "$OUT/plan.log" 2>&1
  echo "plan rc=$?" | tee -a "$OUT/rc.txt"; grep -E "^\| " "$OUT/plan.log"
fi
