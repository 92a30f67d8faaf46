# Sourced by scripts/h200.sh and scripts/sanitize.sh, with OUT's default (relative to the repository) as $1:
# strict mode, the repository as working directory and on PYTHONPATH, unbuffered Python, $OUT created,
# PY (PYTHON, default python3).

set -u -o pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1
OUT="${OUT:-$PWD/$1}"
mkdir -p "$OUT"
PY="${PYTHON:-python3}"
