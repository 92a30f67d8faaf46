#!/usr/bin/env bash
# The runs of one device call, edited per session (logs under $OUT; carry "ab" for the defaults and plan
# steps). The twenty-fifth session made the head-dim-128 Hopper defaults depend on the mean slot length
# (constants.has_short_slices: forward sm90pppma, or sm90pppmak for short slots; backward fixed share, or
# dynamic for short slots); the twenty-sixth ran the defaults step on an H100 (BENCHMARKS.md); the
# twenty-seventh ran d64 (and made head dim 64 take the same schedules: forward sm90pppma for every mask,
# backward dynamic for short slots), fbgap with profile_call.py --variants (the GPU's clock, not the call),
# host, and the GPU tests left over. The twenty-ninth timed the twenty-eighth's five-matmul backward at head
# dim 64 (BwdConfig.atomic_dq, fixed_point_dq: slower everywhere, removed; `git show 86d768d` has them) and
# left the dqparts step. Not run on a GPU yet: an H200 bar table (none has been lent since the sixteenth
# session), and the whole GPU suite on this tree in one go (its parts passed across sessions).
#   exp2   the Hopper forward's exponentials: the default against a quarter or half of them by a polynomial on
#          the FMA pipe (FwdConfig.poly_exp2: sm90pppmax1, sm90pppmax2), and none (scratch, output wrong: what
#          MUFU's share costs; export first: bash scripts/ab_export.sh 78a0192 noexp
#          scripts/pending/fwd_no_exp2.patch), on head dims 64 and 128, with their GPU test;
#   rowint edge tiles masked by one interval per row or key (FwdConfig.row_intervals: sm90pppmar, sm90pppmakr;
#          BwdConfig.row_intervals, flag "rows"), their bitwise GPU tests, then the A/Bs against the defaults;
#   bexp2  the backward's half (bhalfpoly: bash scripts/ab_export.sh 78a0192 bhalfpoly scripts/pending/bwd_exp2_half_poly.patch)
#          against its default;
#   exp2bench  after exp2: the polynomial config that won at head dim 64 made that default in the call's copy
#          only, and the public call timed beside cuDNN on the head-dim-64 cases;
#   dqparts  what each part of that removed path costs: the two-launch default and atomic_dq of 86d768d against
#          the same with the reduce-add left out and with staging and reduce-add left out (scratch, dQ wrong:
#          scripts/pending/atomic_dq_no_*.patch), then the public call's per-kernel times at head dims 64
#          and 128 (scripts/profile_call.py). Export first: bash scripts/ab_export.sh 86d768d pre, and
#          bash scripts/ab_export.sh 86d768d noreduce|nostage scripts/pending/atomic_dq_no_reduce|staging.patch;
#   defaults  first: the shape-chosen defaults' GPU tests, then their A/B against the fixed defaults of
#          a937242 through the launchers (bash scripts/ab_export.sh a937242 prev, carry "ab");
#   tests  the GPU tests of the dynamic and adaptive schedules, forward and backward (bitwise equal to the
#          fixed share; the adaptive ones' choice read from their counters) and of merged tiles;
#   fwd    the forward A/B with a fuzz: the default against the dynamic, adaptive, split-barrier and adaptive
#          with split barriers (sm90pppmak) configs,
#          on document, dense, GQA and 32k cases (the adaptive one joins once its GPU tests pass);
#   trace  where doc128's items spend their time under the dynamic schedule against the fixed share
#          (scripts/trace_items.py --configs; export ab/trace here first: python scripts/trace_items.py --export);
#   bwd    the backward A/B, default against dynamic and adaptive (adaptive once the tests passed);
#   fbgap  the public call and the call with a plan, forward + backward, per call and per kernel
#          (scripts/profile_call.py --plan); the twenty-seventh session found the planned call's 5 ms to
#          be the GPU's clock falling under sustained load (profile_call.py --variants);
#   d64    head dim 64: the forward's adaptive, split-barrier and dynamic schedules and the backward's dynamic
#          one against the fixed-share defaults, on documents, a window and dense 8k (launchers, with a fuzz);
#   host   the host-overhead table (flashrange bench --host);
#   plan   the plan's cost against an exported variant (ab/$PLAN_AGAINST, e.g. a pending patch exported
#          with bash scripts/ab_export.sh HEAD NAME <patch>).
# The most needed first, as device time may run out mid-call; STEPS picks (e.g. STEPS="tests fwd").
# Then scripts/gpu_suite.sh (SUITE_K picks tests), and FlashAttention-4's bench (scripts/fa4_bench.sh,
# PICK=1 to bench the forward A/B's pick through the public call).
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
STEPS="${STEPS:-rowint exp2 exp2bench}"
has() { [[ " $STEPS " == *" $1 "* ]]; }
# ADAPTIVE_OK=1 when an earlier call's tests step passed (the adaptive configs then join without rerunning it).
adaptive_ok="${ADAPTIVE_OK:-0}"
if has exp2; then
  ab exp2 240 --fuzz 3 --fuzz-d 64 --fwd main:default --fwd main:sm90pppmax1_m128_n128_w4_s3 \
    --fwd main:sm90pppmax2_m128_n128_w4_s3 --fwd noexp:default \
    --cases full-8k-d64,causal-8k-d64,doc16-32k-d64,doc128-32k-d64,full-8k,causal-8k
  # Their own GPU test (NaN where it is read); the fuzz of 300 masks each is left to the whole suite.
  SUITE_K="poly_exp2" LIMIT=120 PROCS=2 OUT="$OUT/ptests" bash scripts/gpu_suite.sh > "$OUT/ptests.log" 2>&1
  tail -n 5 "$OUT/ptests.log"
