#!/usr/bin/env bash
# The runs of one device call, edited per session (logs under $OUT). Fourteenth session, second call: the
# Gluon dK/dV kernel that also adds dQ with atomics (BwdConfig.atomic_dq) checked (GPU test, fuzz against
# float64) and timed against the default backward; then the forward's GPU tests, which the first call's
# limit cut, in three processes side by side.
set -u
OUT="${OUT:-out}"; mkdir -p "$OUT"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm --format=csv | tee "$OUT/gpu.txt"
timeout 150 python -m pytest -q -p no:cacheprovider -rfE -m gpu tests/test_gpu_backward.py -k atomic \
  > "$OUT/pytest_atomic.log" 2>&1
tail -n 5 "$OUT/pytest_atomic.log"
timeout 200 python scripts/ab.py --fuzz 24 --bwd main:default --bwd "main:64,128,8,3,128,64,8,3,dkdv+persistent+atomic" \
  --cases full-8k,causal-8k,causal-32k,full-16k-gqa32:8,swa2048-32k,doc16-32k,doc128-32k --reps 11 --out "$OUT" \
  > "$OUT/ab.log" 2>&1
tail -n 25 "$OUT/ab.log"
run_group() {  # name, pytest args...
  local name=$1; shift
  timeout 200 python -m pytest -q -p no:cacheprovider -rfE -m gpu "$@" > "$OUT/pytest_$name.log" 2>&1
  echo "$name rc=$?" >> "$OUT/rc.txt"
}
run_group fwd1 tests/test_gpu_forward.py -k "not fuzz and not every_config" &
run_group fwd2 tests/test_gpu_forward.py -k "fuzz or every_config" &
run_group features tests/test_gpu_features.py &
wait
cat "$OUT/rc.txt"
for f in "$OUT"/pytest_fwd*.log "$OUT"/pytest_features.log; do echo "== $f"; tail -n 6 "$f"; done
