"""What the stages after train.py read of the target: its NVFP4 checkpoint in OUT/target
(the one the bundle ships), and the training token stream. draft.py and mtp.py need
nothing else of train.py's outputs, so either can start from a copy of a trained target
(`--target DIR`, e.g. packs/demo/target) in an empty OUT."""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

import mlx.core as mx
import numpy as np

import model as M

MTP_FILES = ("model_mtp.safetensors", "model.safetensors.index.json")  # mtp.py's export of the head


def adopt_target(out: Path, target: Path | None) -> Path:
    """OUT/target: train.py's export, or, when that is missing, a copy of the checkpoint
    `target` without an MTP head (mtp.py exports its own). Exits naming what is missing."""
    dest = out / "target"
    if (dest / "config.json").is_file():
        return dest
    if target is None:
        sys.exit(f"error: {dest}: no target checkpoint (run train.py, or give --target)")
    if not (target / "config.json").is_file():
        sys.exit(f"error: --target {target}: no config.json, not a checkpoint directory")
    dest.mkdir(parents=True, exist_ok=True)
    for f in target.iterdir():
        if f.is_file() and f.name not in MTP_FILES:
            shutil.copyfile(f, dest / f.name)
    return dest


def frozen_target(target: Path) -> dict[str, mx.array]:
    """The target's embedding and lm_head as stored (BF16 values in F32): what the runtime
    binds to a draft and to the MTP head."""
    from monolith.checkpoint import open_checkpoint

    ckpt = open_checkpoint(target)
    return {"embed_tokens": mx.array(ckpt.read_float(f"{M.LM}.embed_tokens.weight")),
            "lm_head": mx.array(ckpt.read_float("lm_head.weight"))}


def train_stream(out: Path, target: Path) -> np.ndarray:
    """The training token stream: OUT/tokens.npz "train" (train.py), or rebuilt as
    train.py builds it (the corpus's training files and chat transcripts, seed 0) with the
    target's tokenizer and chat template."""
    if (out / "tokens.npz").is_file():
        return np.load(out / "tokens.npz")["train"]
    import corpus
    import train as T

    train_docs, held_docs, info = corpus.load()
    ids = T.token_streams((target / "tokenizer.json").read_text(encoding="utf-8"), target, train_docs, held_docs,
                          0)["train"]
    print(f"rows: training stream rebuilt from the corpus (sha256 {info['sha256'][:16]}...) and transcripts, "
          f"{ids.size} tokens", flush=True)
    return ids
