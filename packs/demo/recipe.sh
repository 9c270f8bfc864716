#!/bin/sh
# The demo pair in one command (fixed seeds and step counts; about 170 min on 2 quiet CPU cores: see README.md):
#   sh packs/demo/recipe.sh OUT        then   python packs/demo/bundle.py OUT
# tokenizer (the bundled one, kept) + the corpus and chat transcripts + target (train.py),
# the target's generations + DSpark draft (draft.py), the target's MTP head (mtp.py), then
# tau / speedup on held-out prompts (bench/acceptance.py -> OUT/acceptance.json) and the
# assistant measures on held-out transcripts (bench/demo.py -> OUT/demo.json).
# Logs: OUT/train.log, OUT/draft.log, OUT/mtp.log, OUT/acceptance.log, OUT/demo.log. Uses Debian's OpenBLAS for
# fast F32 GEMMs on MLX's CPU backend when it is installed (apt-get install libopenblas0-pthread).
set -e
OUT=${1:?usage: recipe.sh OUT}
HERE=$(dirname "$0")
REPO=$(cd "$HERE/../.." && pwd)
BLAS=/usr/lib/x86_64-linux-gnu/libopenblas.so.0
[ -e "$BLAS" ] && export LD_PRELOAD="$BLAS${LD_PRELOAD:+:$LD_PRELOAD}"
mkdir -p "$OUT"
python "$HERE/train.py" --out "$OUT" --steps 2400 --seed 0 > "$OUT/train.log" 2>&1
python "$HERE/draft.py" --out "$OUT" --generations 1200 --corpus-windows 2400 --steps 7000 --qat-steps 1500 --seed 0 > "$OUT/draft.log" 2>&1
python "$HERE/mtp.py" --out "$OUT" --windows 800 --steps 800 --seed 0 > "$OUT/mtp.log" 2>&1
PYTHONPATH="$REPO${PYTHONPATH:+:$PYTHONPATH}" python -m bench.acceptance --pair "$OUT" --json "$OUT/acceptance.json" > "$OUT/acceptance.log" 2>&1
PYTHONPATH="$REPO${PYTHONPATH:+:$PYTHONPATH}" python -m bench.demo --pair "$OUT" --label "recipe output $OUT" --json "$OUT/demo.json" > "$OUT/demo.log" 2>&1
tail -n 8 "$OUT/acceptance.log"
tail -n 10 "$OUT/demo.log"
