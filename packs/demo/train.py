"""Train the demo target (and, later, its DSpark draft) on the CPU with MLX.

    LD_PRELOAD=/usr/lib/x86_64-linux-gnu/libopenblas.so.0 \
        python packs/demo/train.py --out build/demo [--steps 2400] [--seed 0] [--chat-share 0.5]
            [--tokenizer packs/demo/target/tokenizer.json | train]

Stages (each skipped when its output exists, unless --force):
  1. tokenizer  -> OUT/tokenizer.json (the bundled pair's, kept; + config files in OUT/tok)
                   and OUT/tokens.npz: the corpus's files, then the chat transcripts of
                   assistant_data.py rendered by the pair's chat template
  2. target     -> OUT/target_train.npz, OUT/target_log.json (loss curve, tok/s; held-out
                   cross-entropy of the corpus and of the transcripts); its progress is
                   saved every SAVE_EVERY steps (OUT/target_progress.*) and a re-run after
                   a kill goes on from there
  3. export     -> OUT/target-bf16/ (BF16, fused experts) and OUT/target/ (ModelOpt NVFP4)
  4. check      -> logits of our runtime (load_model on the BF16 checkpoint) vs the
                   training forward on held-out text: they must agree.
The draft stages live in draft.py, the MTP head's in mtp.py.
"""

from __future__ import annotations

import argparse
import json
import math
import shutil
import sys
import time
from pathlib import Path

import mlx.core as mx
import mlx.optimizers as optim
import numpy as np

sys.path.insert(0, str(Path(__file__).parent))
import assistant_data  # noqa: E402
import corpus  # noqa: E402
import model as M  # noqa: E402
import tokenizer as demo_tok  # noqa: E402

from monolith.synth.presets import Preset  # noqa: E402

# The demo target: a 4-layer Qwen3_5Moe (GDN, gated attention, GDN, gated attention: two attention layers
# to find a tool's name and an argument in a long prompt), 8 experts top-2.
PRESET = Preset(
    hidden_size=256, num_hidden_layers=4, full_attention_interval=2,
    num_attention_heads=4, num_key_value_heads=2, head_dim=64,
    linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=64, linear_value_head_dim=64,
    linear_conv_kernel_dim=4, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=128,
    shared_expert_intermediate_size=128, vocab_size=2048, rope_theta=10_000.0, partial_rotary_factor=0.25,
    max_position_embeddings=262_144, lm_head_gain=1.0,
)
SEQ_LEN = 512  # the corpus's rows: BATCH of them make a step
BATCH = 4
CHAT_LEN = 2048  # a chat step's one row, as many tokens as BATCH x SEQ_LEN: transcripts packed from one's start
CHAT_SHARE = 0.5  # steps whose row starts at a chat transcript (assistant_data.py)
PROMPT_WEIGHT = 0.3  # a transcript's prompt tokens in the loss, against 1 for the replies the server samples
SAVE_EVERY = 100  # steps between saves of a stage's progress (Progress)
BUNDLED_TOKENIZER = Path(__file__).parent / "target" / "tokenizer.json"
AUX_COEF = 0.01


def log(*a):
    print(*a, flush=True)


# ----------------------------------------------------------------- stage 1: tokenizer


