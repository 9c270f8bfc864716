"""Train the demo target's MTP head (docs/drafts.md 6) against the target as it is served,
then export it as BF16 `mtp.*` tensors in model_mtp.safetensors beside the target's
checkpoint (unsloth's layout).

    LD_PRELOAD=/usr/lib/x86_64-linux-gnu/libopenblas.so.0 \
        python packs/demo/mtp.py --out build/demo [--windows 1600] [--steps 3000]

Reads OUT/target (the NVFP4 target train.py exported; with --target DIR, a copy of that
checkpoint is made there first when OUT/target is missing, e.g. the bundled
packs/demo/target). Stages (skipped when their output exists, unless --force):
  1. rows   -> OUT/mtp_rows.npz: random windows of the corpus's training files (never
     the held-out ones) through the served target (monolith's own loader, F32 compute):
     every row's hidden state after the final norm (what MTPDrafter feeds the head,
     mtp_drafter.HIDDEN_TAP) and the target's top-TOPK next-token distribution and argmax
  2. head   -> OUT/mtp_train.npz, OUT/mtp_log.json: the head's parameters (mtp.fc, its
     three norms, mtp.layers.0 with the target's full attention and MoE), with the
     target's embedding and lm_head frozen. Row t's step 1 predicts x_{t+2}; its chained
     step 2 reads step 1's output and x_{t+2} and predicts x_{t+3} (as the runtime chains
     proposals). Loss: distillation, cross-entropy against the served target's
     distribution at row t + 1 (step 1) and t + 2 (step 2), top TOPK renormalized
  3. export -> OUT/target/model_mtp.safetensors and model.safetensors.index.json: the
     index puts every mtp.* tensor in model_mtp.safetensors (the target's
     model.safetensors keeps the untrained head synth wrote, unread), then the head
     loaded by models.load_mtp from a --with-mtp pack is checked against the mirror
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import mlx.core as mx
import mlx.optimizers as optim
import numpy as np

sys.path.insert(0, str(Path(__file__).parent))
import model as M  # noqa: E402
import train as T  # noqa: E402
from draft import TOPK, learning_rate, log  # noqa: E402
from mtp_mirror import MTP, init_mtp, mtp_forward, mtp_loss  # noqa: E402
from target_files import MTP_FILES, adopt_target, frozen_target, train_stream  # noqa: E402

WINDOW = 256  # tokens per training window (the target's training length)
BATCH_SEQS = 4
STEP_WEIGHTS = (1.0, 1.0)  # loss weight of chained step 1, step 2 (--chained-steps 1: step 1 alone)
AUX_COEF = 0.01
SEPARATE, INDEX = MTP_FILES


# ---------------------------------------------------------------- stage 1: the served target's rows


def stage_rows(out: Path, count: int, seed: int, force: bool) -> dict[str, np.ndarray]:
    path = out / "mtp_rows.npz"
    if path.exists() and not force:
        z = np.load(path)
        if len(z["seqs"]) >= count:
            return {k: z[k][:count] for k in z.files}
    from monolith.engine_setup import load_target
    from monolith.models.qwen3_5 import FINAL_NORM_TAP

    stream = train_stream(out, out / "target")
    starts = np.random.default_rng(seed + 7).integers(0, stream.size - WINDOW, count)
    seqs = np.stack([stream[s:s + WINDOW] for s in starts]).astype(np.int32)
    model = load_target(out / "target", dtype="float32", cache_dir=out / "packs")
    t0, rows = time.time(), {"hidden": [], "soft_ids": [], "soft_p": [], "greedy": []}
    for seq in seqs:
        logits, hidden = model.forward(mx.array(seq), model.make_cache(WINDOW), taps=[FINAL_NORM_TAP])
        top = mx.argpartition(-logits, TOPK - 1, axis=-1)[:, :TOPK]
        p = mx.take_along_axis(mx.softmax(logits, axis=-1), top, -1)
        mx.eval(hidden, top, p)
        rows["hidden"].append(np.array(hidden))
        rows["soft_ids"].append(np.array(top).astype(np.int32))
        rows["soft_p"].append(np.array(p / p.sum(-1, keepdims=True)))
        rows["greedy"].append(np.array(mx.argmax(logits, -1)).astype(np.int32))
    rows = {"seqs": seqs, **{k: np.stack(v) for k, v in rows.items()}}
    np.savez(path, **rows)
    log(f"rows: {count} windows of {WINDOW} through the served target in {time.time() - t0:.0f}s")
    return rows


# ---------------------------------------------------------------- stage 2: training


def batch(rows, idx):
    return tuple(mx.array(rows[k][idx]) for k in ("hidden", "seqs", "soft_ids", "soft_p", "greedy"))


def stage_head(out: Path, rows, seed: int, steps: int, force: bool, chained: int = 2):
    path = out / "mtp_train.npz"
    if path.exists() and not force:
        z = np.load(path)
        return {k: mx.array(z[k]) for k in z.files}
    p, frozen = T.PRESET, frozen_target(out / "target")
    P = init_mtp(p, seed)
    log(f"head: {sum(v.size for v in P.values()) / 1e6:.2f} M parameters, {len(rows['seqs'])} windows")
    weights = mx.array(STEP_WEIGHTS[:chained])
    lf = lambda P, *b: mtp_loss(P, frozen, *b, p, chained, weights, AUX_COEF)  # noqa: E731
    vg = mx.compile(mx.value_and_grad(lf))
    opt = optim.AdamW(learning_rate=1e-3, weight_decay=0.01, betas=[0.9, 0.95])
    rng = np.random.default_rng(seed + 8)
    n_val = max(8, len(rows["seqs"]) // 20)  # validation: the first windows (never trained on)
    val = batch(rows, np.arange(n_val))
    curve, t0 = [], time.time()
    for step in range(1, steps + 1):
        opt.learning_rate = mx.array(learning_rate(step - 1, steps))
        (_, (ce, acc)), grads = vg(P, *batch(rows, rng.choice(np.arange(n_val, len(rows["seqs"])), BATCH_SEQS,
                                                                  replace=False)))
        grads, _ = optim.clip_grad_norm(grads, 1.0)
        P = opt.apply_gradients(grads, P)
        mx.eval(P, opt.state, ce)
        if step % 50 == 0 or step in (1, steps):
            entry = {"step": step, "seconds": round(time.time() - t0, 1), "ce": np.round(np.array(ce), 4).tolist(),
                     "acc": np.round(np.array(acc), 4).tolist()}
            if step % 250 == 0 or step == steps:
                _, (vce, vacc) = lf(P, *val)
                entry.update(val_ce=np.round(np.array(vce), 4).tolist(), val_acc=np.round(np.array(vacc), 4).tolist())
            curve.append(entry)
            log(json.dumps(entry))
    final = {k: curve[-1][k] for k in ("step", "seconds", "val_ce", "val_acc")}
    (out / "mtp_log.json").write_text(json.dumps({"windows": len(rows["seqs"]), "validation_windows": n_val,
                                                  "chained_steps": chained, "batch": BATCH_SEQS,
                                                  "final": final, "curve": curve}, indent=1) + "\n")
    np.savez(path, **{k: np.array(v) for k, v in P.items()})
    return P


# ---------------------------------------------------------------- stage 3: export and check


def export_head(P, target: Path) -> None:
    """model_mtp.safetensors (BF16, experts per expert as the target's) and the index that
    puts every mtp.* tensor there, every other tensor in model.safetensors."""
    from monolith.formats.stfile import SafetensorsFile, write_safetensors
    from monolith.synth.values import bf16_bits
    from monolith.synth.writers import ST_METADATA, write_json

    values = M.export_values(P)
    main = SafetensorsFile(target / "model.safetensors")
    inline = sorted(n for n in main.names() if n.startswith(f"{MTP}."))
    if inline and sorted(values) != inline:
        raise SystemExit(f"error: the head's tensors differ from the {len(inline)} mtp.* names of {target}")
    write_safetensors(target / SEPARATE, {n: ("BF16", bf16_bits(v)) for n, v in values.items()}, ST_METADATA)
    weight_map = {**{n: "model.safetensors" for n in main.names()}, **{n: SEPARATE for n in values}}
    sizes = {**{n: main.nbytes(n) for n in main.names()}, **{n: v.size * 2 for n, v in values.items()}}
    main.close()
    write_json(target / INDEX, {"metadata": {"total_size": sum(sizes.values())},
                                "weight_map": dict(sorted(weight_map.items()))})


def read_head(target: Path) -> dict[str, mx.array]:
    """The head exported beside `target` (read through its index), as the mirror's F32
    parameters (experts stacked again)."""
    from monolith.checkpoint import open_checkpoint

    ckpt = open_checkpoint(target)
    P, experts = {}, {}
    for name in ckpt.tensor_names():
        if name.startswith(f"{MTP}.") and ".mlp.experts." in name:
            base, e, leaf, _ = name.rsplit(".", 3)
            experts.setdefault(f"{base}.{leaf}", {})[int(e)] = ckpt.read_float(name)
        elif name.startswith(f"{MTP}."):
            P[name] = mx.array(ckpt.read_float(name))
    P.update({k: mx.array(np.stack([v[e] for e in sorted(v)])) for k, v in experts.items()})
    return P


def check_runtime(target: Path, cache: Path, P, seq: np.ndarray, n: int = 96) -> float:
    """The exported head, loaded by models.load_mtp from a --with-mtp pack of `target`
    (quantization none: the BF16 head as exported) with that target, vs the mirror on
    BF16-rounded weights, over seq (n + 2 tokens or more): step 1 over rows 0..n-1, then
    the chained step 2 of row n-1. Max |logit diff|."""
    from monolith.models import load_model, load_mtp
    from monolith.models.qwen3_5 import FINAL_NORM_TAP
    from monolith.pack import resolve_pack

    pack = resolve_pack(target, role="target", quantization="none", cache_dir=cache, with_mtp=True)
    model = load_model(pack, dtype="float32")
    head = load_mtp(pack, model)
    _, hidden = model.forward(mx.array(seq[:n]), model.make_cache(WINDOW), taps=[FINAL_NORM_TAP])
    cache = head.make_cache(WINDOW)
    out1, logits1 = head(hidden, mx.array(seq[1:n + 1]), cache)
    _, logits2 = head(out1[-1:], mx.array(seq[n + 1:n + 2]), cache)
    Pb = {k: v.astype(mx.bfloat16).astype(mx.float32) for k, v in P.items()}
    (m1, m2), _ = mtp_forward(Pb, frozen_target(target), hidden[None], mx.array(seq[None, :n + 2]), T.PRESET)
    diff = max(float(mx.abs(m1[0] - logits1).max()), float(mx.abs(m2[0, -1] - logits2[-1]).max()))
    agree = float((mx.argmax(m1[0], -1) == mx.argmax(logits1, -1)).astype(mx.float32).mean())
    log(f"mtp check: max |logit diff| runtime vs mirror {diff:.4g} (|logits| max {float(mx.abs(logits1).max()):.3g}), "
        f"step-1 argmax agreement {agree:.3f}")
    return diff


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, default=Path("build/demo"))
    ap.add_argument("--target", type=Path, default=None,
                    help="the target checkpoint to copy to OUT/target when that is missing (e.g. packs/demo/target)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--windows", type=int, default=1600, help="training-corpus windows of 256 tokens")
    ap.add_argument("--steps", type=int, default=3000, help="head training steps")
    ap.add_argument("--chained-steps", type=int, choices=(1, 2), default=2,
                    help="train step 1 alone, or step 1 and the chained step 2 (the recipe)")
    ap.add_argument("--force", action="store_true")
    args = ap.parse_args()
    adopt_target(args.out, args.target)
    rows = stage_rows(args.out, args.windows, args.seed, args.force)
    P = stage_head(args.out, rows, args.seed, args.steps, args.force, args.chained_steps)
    export_head(P, args.out / "target")
    log(f"exported {args.out / 'target' / SEPARATE} ({(args.out / 'target' / SEPARATE).stat().st_size / 1e6:.2f} MB)")
    check_runtime(args.out / "target", args.out / "packs", P, rows["seqs"][0])


if __name__ == "__main__":
    main()
