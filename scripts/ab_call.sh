#!/usr/bin/env bash
# The runs of one device call, edited per session (logs under $OUT). Nineteenth session: the dynamic
# schedule (programs take items from a shared counter; forward config sm90pppmd, backward flag "dynamic")
# against the fixed zig-zag share of the defaults, its GPU tests.
set -u
OUT="${OUT:-out}"; mkdir -p "$OUT"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm --format=csv | tee "$OUT/gpu.txt"
ab() {  # name, time limit (s), ab.py args...
  local name=$1; shift
  local limit=$1; shift
  timeout "$limit" python scripts/ab.py --reps 9 --out "$OUT/$name" "$@" > "$OUT/ab_$name.log" 2>&1
  echo "$name rc=$?" | tee -a "$OUT/rc.txt"; grep -E "^\| |ms  \(|^!!!" "$OUT/ab_$name.log"; grep -i "fail\|error" "$OUT/ab_$name.log" | head -5
}
ab dyn 130 --fuzz 3 --fwd main:default --fwd main:sm90pppmd_m128_n128_w4_s3 \
  --cases doc16-32k,doc128-32k,doc16-128k,causal-8k
timeout 90 python -m pytest -q -p no:cacheprovider -rfE -m gpu tests/test_gpu_forward.py tests/test_gpu_backward.py \
  -k "dynamic_schedule" > "$OUT/pytest_dyn.log" 2>&1
echo "pytest rc=$?" | tee -a "$OUT/rc.txt"; tail -5 "$OUT/pytest_dyn.log"