def stage_tokenizer(out: Path, force: bool, tokenizer: Path | None = None, seed: int = 0):
    """OUT/tokenizer.json (a copy of `tokenizer`, or trained on the corpus when None) and
    OUT/tokens.npz, the token streams (`token_streams`)."""
    train_docs, held_docs, info = corpus.load()
    tj_path = out / "tokenizer.json"
    if force or not tj_path.exists():
        t = time.time()
        tj = tokenizer.read_text(encoding="utf-8") if tokenizer is not None else demo_tok.train(train_docs)
        demo_tok.write(out / "tok", tj)
        tj_path.write_text(tj, encoding="utf-8")
        how = f"copied from {tokenizer}" if tokenizer is not None else "trained"
        log(f"tokenizer: {how} in {time.time() - t:.1f}s")
    tj = tj_path.read_text(encoding="utf-8")
    cache = out / "tokens.npz"
    if force or not cache.exists():
        np.savez(cache, **token_streams(tj, out / "tok", train_docs, held_docs, seed))
    z = dict(np.load(cache))
    info["train_tokens"], info["heldout_tokens"] = int(z["train"].size), int(z["held"].size)
    info["chat"] = {"source": "assistant_data.py (stdlib questions, tool transcripts)", "seed": seed,
                    "train_transcripts": int(z["chat_starts"].size),
                    "heldout_transcripts": int(z["held_chat_starts"].size),
                    "train_tokens": int(z["train"].size - z["chat_starts"][0]),
                    "heldout_tokens": int(z["held_chat"].size)}
    return tj, z, info


def token_streams(tj: str, tokenizer_dir: Path, train_docs, held_docs, seed: int) -> dict[str, np.ndarray]:
    """"train": the corpus's training files, then the training chat transcripts
    (assistant_data.build, rendered by the pair's chat template from `tokenizer_dir`;
    prompt and reply tokenized apart, as the server tokenizes a prompt and samples the
    reply), each followed by <|endoftext|>; "weights": each token's weight in the loss (1,
    PROMPT_WEIGHT for a transcript's prompt); "chat_starts": where each transcript starts
    in it; "held": the held-out files; "held_chat", "held_chat_starts": the held-out
    transcripts."""
    from tokenizers import Tokenizer

    from monolith.tokenizer import load_tokenizer

    tk = Tokenizer.from_str(tj)
    sep = demo_tok.special_ids(tj)["<|endoftext|>"]
    chat = load_tokenizer(tokenizer_dir)

    def stream(parts_of_texts, base=0):
        toks, weights, starts = [], [], []
        for parts in parts_of_texts:
            starts.append(base + len(toks))
            for text, weight in parts:
                ids = tk.encode(text, add_special_tokens=False).ids
                toks += ids
                weights += [weight] * len(ids)
            toks.append(sep)
            weights.append(1.0)
        return np.array(toks, dtype=np.int32), np.array(weights, dtype=np.float32), np.array(starts, dtype=np.int64)

    def rendered(held):
        for t in assistant_data.build(seed, held=held):
            prompt, reply = assistant_data.render(chat, t)
            yield [(prompt, PROMPT_WEIGHT), (reply, 1.0)]

    docs, doc_weights, _ = stream([(d, 1.0)] for d in train_docs)
    chats, chat_weights, starts = stream(rendered(False), docs.size)
    held_chat, _, held_starts = stream(rendered(True))
    return {"train": np.concatenate([docs, chats]), "weights": np.concatenate([doc_weights, chat_weights]),
            "chat_starts": starts, "held": stream([(d, 1.0)] for d in held_docs)[0], "held_chat": held_chat,
            "held_chat_starts": held_starts}


def batch_rows(rng, data: np.ndarray, starts: np.ndarray | None, n: int, chat_share: float) -> np.ndarray:
    """n rows of SEQ_LEN + 1 tokens: each, with probability chat_share, from the start of
    a chat transcript (packed with the ones after it), else from a random place before the
    first transcript (the corpus's files)."""
    length = SEQ_LEN
    return np.stack([data[s:s + length + 1] for s in row_starts(rng, data.size, starts, n, chat_share, length)])


def row_starts(rng, size: int, starts: np.ndarray | None, n: int, chat_share: float, length: int) -> list[int]:
    out = []
    corpus_end = size if starts is None else int(starts[0])
    for _ in range(n):
        if starts is not None and rng.random() < chat_share:
            s = int(starts[rng.integers(0, starts.size)])
        else:
            s = int(rng.integers(0, corpus_end - length - 1))
        out.append(min(s, size - length - 1))
    return out


