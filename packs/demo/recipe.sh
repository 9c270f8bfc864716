#!/bin/sh
# One command for the demo pair: packs/demo/recipe.sh OUT [target-minutes] [gen-minutes] [draft-minutes]
# Needs Debian's OpenBLAS for fast F32 GEMMs on MLX's CPU backend (apt-get install libopenblas0-pthread).
set -e
OUT=${1:?usage: recipe.sh OUT [target-minutes] [gen-minutes] [draft-minutes]}
HERE=$(dirname "$0")
BLAS=/usr/lib/x86_64-linux-gnu/libopenblas.so.0
[ -e "$BLAS" ] && export LD_PRELOAD="$BLAS${LD_PRELOAD:+:$LD_PRELOAD}"
python "$HERE/train.py" --out "$OUT" --minutes "${2:-15}"
python "$HERE/draft.py" --out "$OUT" --gen-minutes "${3:-4}" --minutes "${4:-7}"
python "$HERE/../../bench/acceptance.py" --pair "$OUT" --json "$OUT/acceptance.json"
