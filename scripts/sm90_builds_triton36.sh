#!/usr/bin/env bash
# Build every default GPU launch for sm_90 with Triton 3.6 (tests/sm90_builds.py), in a venv of its own
# (.venv36): the oldest Triton flashrange supports and the one on the GPU machine. Gluon's API moves between
# Triton releases, so a build that passes with the suite's Triton can still fail there. Exits non-zero on any
# failed build, or when this Triton cannot build for sm_90 at all (the builder's exit 3).
set -euo pipefail
cd "$(dirname "$0")/.."
if [ ! -x .venv36/bin/python ]; then
  python3 -m venv .venv36
  .venv36/bin/pip install -q torch==2.13.0
  # torch 2.13 asks for a newer Triton: 3.6 goes in beside it, without its dependencies.
  .venv36/bin/pip install -q --no-deps triton==3.6.0 numpy
fi
version=$(.venv36/bin/python -c "import triton; print(triton.__version__)")
[ "$version" = "3.6.0" ] || { echo "sm90_builds_triton36.sh: .venv36 has Triton $version, not 3.6.0"; exit 1; }
cache=$(mktemp -d)
trap 'rm -rf "$cache"' EXIT
TRITON_INTERPRET=0 CUDA_VISIBLE_DEVICES="" TRITON_CACHE_DIR="$cache" PYTHONPATH="$PWD" \
  .venv36/bin/python tests/sm90_builds.py > "$cache/builds.log" 2>&1 || { tail -40 "$cache/builds.log"; echo "sm_90 builds with Triton 3.6 failed"; exit 1; }
tail -1 "$cache/builds.log" | sed 's/^/Triton 3.6: /'