def training_batch(rng, z: dict, chat_share: float) -> tuple[np.ndarray, np.ndarray]:
    """(tokens, loss weights of tokens 1..) of one step: with probability chat_share one
    row of CHAT_LEN from a transcript's start, else BATCH rows of SEQ_LEN of the corpus."""
    chat = rng.random() < chat_share
    n, length = (1, CHAT_LEN) if chat else (BATCH, SEQ_LEN)
    s = row_starts(rng, z["train"].size, z["chat_starts"], n, 1.0 if chat else 0.0, length)
    rows = np.stack([z["train"][i:i + length + 1] for i in s])
    weights = np.stack([z["weights"][i + 1:i + length + 1] for i in s])
    return rows, weights


# ----------------------------------------------------------------- stage 2: target


def loss_fn(P, batch, p, weights=None):
    """(loss, cross-entropy): the mean of the tokens' cross-entropy, weighted by `weights`
    when given, plus the experts' balance term."""
    logits, _, aux = M.forward(P, batch[:, :-1], p)
    ce = mx.logsumexp(logits, axis=-1) - mx.take_along_axis(logits, batch[:, 1:, None], -1)[..., 0]
    ce = mx.mean(ce) if weights is None else mx.sum(ce * weights) / mx.sum(weights)
    return ce + AUX_COEF * aux, ce


def eval_loss(P, data, p, n=8, seed=1, starts=None):
    """Cross-entropy on n held-out rows (from transcript starts when `starts` is given)."""
    rows = batch_rows(np.random.default_rng(seed), data, starts, n, 1.0)
    chunks = [rows[i:i + BATCH] for i in range(0, n, BATCH)]
    return sum(float(loss_fn(P, mx.array(c), p)[1]) for c in chunks) / len(chunks)


class Progress:
    """A training loop's state, saved every SAVE_EVERY steps to OUT/<name>_progress.*
    (parameters, the optimizer's moments, the batch sampler's generator, the logged curve)
    so that a run killed half way goes on from its last save to the same result. `fresh`
    drops an earlier run's save (--force)."""

    def __init__(self, out: Path, name: str, fresh: bool = False):
        self.arrays, self.meta = out / f"{name}_progress.safetensors", out / f"{name}_progress.json"
        if fresh:
            self.clear()

    def load(self, P: dict, opt, rng) -> tuple[dict, int, list, float]:
        """(parameters, steps done, curve, seconds spent): the saved ones when there are,
        the optimizer's state and `rng` restored; else (P, 0, [], 0)."""
        if not (self.arrays.exists() and self.meta.exists()):
            return P, 0, [], 0.0
        saved, meta = mx.load(str(self.arrays)), json.loads(self.meta.read_text())
        P = {k: saved[f"param/{k}"] for k in P}
        state = {k: {m: saved[f"{m}/{k}"] for m in ("m", "v")} for k in P}
        opt.state = {"step": saved["step"], "learning_rate": saved["learning_rate"], **state}
        rng.bit_generator.state = meta["rng"]
        log(f"resumed at step {meta['step']} from {self.arrays}")
        return P, meta["step"], meta["curve"], meta["seconds"]

    def save(self, P: dict, opt, rng, step: int, curve: list, seconds: float):
        arrays = {f"param/{k}": v for k, v in P.items()}
        for k in P:
            arrays[f"m/{k}"], arrays[f"v/{k}"] = opt.state[k]["m"], opt.state[k]["v"]
        arrays["step"], arrays["learning_rate"] = opt.state["step"], opt.state["learning_rate"]
        tmp = self.arrays.with_name(self.arrays.stem + ".tmp.safetensors")
        mx.save_safetensors(str(tmp), arrays)
        tmp.replace(self.arrays)
        meta = {"step": step, "curve": curve, "seconds": seconds, "rng": rng.bit_generator.state}
        self.meta.write_text(json.dumps(meta))

    def clear(self):
        self.arrays.unlink(missing_ok=True)
        self.meta.unlink(missing_ok=True)


