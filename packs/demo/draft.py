"""Train the demo DSpark draft on the target's OWN generations, with the target's tap
features as context, then export it as DeepSpec BF16 and DeepSpec NVFP4 (LithosAI style:
every draft matrix W4A16 NVFP4, Markov W1 kept BF16). Neither export carries an embedding
or an lm_head: the runtime binds the target's (docs/drafts.md section 1), the ones the draft trained with.

    LD_PRELOAD=/usr/lib/x86_64-linux-gnu/libopenblas.so.0 \
        python packs/demo/draft.py --out build/demo [--generations 1200] [--corpus-windows 2400] \
            [--steps 7000] [--qat-steps 1500]

Reads OUT/target (the NVFP4 target train.py exported; with --target DIR, a copy of that
checkpoint is made there first when OUT/target is missing) and the training token stream
(OUT/tokens.npz, or rebuilt). Stages (skipped when their output exists):
  1. generate -> OUT/generations.npz: continuations of training-corpus prompts by our
     runtime (the served NVFP4 target, F32 compute), prompt + continuation per row; every other one
     greedy, the rest sampled with the target's generation_config (what serve uses). A
     larger --generations extends an earlier file exactly as one run would.
  2. draft    -> OUT/draft_train.npz, OUT/draft_log.json: trained on the generations and on
     random 256-token windows of the training corpus (more contexts than the
     generations alone: the slot loss distills the target, so any context teaches it);
     the last --qat-steps train through fake_nvfp4 (quantization-aware: the forward sees
     the values the NVFP4 export decodes to, the gradient passes straight through)
  3. export   -> OUT/draft-bf16/ (deepspec) and OUT/draft/ (deepspec-nvfp4)

Training mirrors monolith.models.dspark exactly (draft_mirror.py): context C = hidden_norm(fc(taps)) of
rows < p, block [s_p, mask x (B-1)] at positions p.., queries attend to all context rows
< p and their whole block (no mask inside the block), slot k predicts s_{p+k+1} with
logits lm_head(norm(h_k)) + W2 W1[s_{p+k}] (teacher-forced Markov prev), the target's
frozen embedding and lm_head, confidence head trained (BCE, detached inputs) on
whether slot k's argmax is right. The slot loss is distillation: cross-entropy against the
served (NVFP4) target's own next-token distribution at that row (its top TOPK
probabilities, renormalized), so the draft's argmax follows the target's (greedy
acceptance) and its distribution follows the target's (acceptance when sampling).
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import time
from pathlib import Path

import mlx.core as mx
import mlx.optimizers as optim
import numpy as np

sys.path.insert(0, str(Path(__file__).parent))
import tokenizer as demo_tok  # noqa: E402
import train as T  # noqa: E402
from draft_mirror import (  # noqa: E402
    block_layout,
    draft_forward,
    draft_loss,
    fake_nvfp4,
    init_draft,
    quantized,
)
from target_files import adopt_target, frozen_target, train_stream  # noqa: E402

from monolith.synth.draft_config import DraftSizes  # noqa: E402

SIZES = DraftSizes(num_layers=3, num_heads=4, num_kv_heads=2, head_dim=64, intermediate_size=768,
                   target_layer_ids=(1, 2, 3), markov_rank=32, draft_vocab_size=2048, sliding_window=4096,
                   block_size=8)
PROMPT_LEN = 64
GEN_LEN = 192
GEN_BATCH = 16  # generations stepped together
BLOCKS_PER_SEQ = 24
BATCH_SEQS = 4
TOPK = 32  # target probabilities kept per row for distillation


def log(*a):
    print(*a, flush=True)


# ---------------------------------------------------------------- stage 1: generations


def stage_generate(out: Path, train_ids: np.ndarray, count: int, seed: int, force: bool):
    """`count` generations: draw i is a prompt of the training stream, continued greedily
    when i is even, else sampled (seed from i) with the target's generation_config; draws
    run GEN_BATCH at a time, batch k always draws GEN_BATCH * k.., and a continuation
    that stops early (EOS) is skipped. The first ones of an earlier run are kept: a larger
    --generations, or a run killed half way (saved after every batch), goes on with
    exactly what one run of `count` gives."""
    path = out / "generations.npz"
    done = np.load(path)["seqs"] if path.exists() and not force else np.zeros((0, PROMPT_LEN + GEN_LEN), np.int32)
    if len(done) >= count:
        return done[:count]
    from monolith.engine_setup import load_target
    from monolith.runtime.decoder import Decoder
    from monolith.sampling import SamplingParams

    model = load_target(out / "target", dtype="float32", cache_dir=out / "packs")
    decoder = Decoder(model, None, PROMPT_LEN + GEN_LEN + 16)
    config = json.loads((out / "target" / "generation_config.json").read_text())
    rng = np.random.default_rng(seed + 1)
    seqs, t0, gen_tokens, first = [], time.time(), 0, 0
    while len(seqs) < count:
        prompts = []
        for _ in range(GEN_BATCH):
            s = int(rng.integers(0, train_ids.size - PROMPT_LEN))
            prompts.append(train_ids[s:s + PROMPT_LEN].tolist())
        params = [SamplingParams(temperature=0.0) if (first + j) % 2 == 0 else SamplingParams(
            config.get("temperature", 1.0), config.get("top_p", 1.0), config.get("top_k", 0), 0.0,
            seed=seed * 100_000 + first + j) for j in range(GEN_BATCH)]
        first += GEN_BATCH
        outputs = None
        for j, prompt in enumerate(prompts):
            if len(seqs) == count:
                break
            if len(seqs) < len(done):  # replaying: this draw was kept, or stopped early (EOS) and skipped
                if done[len(seqs), :PROMPT_LEN].tolist() == prompt:
                    seqs.append(done[len(seqs)].tolist())
                continue
            if outputs is None:  # the whole batch, as one run steps it
                outputs = generate_batch(decoder, prompts, params)
            ids = (prompt + outputs[j])[:PROMPT_LEN + GEN_LEN]
            if len(ids) == PROMPT_LEN + GEN_LEN:  # else stopped early (EOS): skipped
                seqs.append(ids)
                gen_tokens += GEN_LEN
        if outputs is not None:  # a run killed later replays these and goes on
            np.savez(path, seqs=np.array(seqs, dtype=np.int32))
            log(f"generate: {len(seqs)} seqs, {gen_tokens / (time.time() - t0):.1f} tok/s")
    seqs = np.array(seqs, dtype=np.int32)
    np.savez(path, seqs=seqs)
    log(f"generate: {len(seqs)} sequences of {PROMPT_LEN}+{GEN_LEN} in {time.time() - t0:.0f}s")
    return seqs


def generate_batch(decoder, prompts: list[list[int]], params: list) -> list[list[int]]:
    """GEN_LEN tokens after each prompt, the sequences stepped together (runtime.batch:
    each one's output is its output alone, in a third of the time for 8)."""
    from monolith.runtime.batch import Batch
    from monolith.runtime.generation import Generation, Tokens
    from monolith.runtime.session import Session

    batch = Batch()
    members = [batch.add(decoder.steps(Generation(prompt, GEN_LEN, p, frozenset(), None, session=Session(),
                                                  emitter=Tokens()))) for prompt, p in zip(prompts, params)]
    while len(batch):
        batch.step()
    for m in members:
        if m.error is not None:
            raise m.error
    return [list(m.outcome.token_ids) for m in members]


# ---------------------------------------------------------------- stage 2: training


def served_target_rows(out: Path, seqs: np.ndarray, taps) -> tuple[np.ndarray, ...]:
    """What the served target gives every row of every sequence, through monolith's own
    runtime on the NVFP4 checkpoint (the one the bundle ships, F32 compute): tap features
    [N, L, len(taps) * H], its top-TOPK next-token ids and renormalized probabilities
    [N, L, TOPK], and its argmax [N, L]. The draft learns the quantized target it will
    serve with, not the BF16 one it was exported from."""
    from monolith.engine_setup import load_target

    model = load_target(out / "target", dtype="float32", cache_dir=out / "packs")
    feats, ids, probs, greedy = [], [], [], []
    for seq in seqs:
        logits, f = model.forward(mx.array(seq), model.make_cache(seq.size), taps=list(taps))
        top = mx.argpartition(-logits, TOPK - 1, axis=-1)[:, :TOPK]
        p = mx.take_along_axis(mx.softmax(logits, axis=-1), top, -1)
        mx.eval(f, top, p)
        feats.append(np.array(f))
        ids.append(np.array(top).astype(np.int32))
        probs.append(np.array(p / p.sum(-1, keepdims=True)))
        greedy.append(np.array(mx.argmax(logits, -1)).astype(np.int32))
    return tuple(np.stack(a) for a in (feats, ids, probs, greedy))


def stage_draft(out: Path, seqs: np.ndarray, seed: int, steps: int, force: bool,
                windows: np.ndarray | None = None, qat_steps: int = 0, hard: float = 0.0):
    path = out / "draft_train.npz"
    if path.exists() and not force:
        z = np.load(path)
        return {k: mx.array(z[k]) for k in z.files}
    p, s = T.PRESET, SIZES
    n_generations = len(seqs)
    if windows is not None:
        seqs = np.concatenate([seqs, windows])
    mask_id = special_ids(out)["<|mask|>"]
    P, frozen = init_draft(p.hidden_size, p.vocab_size, s, seed), frozen_target(out / "target")
    t0 = time.time()
    served = served_target_rows(out, seqs, s.target_layer_ids)
    log(f"draft: features {served[0].shape} and top-{TOPK} target distributions in {time.time() - t0:.0f}s")
    n_val = max(4, n_generations // 10)  # validation: the first generations (never trained on)

    def batch_of(rng, idx):
        return make_batch(rng, idx, seqs, served, mask_id)

    progress = T.Progress(out, "draft", fresh=force)
    P, curve, step = train_draft(P, frozen, batch_of, n_val, len(seqs), seed, steps, qat_steps, hard, progress)
    (out / "draft_log.json").write_text(json.dumps({"steps": step, "sequences": len(seqs), "curve": curve},
                                                   indent=1) + "\n")
    np.savez(path, **{k: np.array(v) for k, v in P.items()})
    progress.clear()
    return P


def special_ids(out: Path) -> dict[str, int]:
    """The special tokens' ids in the target's tokenizer."""
    return demo_tok.special_ids((out / "target" / "tokenizer.json").read_text(encoding="utf-8"))


def make_batch(rng, idx, seqs: np.ndarray, served: tuple[np.ndarray, ...], mask_id: int):
    """BLOCKS_PER_SEQ blocks in each sequence of `idx`, anchored at random rows: the
    arguments of draft_loss before its weights, from the served target's rows."""
    feats, soft_ids, soft_p, greedy = served
    bsz = SIZES.block_size
    L = seqs.shape[1]
    # anchors after the first PROMPT_LEN rows (a generation's prompt, a window's first rows: context only)
    lo, hi = PROMPT_LEN, L - bsz
    anchors = np.sort(rng.choice(np.arange(lo, hi), size=BLOCKS_PER_SEQ, replace=False))
    pos, mask = block_layout(L, anchors, bsz)
    sq = seqs[idx]
    x_tokens = np.full((len(idx), anchors.size, bsz), mask_id, np.int32)
    x_tokens[:, :, 0] = sq[:, anchors]
    prev = sq[:, pos]
    rows = np.ix_(idx, pos)  # the target's distribution at row p predicts token p + 1
    return (mx.array(feats[idx]), mx.array(x_tokens.reshape(len(idx), -1)), mx.array(prev),
            mx.array(greedy[rows]), mx.array(soft_ids[rows]), mx.array(soft_p[rows]), mx.array(pos),
            mx.array(mask))


def draft_losses(frozen, hard: float):
    """(loss, loss through the NVFP4 export's values) of (trainable params, *batch): the
    slot weights decay along the block."""
    bsz = SIZES.block_size
    wts = mx.array(np.tile(np.exp(-np.arange(bsz) / bsz), BLOCKS_PER_SEQ).astype(np.float32))
    lf = lambda P, *b: draft_loss(P, frozen, *b, wts, SIZES, T.PRESET.rope_theta, hard)  # noqa: E731

    def lf_qat(P, *b):  # the last qat_steps: the forward sees the NVFP4 export's values
        return lf({k: fake_nvfp4(v) if quantized(k) else v for k, v in P.items()}, *b)

    return lf, lf_qat


def learning_rate(step: int, steps: int) -> float:
    """30 steps of warm-up, then a cosine down to a tenth."""
    frac = step / steps
    return 1e-3 * min(1.0, (step + 1) / 30) * (0.1 + 0.9 * 0.5 * (1 + np.cos(np.pi * frac)))


def train_draft(P, frozen, batch_of, n_val: int, n_seqs: int, seed: int, steps: int, qat_steps: int,
                hard: float, progress=None):
    """AdamW on sequences n_val.. (the last qat_steps quantization-aware) -> (trained
    params, the logged curve, steps run); every 100 steps a validation batch of the first.
    With a `progress` (train.Progress), saved every SAVE_EVERY steps and resumed from."""
    lf, lf_qat = draft_losses(frozen, hard)
    vg, vg_qat = mx.compile(mx.value_and_grad(lf)), mx.compile(mx.value_and_grad(lf_qat))
    opt = optim.AdamW(learning_rate=1e-3, weight_decay=0.01, betas=[0.9, 0.95])
    rng = np.random.default_rng(seed + 3)
    curve, spent, step = [], 0.0, 0
    if progress is not None:
        P, step, curve, spent = progress.load(P, opt, rng)
    t0 = time.time() - spent
    train_idx = np.arange(n_val, n_seqs)
    while step < steps:
        opt.learning_rate = mx.array(learning_rate(step, steps))
        batch = batch_of(rng, rng.choice(train_idx, size=BATCH_SEQS, replace=False))
        qat = step >= steps - qat_steps
        (loss, (ce, acc, bce)), grads = (vg_qat if qat else vg)(P, *batch)
        grads, _ = optim.clip_grad_norm(grads, 1.0)
        P = opt.apply_gradients(grads, P)
        mx.eval(P, opt.state, ce)
        step += 1
        if step % 25 == 0 or step == 1:
            entry = {"step": step, "seconds": round(time.time() - t0, 1), "ce": round(float(ce), 4),
                     "slot_acc": round(float(acc), 4), "conf_bce": round(float(bce), 4), "qat": qat}
            if step % 100 == 0:
                vb = batch_of(np.random.default_rng(7), np.arange(min(n_val, BATCH_SEQS)))
                _, (vce, vacc, _) = (lf_qat if qat else lf)(P, *vb)
                entry.update(val_ce=round(float(vce), 4), val_slot_acc=round(float(vacc), 4))
            curve.append(entry)
            log(json.dumps(entry))
        if progress is not None and step % T.SAVE_EVERY == 0 and step < steps:
            progress.save(P, opt, rng, step, curve, time.time() - t0)
    return P, curve, step


# ---------------------------------------------------------------- stage 3: export


def export_draft(P, out: Path, fmt: str) -> Path:
    """fmt "deepspec" (BF16) or "deepspec-nvfp4" (matrices W4A16 NVFP4, Markov W1 BF16),
    with monolith.synth.draft's names and monolith.synth.draft_config's config and
    quantization config."""
    from monolith.synth import draft as sd
    from monolith.synth.draft_config import deepspec_config, nvfp4_export_config
    from monolith.synth.quant import MODELOPT_PRODUCER
    from monolith.synth.writers import Unit, write_checkpoint, write_json

    s = SIZES
    tdir = out / "target"
    target_cfg = json.loads((tdir / "config.json").read_text())
    tc = target_cfg["text_config"]
    h, vocab = tc["hidden_size"], tc["vocab_size"]
    ids = special_ids(out)
    dest = out / ("draft-bf16" if fmt == "deepspec" else "draft")
    if dest.exists():
        shutil.rmtree(dest)
    dest.mkdir(parents=True)
    values = {k: np.array(v.astype(mx.float32)) for k, v in P.items()}
    # No embed_tokens / lm_head: the runtime binds the target's (docs/drafts.md section 1), which the draft
    # was trained with. Copies would only add bytes, and NVFP4 copies would differ from the
    # target's BF16 ones (measured: 1.6% of the NVFP4 draft's matched-prefix acceptance).
    params = [*sd.backbone_params(h, s), *sd.head_params(h, vocab, s, "vanilla")]
    config = deepspec_config(tc, s, "vanilla", ids["<|mask|>"])
    quantize = fmt == "deepspec-nvfp4"

    units = [Unit((prm,), "w4a16" if quantize and quantized(prm.name) else "bf16") for prm in params]
    if quantize:
        hf_quant, lithos = nvfp4_export_config(units, ["markov_w1"])
        config["lithos_quantization"] = lithos
        config["quantization_config"] = {**hf_quant["quantization"], "producer": MODELOPT_PRODUCER,
                                         "quant_method": "modelopt"}
        write_json(dest / "hf_quant_config.json", hf_quant)
    write_checkpoint(dest, units, lambda prm: values[prm.name], shards=1)
    write_json(dest / "config.json", config)
    for f in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        shutil.copy(tdir / f, dest / f)
    return dest


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, default=Path("build/demo"))
    ap.add_argument("--target", type=Path, default=None,
                    help="the target checkpoint to copy to OUT/target when that is missing (e.g. packs/demo/target)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--generations", type=int, default=1200, help="target generations to train on")
    ap.add_argument("--corpus-windows", type=int, default=2400,
                    help="random training-corpus windows trained on beside the generations")
    ap.add_argument("--steps", type=int, default=7000, help="draft training steps")
    ap.add_argument("--qat-steps", type=int, default=1500,
                    help="the last steps train through the NVFP4 export's values (quantization-aware)")
    ap.add_argument("--hard-weight", type=float, default=0.0,
                    help="weight of a cross-entropy on the target's argmax beside the distillation")
    ap.add_argument("--force", action="store_true")
    args = ap.parse_args()
    train = train_stream(args.out, adopt_target(args.out, args.target))
    seqs = stage_generate(args.out, train, args.generations, args.seed, args.force)
    starts = np.random.default_rng(args.seed + 4).integers(0, train.size - seqs.shape[1], args.corpus_windows)
    windows = np.stack([train[i:i + seqs.shape[1]] for i in starts]).astype(np.int32)
    P = stage_draft(args.out, seqs, args.seed, args.steps, args.force, windows, args.qat_steps, args.hard_weight)
    for fmt in ("deepspec", "deepspec-nvfp4"):
        d = export_draft(P, args.out, fmt)
        size = sum(f.stat().st_size for f in d.glob("*.safetensors"))
        log(f"exported {d} ({size / 1e6:.2f} MB)")
    check_runtime(args.out, P, seqs)



def check_runtime(out: Path, P, seqs: np.ndarray, p_anchor: int = 100) -> float:
    """Our runtime Draft (BF16 checkpoint, F32 compute, fed by the runtime target's taps)
    vs the mirror on one block: max |hidden diff| (the mirror uses BF16-rounded weights)."""
    from monolith.engine_setup import load_drafter, load_target

    s = SIZES
    model = load_target(out / "target", dtype="float32", cache_dir=out / "packs")
    draft = load_drafter(out / "draft-bf16", model, dtype="float32", quantization="none", cache_dir=out / "packs").draft
    seq = seqs[0]
    cache = model.make_cache(len(seq) + 8)
    _, feats = model(mx.array(seq[:p_anchor]), cache, taps=list(s.target_layer_ids))
    ctx = draft.make_context(len(seq) + 8)
    draft.append_context(ctx, feats)
    h_rt = draft.forward(ctx, int(seq[p_anchor]))
    frozen = frozen_target(out / "target")
    Pb = {k: v.astype(mx.bfloat16).astype(mx.float32) for k, v in P.items()}
    ids = special_ids(out)
    pos, mask = block_layout(p_anchor, np.array([p_anchor]), s.block_size)
    x = np.full((1, s.block_size), ids["<|mask|>"], np.int32)
    x[0, 0] = seq[p_anchor]
    h_m = draft_forward(Pb, frozen, feats[None], mx.array(x), mx.array(pos), mx.array(mask), s, T.PRESET.rope_theta)
    diff = float(mx.abs(h_m[0] - h_rt).max())
    log(f"draft check: max |hidden diff| runtime vs mirror {diff:.4g} (|h| max {float(mx.abs(h_rt).max()):.3g})")
    return diff


if __name__ == "__main__":
    main()
