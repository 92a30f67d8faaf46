#!/usr/bin/env bash
# The whole GPU test suite in one device call (logs under $OUT): every GPU-marked test under tests/, cut into
# many pytest processes that run side by side, PROCS at a time (default 10 of the machine's 16 cores; each
# process holds GPU memory too). On a fresh machine compiling dominates, and one compile takes one core (the
# processes share one Triton cache); scripts/gpu_shards.py says how the tests are cut (each fuzz alone, the
# others in runs of one file).
# SUITE_K="dynamic or adaptive" keeps only what pytest -k selects; LIMIT (seconds, default 540) bounds each
# process. Prints each process's result line, then every failure. Each process also appends its result line
# and failures to $OUT/summary.txt as it ends, so a call cut short (or one that brings back only some of the
# many logs) still says what ran.
set -u
OUT="${OUT:-out}"; mkdir -p "$OUT"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm --format=csv | tee "$OUT/gpu.txt"
k_args=()
[ -n "${SUITE_K:-}" ] && k_args=(-k "$SUITE_K")
python -m pytest --collect-only -q -p no:cacheprovider -m gpu "${k_args[@]}" tests > "$OUT/collect.log" 2>&1
n=$(python scripts/gpu_shards.py --out "$OUT/shards" < "$OUT/collect.log") || { tail -20 "$OUT/collect.log"; exit 1; }
echo "gpu_suite: $(grep -c '::' "$OUT/collect.log") tests in $n processes, ${PROCS:-10} at a time"
run_shard() {  # one shard file: its node ids, one a line
  local name ids
  name=$(basename "$1" .txt)
  mapfile -t ids < "$1"
  timeout "${LIMIT:-540}" python -m pytest -q -p no:cacheprovider -rfE -m gpu "${ids[@]}" --durations=3 \
    > "$OUT/pytest_$name.log" 2>&1
  local rc=$?
  echo "$name rc=$rc" >> "$OUT/rc.txt"
  { echo "$name rc=$rc: $(tail -n 1 "$OUT/pytest_$name.log")"; grep -h "^FAILED\|^ERROR" "$OUT/pytest_$name.log"; } \
    >> "$OUT/summary.txt"
}
export -f run_shard
export OUT LIMIT
ls "$OUT"/shards/shard_*.txt | xargs -P "${PROCS:-10}" -I{} bash -c 'run_shard "$1"' _ {}
sort "$OUT/rc.txt" | grep -v " rc=0$" || echo "gpu_suite: every process exited 0"
for f in "$OUT"/pytest_shard_*.log; do echo "$(basename "$f" .log): $(tail -n 1 "$f")"; done
grep -h "^FAILED\|^ERROR" "$OUT"/pytest_shard_*.log || true
