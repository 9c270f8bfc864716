#!/bin/sh
# Regenerate tests/data/speculators/ (DSpark heads) and tests/data/speculators-mtp/ (MTP
# heads) with the speculators package itself, in a venv of its own (speculators 0.9.0
# pins transformers <= 5.19, ours is newer).
# torch 2.13.0 is the CPU wheel on local disk (an unpinned torch would pull a CUDA build);
# the torchvision / torchaudio wheels pip picks for it do not match torch 2.13.0 and
# break transformers' import, and speculators' DSpark and MTP code need neither: they are removed.
set -e
VENV="${SPECULATORS_VENV:-/tmp/venv-spec}"
if [ ! -x "$VENV/bin/python" ]; then
    python3.11 -m venv "$VENV"
    "$VENV/bin/pip" install "speculators==0.9.0" "torch==2.13.0"
    "$VENV/bin/pip" uninstall -y torchvision torchaudio
fi
"$VENV/bin/python" "$(dirname "$0")/speculators_goldens.py"
"$VENV/bin/python" "$(dirname "$0")/speculators_mtp_goldens.py"
