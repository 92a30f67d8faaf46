#!/usr/bin/env bash
# One command for the H200: GPU tests, then the benchmark, short table last.
#
#   bash scripts/h200.sh            (from the repository root; OUT defaults to ./out)
#
# Writes under $OUT (at most 7 files): env.txt, pytest_gpu.log, bench.log,
# bench.json, bench.md, bench.png. Prints the GPU-test summary and the bench's
# short table last. Budgets (seconds, environment variables):
#   PYTEST_BUDGET (180)  whole GPU-test run;   PYTEST_TEST_TIMEOUT (120) one test
#   BENCH_BUDGET  (270)  bench stops starting new work after this, and is
#                        interrupted (report still written) 45 s later
# Worst case about 8.5 minutes. Extras: BENCH_ARGS (e.g. "--quick" or
# "--cases 'causal-*'"), PYTEST_ARGS (e.g. "-k 'not every_config'"), SKIP_TESTS=1,
# SKIP_BENCH=1.
# Exit status: 0 when the tests pass and the bench finds no error or mismatch.

set -u -o pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1
OUT="${OUT:-$PWD/out}"
mkdir -p "$OUT"
PY="${PYTHON:-python3}"
PYTEST_BUDGET="${PYTEST_BUDGET:-180}"
PYTEST_TEST_TIMEOUT="${PYTEST_TEST_TIMEOUT:-120}"
BENCH_BUDGET="${BENCH_BUDGET:-270}"
BENCH_ARGS="${BENCH_ARGS:-}"
PYTEST_ARGS="${PYTEST_ARGS:-}"
t0=$(date +%s)

{
    date -u
    nvidia-smi 2>&1 || echo "nvidia-smi: not available"
    "$PY" - <<'EOF' 2>&1
import platform, torch
print("python", platform.python_version(), "| torch", torch.__version__, "| cuda", torch.version.cuda,
      "| cudnn", torch.backends.cudnn.version() if torch.cuda.is_available() else None)
try:
    import triton; print("triton", triton.__version__)
except ImportError:
    print("triton: not installed")
print("gpu:", torch.cuda.get_device_name(0) if torch.cuda.is_available() else "none")
EOF
} >"$OUT/env.txt" 2>&1
head -n 40 "$OUT/env.txt" | grep -E "^(python|triton|gpu:)" || true

test_rc=0
test_summary="GPU tests: skipped (SKIP_TESTS=1)"
if [ "${SKIP_TESTS:-0}" != "1" ]; then
    timeout_flag=()
    if "$PY" -c "import pytest_timeout" 2>/dev/null; then
        timeout_flag=(--timeout="$PYTEST_TEST_TIMEOUT")
    fi
    echo "== GPU tests (budget ${PYTEST_BUDGET}s) -> $OUT/pytest_gpu.log"
    timeout -s INT -k 15 "$PYTEST_BUDGET" "$PY" -m pytest -m gpu -q -rfE -p no:cacheprovider \
        ${timeout_flag[@]+"${timeout_flag[@]}"} $PYTEST_ARGS tests >"$OUT/pytest_gpu.log" 2>&1
    test_rc=$?
    if [ "$test_rc" -eq 124 ] || [ "$test_rc" -eq 130 ] || [ "$test_rc" -eq 137 ]; then
        test_summary="GPU tests: STOPPED at the ${PYTEST_BUDGET}s budget (rc $test_rc); see pytest_gpu.log"
    elif [ "$test_rc" -eq 5 ]; then
        test_summary="GPU tests: none collected (-m gpu)"
        test_rc=0
    else
        test_summary="GPU tests (rc $test_rc): $(grep -E '(passed|failed|error|skipped|no tests ran)' "$OUT/pytest_gpu.log" | tail -n 1)"
    fi
    echo "$test_summary ($(( $(date +%s) - t0 ))s so far)"
fi

bench_rc=0
if [ "${SKIP_BENCH:-0}" != "1" ]; then
    echo "== bench (budget ${BENCH_BUDGET}s) -> $OUT/bench.log"
    # shellcheck disable=SC2086  # BENCH_ARGS is split on purpose
    timeout -s INT -k 20 $(( BENCH_BUDGET + 45 )) "$PY" -m flashrange bench --out "$OUT" \
        --time-budget "$BENCH_BUDGET" $BENCH_ARGS >"$OUT/bench.log" 2>&1
    bench_rc=$?
    grep -E "^!!!" "$OUT/bench.log" | head -n 20 || true
fi

echo
echo "== $(( $(date +%s) - t0 ))s in all; logs and results in $OUT"
echo "$test_summary"
if [ -n "${test_rc}" ] && [ "$test_rc" -ne 0 ]; then
    grep -E "^(FAILED|ERROR)" "$OUT/pytest_gpu.log" | head -n 15 || true
fi
if [ "${SKIP_BENCH:-0}" != "1" ]; then
    if [ -s "$OUT/bench.json" ]; then
        echo "bench rc $bench_rc (JSON/markdown/PNG in $OUT)"
        echo
        "$PY" -m flashrange bench --report-only "$OUT/bench.json" --short
    else
        echo "bench: no results (rc $bench_rc); last lines of bench.log:"
        tail -n 30 "$OUT/bench.log"
    fi
fi
[ "$test_rc" -eq 0 ] && [ "$bench_rc" -eq 0 ]