def stage_target(out: Path, z: dict, seed: int, steps: int, force: bool, chat_share: float = CHAT_SHARE):
    """AdamW (`training_batch`: a chat_share of the steps on transcripts); every 100 steps
    the held-out cross-entropy of the corpus and of the transcripts. Resumes a killed run
    (Progress)."""
    held_ids = z["held"]
    ckpt = out / "target_train.npz"
    if ckpt.exists() and not force:
        saved = np.load(ckpt)
        return {k: mx.array(saved[k]) for k in saved.files}
    p = PRESET
    mx.random.seed(seed)
    P = M.init_params(p, seed)
    n_params = sum(v.size for v in P.values())
    expert = sum(v.size for k, v in P.items() if ".experts." in k)
    active = n_params - expert + expert * p.num_experts_per_tok // p.num_experts
    log(f"target: {n_params / 1e6:.2f} M params ({active / 1e6:.2f} M active), train {z['train'].size} tokens")
    vg = mx.value_and_grad(lambda P, b, w: loss_fn(P, b, p, w), argnums=0)
    step_fn = mx.compile(vg)
    lr_peak, warm = 2e-3, 50
    opt = optim.AdamW(learning_rate=lr_peak, weight_decay=0.01, betas=[0.9, 0.95])
    rng = np.random.default_rng(seed)
    progress = Progress(out, "target", fresh=force)
    P, step, curve, spent = progress.load(P, opt, rng)
    t0, tokens = time.time() - spent, step * BATCH * SEQ_LEN
    while step < steps:
        # schedule: warmup then cosine over the steps
        frac = step / steps
        lr = lr_peak * min(1.0, (step + 1) / warm) * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(frac, 1.0))))
        opt.learning_rate = mx.array(lr)
        rows, weights = training_batch(rng, z, chat_share)
        (loss, ce), grads = step_fn(P, mx.array(rows), mx.array(weights))
        grads, _ = optim.clip_grad_norm(grads, 1.0)
        P = opt.apply_gradients(grads, P)
        mx.eval(P, opt.state, ce)
        step += 1
        tokens += BATCH * SEQ_LEN
        if step % 25 == 0 or step == 1:
            dt = time.time() - t0
            entry = {"step": step, "seconds": round(dt, 1), "tokens": tokens, "train_ce": round(float(ce), 4),
                     "lr": lr, "tok_s": round(tokens / dt, 1)}
            if step % 100 == 0 or step == 1:
                entry["heldout_ce"] = round(eval_loss(P, held_ids, p), 4)
                entry["heldout_chat_ce"] = round(held_chat_ce(P, z, p), 4)
            curve.append(entry)
            log(json.dumps(entry))
        if step % SAVE_EVERY == 0 and step < steps:
            progress.save(P, opt, rng, step, curve, time.time() - t0)
    final = {"steps": step, "tokens": tokens, "seconds": time.time() - t0, "heldout_ce": eval_loss(P, held_ids, p, 16),
             "heldout_chat_ce": held_chat_ce(P, z, p, 16), "params": int(n_params), "active_params": int(active)}
    log("target done: " + json.dumps(final))
    (out / "target_log.json").write_text(json.dumps({"final": final, "curve": curve}, indent=1) + "\n")
    np.savez(ckpt, **{k: np.array(v) for k, v in P.items()})
    progress.clear()
    return P


def held_chat_ce(P, z: dict, p, n=8) -> float:
    return eval_loss(P, z["held_chat"], p, n, starts=z["held_chat_starts"])


# ----------------------------------------------------------------- stage 3: export


