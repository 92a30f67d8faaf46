#!/usr/bin/env bash
# The runs of one device call, edited per session (logs under $OUT). As left by the eleventh session: the
# GPU tests that the by-rows dK/dV default (landed after that session's GPU tests ran) has not yet passed,
# then FlashAttention-4's first half kept for the next call (carry ".fa4/A"; see scripts/h200.sh), whose
# public-call bench then runs with it:
#   mkdir -p .fa4 && cp -r /tmp/fa4A .fa4/A && source .fa4/A/install.sh && python -m flashrange bench --quick ...
set -u
OUT="${OUT:-out}"; mkdir -p "$OUT"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
[ -d .fa4/A ] && cp -r .fa4/A /tmp/fa4A
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm --format=csv | tee "$OUT/gpu.txt"
timeout 280 python -m pytest -q -p no:cacheprovider -rfE tests/test_gpu_backward.py \
  -k "by_rows or default_and_builds or falls_back or (gluon_backward_fuzz and persistent) or bitwise_the_same" \
  2>&1 | tail -n 15 | tee "$OUT/pytest_bwd.log"
timeout 250 python -m pytest -q -p no:cacheprovider -rfE tests/test_gpu_backward.py tests/test_gpu_fuzz.py \
  -k "gluon_backward_realistic or random_slice_fuzz or fuzz_backward_garbage" 2>&1 | tail -n 15 | tee "$OUT/pytest_bwd2.log"
