#!/usr/bin/env bash
# compute-sanitizer memcheck over the Triton kernels, on a GPU machine:
#
#   bash scripts/sanitize.sh        (from anywhere; OUT defaults to ./out/sanitize in the repository)
#
# Runs under `compute-sanitizer --tool memcheck`:
#   1. a sample of the GPU fuzz (tests/test_gpu_fuzz.py), as two steps: SANITIZE_CASES (200) garbage-range
#      cases forward, then SANITIZE_BWD_CASES (40) of them backward (each calls the reference too, slow under memcheck):
#      ranges outside the tensors, reversed, empty, unknown types, +-2**30;
#   2. the strided-view case with element offsets past 2**31
#      (tests/test_gpu_backward.py::test_offsets_past_int32_in_a_strided_view).
# PyTorch's caching allocator is switched off (PYTORCH_NO_CUDA_MEMORY_CACHING=1) so that an access past a
# tensor is past its allocation, where memcheck sees it. Prints each step's error count and the total;
# logs in $OUT. Exit status: 0 when every step ran and memcheck found no error, 1 otherwise, 2 when
# compute-sanitizer is not installed. Extras: PYTHON (default python3), SANITIZER (its path).

source "$(dirname "$0")/common.sh" out/sanitize

SAN="${SANITIZER:-}"
if [ -z "$SAN" ]; then
    SAN="$(command -v compute-sanitizer || true)"
fi
if [ -z "$SAN" ]; then
    SAN="$(ls /usr/local/cuda*/bin/compute-sanitizer /opt/nvidia/*/compute-sanitizer/compute-sanitizer 2>/dev/null | head -1 || true)"
fi
if [ -z "$SAN" ] || [ ! -x "$SAN" ]; then
    echo "sanitize: compute-sanitizer not found (PATH, /usr/local/cuda*/bin); nothing run"
    exit 2
fi
echo "sanitize: $SAN ($("$SAN" --version 2>/dev/null | tail -1))"

export PYTORCH_NO_CUDA_MEMORY_CACHING=1
export FLASHRANGE_FUZZ_CASES="${SANITIZE_CASES:-200}"
export FLASHRANGE_FUZZ_BWD_CASES="${SANITIZE_BWD_CASES:-40}"

total=0
failed=0
run_step() {  # name, pytest selection
    local name="$1" sel="$2" log="$OUT/$1.log" rc errors
    "$SAN" --tool memcheck --target-processes all --error-exitcode 0 --print-limit 20 \
        "$PY" -m pytest -q -p no:cacheprovider -m gpu -s "$sel" >"$log" 2>&1
    rc=$?
    # "========= ERROR SUMMARY: N errors" (one line per process; a crash may leave none).
    errors=$(grep -Eo 'ERROR SUMMARY: [0-9]+' "$log" | awk '{s += $3} END {print s + 0}')
    total=$((total + errors))
    if [ "$rc" -ne 0 ] || [ "$errors" -ne 0 ]; then
        failed=1
    fi
    printf 'sanitize: %-28s memcheck errors: %s   pytest exit: %s   (%s)\n' "$name" "$errors" "$rc" "$log"
    grep -E 'GPU fuzz|passed|failed|error' "$log" | grep -v '^=========' | tail -3 | sed 's/^/    /'
}

run_step fuzz-forward "tests/test_gpu_fuzz.py::test_fuzz_forward_garbage_ranges"
run_step fuzz-backward "tests/test_gpu_fuzz.py::test_fuzz_backward_garbage_ranges"
run_step strided-int64 "tests/test_gpu_backward.py::test_offsets_past_int32_in_a_strided_view"

echo "sanitize: $total memcheck errors in total"
exit "$failed"
