#!/usr/bin/env bash
# The public-call bench beside FlashAttention-4, in the second of two consecutive device calls (the machine
# stays warm between them; see ../shared/tools/fa4-stage.sh, run here first):
#   call 1: carry [".fa4/A"]   command: anything (e.g. OUT=$OUT bash scripts/ab_call.sh)
#   call 2: carry [".fa4/B"]   command: OUT=$OUT bash scripts/fa4_bench.sh [bench arguments]
# With PICK=1, the forward config that call 1's A/B found fastest (/tmp/keep/fwd_ab.json, scripts/ab_call.sh)
# is made the head-dim-128 default in this call's copy of the tree first (scripts/pick_default.py --apply; a
# pick from a pending patch, /tmp/keep/pick_args.txt, applies that patch to the copy too).
# .fa4/A stays on the warm machine from call 1. A .fa4/site left by an earlier install is removed first:
# reinstalling over it failed (sixteenth session). Without arguments: every bar case, one process.
set -u
OUT="${OUT:-out}"; mkdir -p "$OUT"
[ -d .fa4/A ] && [ -d .fa4/B ] || { echo "fa4_bench.sh: .fa4/A (call 1) and .fa4/B (this call) must both be here"; exit 2; }
rm -rf .fa4/site
source .fa4/A/install.sh
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
if [ "${PICK:-0}" = 1 ] && [ -f /tmp/keep/fwd_ab.json ]; then
  python scripts/pick_default.py /tmp/keep/fwd_ab.json --apply $(cat /tmp/keep/pick_args.txt 2>/dev/null) \
    | tee "$OUT/pick.txt"
fi
if [ $# -eq 0 ]; then
  set -- --quick --time-budget 200 --contenders flashrange,flashrange-op,flashrange+plan,sdpa-cudnn,fa4 \
    --cases causal-8k,full-8k,doc128-32k,doc16-32k,full-8k-d64,causal-8k-d64,swa2048-32k,causal-32k,full-16k-gqa32:8,causal-8k-mqa
fi
python -m flashrange bench "$@" --out "$OUT" > "$OUT/bench.log" 2>&1
echo "bench rc=$?"
python scripts/bench_table.py "$OUT/bench.json"