def export_target(P, out: Path, tj: str, fmt: str) -> Path:
    """Write a checkpoint in our synthetic-target layout (monolith.synth.target), trained
    values for the language model, synth's deterministic values for vision and MTP."""
    from monolith.synth import target as st
    from monolith.synth.quant import MODELOPT_PRODUCER, modelopt_nvfp4_config, modelopt_scheme
    from monolith.synth.values import generate
    from monolith.synth.writers import write_checkpoint, write_json

    p = PRESET
    dest = out / ("target-bf16" if fmt == "bf16" else "target")
    if dest.exists():
        shutil.rmtree(dest)
    dest.mkdir(parents=True)
    values = M.export_values(P)
    params = st.target_params(p, dense=False)
    config = st.target_config(p, dense=False)
    ids = demo_tok.write(dest, tj)
    config["text_config"]["bos_token_id"] = ids["<|endoftext|>"]
    config["text_config"]["eos_token_id"] = ids["<|im_end|>"]
    if fmt == "bf16":
        units = st.plan_units(params, lambda m: "bf16", share_scales=False, fuse_experts=True)
    else:
        q = modelopt_nvfp4_config(False)
        config["quantization_config"] = {**q, "producer": MODELOPT_PRODUCER, "quant_method": "modelopt"}
        write_json(dest / "hf_quant_config.json", {"producer": MODELOPT_PRODUCER, "quantization": q})
        units = st.plan_units(params, lambda m: modelopt_scheme(m, q), share_scales=True, fuse_experts=False)
    missing = [prm.name for prm in params if prm.name.startswith((M.LM, "lm_head")) and prm.name not in values]
    if missing:
        raise AssertionError(f"export: no trained value for {missing[:5]}")

    def values_of(prm):
        return values[prm.name] if prm.name in values else generate(0, prm)

    write_checkpoint(dest, units, values_of, shards=1)
    write_json(dest / "config.json", config)
    write_json(dest / "preprocessor_config.json", st.preprocessor_config(config["vision_config"]))
    return dest


# ----------------------------------------------------------------- stage 4: check


def check_runtime(P, src: Path, held_ids, n=64):
    """Our inference forward (pack of the BF16 checkpoint, F32 compute) vs the training
    forward on the same (BF16-rounded) weights."""
    from monolith.engine_setup import load_target

    model = load_target(src, dtype="float32")
    toks = held_ids[:n]
    cache = model.make_cache(n + 8)
    ours, _ = model(mx.array(toks), cache)
    Pb = {k: v.astype(mx.bfloat16).astype(mx.float32) for k, v in P.items()}
    ref, _, _ = M.forward(Pb, mx.array(toks)[None], PRESET)
    diff = float(mx.abs(ours - ref[0]).max())
    agree = float((mx.argmax(ours, -1) == mx.argmax(ref[0], -1)).astype(mx.float32).mean())
    log(f"check: max |logit diff| {diff:.4g}, argmax agreement {agree:.3f}")
    return diff, agree


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, default=Path("build/demo"))
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--steps", type=int, default=2400, help=f"training steps of {BATCH} x {SEQ_LEN} tokens")
    ap.add_argument("--chat-share", type=float, default=CHAT_SHARE, help="rows that start at a chat transcript")
    ap.add_argument("--tokenizer", type=Path, default=BUNDLED_TOKENIZER,
                    help="tokenizer.json to keep (default: the bundled pair's); 'train' trains one on the corpus")
    ap.add_argument("--force", action="store_true")
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    tokenizer = None if str(args.tokenizer) == "train" else args.tokenizer
    tj, z, info = stage_tokenizer(args.out, args.force, tokenizer, args.seed)
    held_ids = z["held"]
    log("corpus: " + json.dumps(info))
    P = stage_target(args.out, z, args.seed, args.steps, args.force, args.chat_share)
    bf16 = export_target(P, args.out, tj, "bf16")
    nvfp4 = export_target(P, args.out, tj, "nvfp4")
    check_runtime(P, bf16, held_ids)
    size = sum(f.stat().st_size for f in nvfp4.glob("*.safetensors"))
    log(f"exported {bf16} and {nvfp4} (NVFP4 weights {size / 1e6:.2f} MB)")


if __name__ == "__main__":
    main()