fi
if has rowint; then
  # Edge tiles masked by one key interval per row (FwdConfig.row_intervals): its bitwise GPU test, then the
  # A/B against the default (bitwise everywhere by construction; ab.py's check column shows it).
  SUITE_K="row_intervals" LIMIT=200 PROCS=6 OUT="$OUT/rtests" bash scripts/gpu_suite.sh > "$OUT/rtests.log" 2>&1
  tail -n 5 "$OUT/rtests.log"
  ab rowint 240 --fuzz 2 --fwd main:default --fwd main:sm90pppmar_m128_n128_w4_s3 \
    --fwd main:sm90pppmakr_m128_n128_w4_s2 \
    --cases doc128-32k,doc16-32k,doc1024-32k,causal-8k,swa2048-32k,doc128-32k-d64,causal-8k-d64,full-8k
  # The backward's (BwdConfig.row_intervals, flag "rows"), against the defaults' shapes at head dims 128 and 64
  # (dynamic: the short-slot default; the bitwise check is against main:default, whose schedule has the same bits).
  ab browint 240 --fuzz 2 --bwd main:default --bwd "main:64,128,8,3,128,64,8,3,dkdv+dq+persistent+dynamic+rows" \
    --bwd "main:64,128,8,3,128,64,8,3,dkdv+dq+persistent+rows" --cases doc128-32k,doc16-32k,causal-8k,swa2048-32k
  ab browint64 150 --fuzz 2 --fuzz-d 64 --bwd main:default \
    --bwd "main:64,128,8,3,128,128,8,3,dkdv+dq+persistent+dynamic+rows" \
    --bwd "main:64,128,8,3,128,128,8,3,dkdv+dq+persistent+rows" --cases doc128-32k-d64,doc16-32k-d64,causal-8k-d64
fi
if has bexp2; then
  ab bexp2 150 --fuzz 3 --fuzz-d 64 --bwd main:default --bwd bhalfpoly:default \
    --cases full-8k-d64,causal-8k-d64,doc16-32k-d64,full-8k
