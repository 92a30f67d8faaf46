#!/usr/bin/env bash
# The runs of one device call, edited per session (logs under $OUT). Fourteenth session: the whole GPU
# test suite in four pytest processes side by side (one GPU; compiles, which are CPU-bound and dominate a
# fresh machine, share one Triton cache and the 16 cores), since one process could not finish in a call.
set -u
OUT="${OUT:-out}"; mkdir -p "$OUT"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm --format=csv | tee "$OUT/gpu.txt"
run_group() {  # name, test files...
  local name=$1; shift
  timeout 540 python -m pytest -q -p no:cacheprovider -rfE -m gpu "$@" --durations=8 \
    > "$OUT/pytest_$name.log" 2>&1
  echo "$name rc=$?" >> "$OUT/rc.txt"
}
run_group fuzz tests/test_gpu_fuzz.py &
run_group backward tests/test_gpu_backward.py &
run_group forward tests/test_gpu_forward.py tests/test_gpu_features.py &
run_group rest tests/test_gpu_eager.py tests/test_head_dims.py tests/test_kernel_forward.py \
  tests/test_transformers.py tests/test_validation.py tests/test_bench.py tests/test_distributed.py \
  tests/test_compile_sm90.py &
wait
cat "$OUT/rc.txt"
for f in "$OUT"/pytest_*.log; do echo "== $f"; tail -n 14 "$f"; done
