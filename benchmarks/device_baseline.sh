#!/usr/bin/env bash
# The engine a GPU measurement compares against, for the device run to carry: `git archive` of REV (default: the
# commit before the GPU-engine work, d3cd457) into .baseline/ (git-ignored; about 1.5 MB: code only, no model, docs,
# tests or results), which benchmarks/device_run.sh's baseline_decode step times with its own profile_decode.
#   bash benchmarks/device_baseline.sh [REV] [DEST]; then run(..., carry=[".wheels", ".baseline"])
set -eu
REV=${1:-d3cd457}
DEST=${2:-.baseline}
rm -rf "$DEST"
mkdir -p "$DEST"
git archive "$REV" -- . ':!models/braid-reference' ':!benchmarks/results' ':!docs' ':!tests' ':!helm' | tar -x -C "$DEST"
echo "$REV" > "$DEST/REVISION"
du -sh "$DEST"