fi
if has exp2bench; then
  # After exp2: the polynomial config that beat the head-dim-64 default by at least 2% (geometric mean over the
  # A/B's head-dim-64 cases) becomes that default in this call's copy of the tree only, and the public call is
  # timed beside cuDNN on the head-dim-64 bar cases (the repository's default changes only by a commit).
  pick=$(python - "$OUT/exp2/ab.json" <<'PY'
import json, math, sys
rows = [r for r in json.load(open(sys.argv[1])) if r["dir"] == "fwd" and r["case"].endswith("-d64")]
base = {r["case"]: r["median_ms"] for r in rows if r["variant"] == "main:default"}
best, best_mean = "", 0.98
for name in ("sm90pppmax1_m128_n128_w4_s3", "sm90pppmax2_m128_n128_w4_s3"):
    mine = {r["case"]: r["median_ms"] for r in rows if r["variant"] == "main:" + name}
    if base and set(mine) == set(base):
        mean = math.exp(sum(math.log(mine[c] / base[c]) for c in base) / len(base))
        print(f"{name}: {mean:.4f} of the default at head dim 64", file=sys.stderr)
        if mean < best_mean:
            best, best_mean = name, mean
print(best)
PY
)
  echo "exp2 pick: ${pick:-none}" | tee -a "$OUT/rc.txt"
  if [ -n "$pick" ]; then
    sed -i "s/^    64: \"sm90pppma_m128_n128_w4_s3\",/    64: \"$pick\",/" flashrange/kernels/forward.py
    grep -n "^    64: " flashrange/kernels/forward.py | head -2
    timeout 150 python -m flashrange bench --quick --time-budget 120 --contenders flashrange,flashrange-op,sdpa-cudnn \
      --cases full-8k-d64,causal-8k-d64,doc16-32k-d64 --out "$OUT/exp2bench" > "$OUT/exp2bench.log" 2>&1
    echo "exp2bench rc=$?" | tee -a "$OUT/rc.txt"; python scripts/bench_table.py "$OUT/exp2bench/bench.json"
  fi
fi
if has dqparts; then
  a="64,128,8,3,128,128,8,3,dkdv+persistent+atomic"
  ab dqparts 280 --bwd pre:default --bwd "pre:$a" --bwd "noreduce:$a" --bwd "nostage:$a" \
    --cases full-8k-d64,causal-8k-d64,doc16-32k-d64
  timeout 200 python scripts/profile_call.py --cases full-8k-d64,doc16-32k-d64,full-8k,causal-8k --reps 5 \
    > "$OUT/profile.log" 2>&1
  echo "profile rc=$?" | tee -a "$OUT/rc.txt"; tail -n 40 "$OUT/profile.log"
fi
if has defaults; then
  # The defaults chosen by shape (constants.has_short_slices) against the previous fixed defaults, through the
  # launchers (export the old defaults first: bash scripts/ab_export.sh a937242 prev), after their GPU tests.
  SUITE_K="default or mean_slot_length or plan_triton_equals" LIMIT=150 PROCS=8 OUT="$OUT/dtests" \
    bash scripts/gpu_suite.sh > "$OUT/dtests.log" 2>&1
  cat "$OUT/dtests/summary.txt"
  # blockcausal and sharedq: few slots over long key ranges, so "short" by the rule while their work is
  # dense-like (not yet timed with the short-slice schedules).
  ab dfwd 120 --fuzz 1 --fwd prev:default --fwd main:default \
    --cases doc16-32k,doc128-32k,blockcausal-32k,sharedq-32k,causal-8k,full-8k,full-16k-gqa32:8
  ab dbwd 120 --fuzz 1 --bwd prev:default --bwd main:default \
    --cases doc16-32k,doc128-32k,blockcausal-32k,sharedq-32k,causal-8k,full-8k
fi
if has tests; then
  # Side by side (scripts/gpu_suite.sh), the fuzzes left to the whole suite.
  SUITE_K="(dynamic or adaptive or merg) and not fuzz" LIMIT=200 OUT="$OUT/tests" bash scripts/gpu_suite.sh \
    > "$OUT/tests.log" 2>&1
  tail -n 25 "$OUT/tests.log"
  if [ -s "$OUT/tests/rc.txt" ] && ! grep -qv " rc=0$" "$OUT/tests/rc.txt"; then adaptive_ok=1; fi
  echo "tests ok=${adaptive_ok:-0}" | tee -a "$OUT/rc.txt"
