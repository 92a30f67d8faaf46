#!/usr/bin/env bash
# The whole GPU test suite in one device call (logs under $OUT), as seven pytest processes side by side: one
# process cannot finish it in a call on a fresh machine, where compiling dominates (CPU-bound, 16 cores, one
# shared Triton cache). The groups are sized from the fourteenth session's runs (the largest, the Hopper
# forward fuzz, took about 4 minutes).
# SUITE_GROUPS="fwd-fuzz backward" runs only those groups; LIMIT (seconds, default 560) bounds each.
set -u
OUT="${OUT:-out}"; mkdir -p "$OUT"
SUITE_GROUPS="${SUITE_GROUPS:-backward garbage rest fwd-configs fwd-fuzz fwd-rest features}"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm --format=csv | tee "$OUT/gpu.txt"
run_group() {  # name, pytest args...
  local name=$1; shift
  [[ " $SUITE_GROUPS " == *" $name "* ]] || return 0
  timeout "${LIMIT:-560}" python -m pytest -q -p no:cacheprovider -rfE -m gpu "$@" --durations=5 > "$OUT/pytest_$name.log" 2>&1
  echo "$name rc=$?" >> "$OUT/rc.txt"
}
F=tests/test_gpu_forward.py
run_group backward tests/test_gpu_backward.py &
run_group garbage tests/test_gpu_fuzz.py &
run_group rest tests/test_gpu_eager.py tests/test_head_dims.py tests/test_kernel_forward.py tests/test_transformers.py \
  tests/test_validation.py tests/test_bench.py tests/test_distributed.py tests/test_compile_sm90.py &
run_group fwd-configs "$F" -k "every_config" &
run_group fwd-fuzz "$F" -k "fuzz_hopper" &
run_group fwd-rest "$F" -k "not every_config and not fuzz_hopper" &
run_group features tests/test_gpu_features.py &
wait
cat "$OUT/rc.txt"
for f in "$OUT"/pytest_*.log; do echo "== $f"; tail -n 9 "$f"; done
