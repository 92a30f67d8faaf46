#!/usr/bin/env bash
# One command for the GPU machine: GPU tests, bench correctness checks, timings, short table last.
#
#   bash scripts/h200.sh            (from anywhere; OUT defaults to ./out in the repository)
#
# In order:
#   1. the GPU tests            python -m pytest -m gpu tests           -> $OUT/pytest_gpu.log
#   2. the bench checks         flashrange bench --check                -> $OUT/check.log, $OUT/check/bench.{json,md}
#      (every case, every contender but compiled Flex, one call each, compared with the baseline; no timing)
#   3. the timings              flashrange bench --plan-cost --host     -> $OUT/bench.log, $OUT/bench.{json,md,png}
#   4. the transformers step    flashrange bench --e2e --no-table       -> $OUT/e2e.log, $OUT/e2e/bench.{json,md}
#   5. summaries, and the timing run's short table last.
# $OUT/env.txt records the GPU, driver and library versions.
#
# Budgets (seconds, environment variables); each step stops starting new work
# at its budget, writes its report, and is interrupted 30 s later at worst:
#   PYTEST_BUDGET (150)  whole GPU-test run;   PYTEST_TEST_TIMEOUT (120) one test
#   CHECK_BUDGET   (60)  bench checks
#   BENCH_BUDGET  (200)  timings (cases run in registry order; the last are dropped first)
#   E2E_BUDGET     (75)  transformers training step
# Worst case about 10 minutes. Extras: BENCH_ARGS (e.g. "--quick" or "--cases 'causal-*'"), CHECK_ARGS,
# E2E_ARGS (each passed to its bench step; "--tiny" on all three tries the script on a CPU),
# PYTEST_ARGS (e.g. "-k 'not every_config'"), SKIP_TESTS=1, SKIP_CHECK=1, SKIP_BENCH=1, SKIP_E2E=1,
# PYTHON (default python3).
#
# FlashAttention-4: the GPU machine has no network. Stage FA4 with the team's tools/fa4-stage.sh (it fills
# .fa4/A and .fa4/B, each under the carry limit, so they travel in two consecutive calls). The device tool
# may drop .fa4/A before the second call: keep a copy outside the repository on the machine. Call 1 carries
# .fa4/A and runs  cp -r .fa4/A /tmp/fa4A ; call 2 carries .fa4/B and runs
#   mkdir -p .fa4 && cp -r /tmp/fa4A .fa4/A && source .fa4/A/install.sh && bash scripts/h200.sh
# install.sh puts FA4 on PYTHONPATH, which this script keeps; the bench then lists fa4 among its contenders
# (env.txt says whether it imported).
#
# Exit status: 0 when the tests pass and no bench step finds an error or a mismatch.

source "$(dirname "$0")/common.sh" out
PYTEST_BUDGET="${PYTEST_BUDGET:-150}"
PYTEST_TEST_TIMEOUT="${PYTEST_TEST_TIMEOUT:-120}"
CHECK_BUDGET="${CHECK_BUDGET:-60}"
BENCH_BUDGET="${BENCH_BUDGET:-200}"
E2E_BUDGET="${E2E_BUDGET:-75}"
BENCH_ARGS="${BENCH_ARGS:-}"
CHECK_ARGS="${CHECK_ARGS:-}"
E2E_ARGS="${E2E_ARGS:-}"
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
try:
    from flash_attn.cute.interface import flash_attn_func  # noqa: F401
    print("fa4: importable")
except Exception as e:  # noqa: BLE001
    print("fa4: not importable (" + type(e).__name__ + ")")
print("gpu:", torch.cuda.get_device_name(0) if torch.cuda.is_available() else "none")
EOF
} >"$OUT/env.txt" 2>&1
grep -E "^(python|triton|fa4|gpu:)" "$OUT/env.txt" || true

# $1: step name, $2: budget, $3: log, rest: the bench command's arguments.
run_bench() {
    local name=$1 budget=$2 log=$3
    shift 3
    echo "== $name (budget ${budget}s) -> $log"
    timeout -s INT -k 15 $(( budget + 30 )) "$PY" -m flashrange bench --time-budget "$budget" "$@" >"$log" 2>&1
    local rc=$?
    grep -E "^!!!" "$log" | head -n 20 || true
    echo "$name: rc $rc ($(( $(date +%s) - t0 ))s so far)"
    return $rc
}

test_rc=0
test_summary="GPU tests: skipped (SKIP_TESTS=1)"
if [ "${SKIP_TESTS:-0}" != "1" ]; then
    timeout_flag=()
    if "$PY" -c "import pytest_timeout" 2>/dev/null; then
        timeout_flag=(--timeout="$PYTEST_TEST_TIMEOUT")
    fi
    echo "== GPU tests (budget ${PYTEST_BUDGET}s) -> $OUT/pytest_gpu.log"
    # shellcheck disable=SC2086  # PYTEST_ARGS is split on purpose
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

check_rc=0
if [ "${SKIP_CHECK:-0}" != "1" ]; then
    # shellcheck disable=SC2086
    run_bench "bench checks" "$CHECK_BUDGET" "$OUT/check.log" --check --out "$OUT/check" $CHECK_ARGS
    check_rc=$?
fi

bench_rc=0
if [ "${SKIP_BENCH:-0}" != "1" ]; then
    # shellcheck disable=SC2086
    run_bench "timings" "$BENCH_BUDGET" "$OUT/bench.log" --plan-cost --host --out "$OUT" $BENCH_ARGS
    bench_rc=$?
fi

e2e_rc=0
if [ "${SKIP_E2E:-0}" != "1" ]; then
    # shellcheck disable=SC2086
    run_bench "transformers step" "$E2E_BUDGET" "$OUT/e2e.log" --e2e --no-table --out "$OUT/e2e" $E2E_ARGS
    e2e_rc=$?
fi

echo
echo "== $(( $(date +%s) - t0 ))s in all; logs and results in $OUT"
echo "$test_summary"
if [ "$test_rc" -ne 0 ]; then
    grep -E "^(FAILED|ERROR)" "$OUT/pytest_gpu.log" | head -n 15 || true
fi
if [ "${SKIP_CHECK:-0}" != "1" ]; then
    if [ -s "$OUT/check/bench.json" ]; then
        echo "bench checks (rc $check_rc): $("$PY" -m flashrange bench --report-only "$OUT/check/bench.json" --short | grep -E '^(correctness|errors)')"
    else
        echo "bench checks: no results (rc $check_rc); last lines of check.log:"
        tail -n 15 "$OUT/check.log"
    fi
fi
if [ "${SKIP_E2E:-0}" != "1" ] && [ -s "$OUT/e2e/bench.md" ]; then
    echo
    awk '/^## transformers/{p=1} p' "$OUT/e2e/bench.md"
fi
if [ "${SKIP_BENCH:-0}" != "1" ]; then
    echo
    if [ -s "$OUT/bench.json" ]; then
        echo "timings rc $bench_rc (JSON/markdown/PNG in $OUT)"
        echo
        "$PY" -m flashrange bench --report-only "$OUT/bench.json" --short
    else
        echo "timings: no results (rc $bench_rc); last lines of bench.log:"
        tail -n 30 "$OUT/bench.log"
    fi
fi
[ "$test_rc" -eq 0 ] && [ "$check_rc" -eq 0 ] && [ "$bench_rc" -eq 0 ] && [ "$e2e_rc" -eq 0 ]