fi
if has fwd; then
  # The adaptive schedule joins the A/B only once its GPU tests passed (a kernel that hangs would take the
  # whole A/B with it).
  adaptive=""
  [ "${adaptive_ok:-0}" = 1 ] && adaptive="--fwd main:sm90pppma_m128_n128_w4_s3 --fwd main:sm90pppmak_m128_n128_w4_s2"
  ab fwd 300 --fuzz 2 --fwd main:default --fwd main:sm90pppmd_m128_n128_w4_s3 $adaptive \
    --fwd main:sm90pppmk_m128_n128_w4_s2 \
    --cases doc16-32k,doc128-32k,doc1024-32k,longshort-32k,causal-8k,full-8k,causal-32k,full-16k-gqa32:8
  # Kept on the warm machine for a second call (FlashAttention-4's bench of the pick; scripts/fa4_bench.sh).
  mkdir -p /tmp/keep && cp "$OUT/fwd/ab.json" /tmp/keep/fwd_ab.json && : > /tmp/keep/pick_args.txt
  python scripts/pick_default.py "$OUT/fwd/ab.json"
fi
if has trace; then
  timeout 120 python scripts/trace_items.py --cases doc128-32k,doc16-32k \
    --configs default,sm90pppmd_m128_n128_w4_s3 --out "$OUT/trace" > "$OUT/trace.log" 2>&1
  echo "trace rc=$?" | tee -a "$OUT/rc.txt"; cat "$OUT/trace.log" | tail -20
fi
if has bwd; then
  bwd_adaptive=""
  [ "${adaptive_ok:-0}" = 1 ] && bwd_adaptive="--bwd main:64,128,8,3,128,64,8,3,dkdv+dq+persistent+dynamic+adaptive"
  ab bwd 200 --fuzz 3 --bwd main:default --bwd "main:64,128,8,3,128,64,8,3,dkdv+dq+persistent+dynamic" \
    $bwd_adaptive --cases doc16-32k,doc128-32k,longshort-32k,sharedq-32k,causal-8k,full-8k,swa2048-32k
fi
if has fbgap; then
  # The planned call's forward + backward gap (BENCHMARKS.md, twenty-sixth session): per-call times and
  # per-kernel tables of the public call and the call with a plan, on the cases that showed it.
  timeout 200 python scripts/profile_call.py --cases causal-32k,full-16k-gqa32:8 --reps 7 --plan \
    > "$OUT/fbgap.log" 2>&1
  echo "fbgap rc=$?" | tee -a "$OUT/rc.txt"; grep -A8 "^---" "$OUT/fbgap.log" | cut -c1-150
fi
if has d64; then
  # Head dim 64 keeps the fixed-share forward (sm90pppm) and backward on every mask: the schedules that head
  # dim 128 takes for short slots (constants.has_short_slices) were never timed there.
  d64cases=doc16-32k-d64,doc128-32k-d64,swa2048-32k-d64,causal-8k-d64,full-8k-d64
  ab d64fwd 180 --fuzz 2 --fuzz-d 64 --fwd main:default --fwd main:sm90pppma_m128_n128_w4_s3 \
    --fwd main:sm90pppmak_m128_n128_w4_s2 --fwd main:sm90pppmd_m128_n128_w4_s3 --cases "$d64cases"
  ab d64bwd 150 --fuzz 2 --fuzz-d 64 --bwd main:default \
    --bwd "main:64,128,8,3,128,128,8,3,dkdv+dq+persistent+dynamic" --cases "$d64cases"
fi
if has host; then
  # The host's cost per call (flashrange bench --host: eager public call, with plan=, raw op, compiled, CUDA
  # graph, SDPA) at 1k, 4k and 8k.
  timeout 150 python -m flashrange bench --host --no-table --quick --out "$OUT/host" > "$OUT/host.log" 2>&1
  echo "host rc=$?" | tee -a "$OUT/rc.txt"; grep "^|" "$OUT/host.log" | head -30
fi
if has plan; then
  # PLAN_AGAINST: one or more exported variants, each timed beside this checkout's plan in its own process.
  for name in ${PLAN_AGAINST:?name the exported plan variants}; do
    timeout 90 python scripts/plan_cost.py --against "$name" > "$OUT/plan_$name.log" 2>&1
    echo "plan $name rc=$?" | tee -a "$OUT/rc.txt"; sed -n '/^mask /,$p' "$OUT/plan_$name.log"
  done
fi
