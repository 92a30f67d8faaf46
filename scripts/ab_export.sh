#!/usr/bin/env bash
# Export flashrange's kernels as of git ref REF into ab/NAME/flashrange_NAME, for scripts/ab.py:
#   bash scripts/ab_export.sh REF NAME [PATCH]     (then carry "ab" to the GPU machine)
# PATCH (a diff of flashrange/, as `git diff flashrange/` writes it) is applied to the copy: a variant that
# lives only as a patch (scripts/pending/) is A/B'd without touching the working tree.
# The copy's __init__.py is emptied: only its kernels (and what they import) are used, and the
# public ops of the checked-out flashrange stay the only ones registered.
set -euo pipefail
cd "$(dirname "$0")/.."
ref=$1 name=$2 patch=${3:-}
dest="ab/$name"
rm -rf "$dest" && mkdir -p "$dest"
git archive "$ref" flashrange | tar -x -C "$dest"
if [ -n "$patch" ]; then
  git apply --unsafe-paths --directory="$dest" "$patch"
fi
mv "$dest/flashrange" "$dest/flashrange_$name"
: > "$dest/flashrange_$name/__init__.py"
echo "exported $(git rev-parse --short "$ref")${patch:+ + $patch} as $dest/flashrange_$name"
