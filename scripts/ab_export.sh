#!/usr/bin/env bash
# Export flashrange's kernels as of git ref REF into ab/NAME/flashrange_NAME, for scripts/ab.py:
#   bash scripts/ab_export.sh REF NAME        (then carry "ab" to the GPU machine)
# The copy's __init__.py is emptied: only its kernels (and what they import) are used, and the
# public ops of the checked-out flashrange stay the only ones registered.
set -euo pipefail
cd "$(dirname "$0")/.."
ref=$1 name=$2
dest="ab/$name"
rm -rf "$dest" && mkdir -p "$dest"
git archive "$ref" flashrange | tar -x -C "$dest"
mv "$dest/flashrange" "$dest/flashrange_$name"
: > "$dest/flashrange_$name/__init__.py"
echo "exported $(git rev-parse --short "$ref") as $dest/flashrange_$name"
