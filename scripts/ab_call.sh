#!/usr/bin/env bash
# The runs of one device call, edited per session (logs under $OUT). Seventeenth session: (1) the Hopper
# forward whose softmax runs under its own previous P V, two ways: "late" (the query half released after the
# softmax, which ends its basic block) and main (the early release kept, a never-taken branch ending the
# block), against "prev" (neither); prev and late are main's tree with forward_sm90.py edited by hand (their
# sixteenth-session commits were lost), exported with scripts/ab_export.sh; (2) two ring stages at head dim
# 128, which store O in 16-byte runs (sm90pppm_m128_n128_w4_s2), against the default three. Carry "ab".
set -u
OUT="${OUT:-out}"; mkdir -p "$OUT"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm --format=csv | tee "$OUT/gpu.txt"
ab() {  # name, ab.py args...
  local name=$1; shift
  timeout 280 python scripts/ab.py --reps 11 --out "$OUT/$name" "$@" > "$OUT/ab_$name.log" 2>&1
  echo "$name rc=$?" | tee -a "$OUT/rc.txt"; grep "^| " "$OUT/ab_$name.log"; grep -i "fail\|error" "$OUT/ab_$name.log" | head -5
}
ab overlap --fuzz 6 --cases full-8k,causal-8k,doc16-32k,doc128-32k,swa2048-32k,full-8k-d64,causal-8k-d64,causal-32k \
  --fwd prev:default --fwd late:default --fwd main:default
ab stages --cases full-8k,causal-8k,doc16-32k,doc128-32k,doc1024-32k \
  --fwd main:default --fwd main:sm90pppm_m128_n128_w4_s2
