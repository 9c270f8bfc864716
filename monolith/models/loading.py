"""Pack directory -> a target model (load_model) or a draft model for a target
(load_draft), through the one architecture registry.

The architecture names are monolith.checkpoint.config's; MODELS says what each loads
into. Every draft format loads into Draft with DraftArgs, which asks the format
(monolith.pack.draft_formats.DRAFT_FORMATS) what differs; a new draft format adds
nothing here (docs/drafts.md, "Adding a draft format"). The weights are read by
PackWeights (weights.py).
"""

from __future__ import annotations

from typing import NamedTuple

import mlx.core as mx
import numpy as np

from ..checkpoint.config import (
    DRAFT_ARCHITECTURES,
    QWEN3_5,
    QWEN3_5_MOE,
    TARGET_ARCHITECTURES,
)
from ..kernels import check_kernels
from ..pack import PackError, read_manifest
from ..pack.draft_formats import DRAFT_FORMATS
from ..pack.split import LAYER
from .draft_args import DraftArgs, DraftError
from .dspark import Draft
from .mtp import MTPHead
from .qwen3_5 import Qwen3_5, Qwen3_5Moe
from .target_args import ModelArgs
from .weights import PackWeights, compute_dtype, model_arrays, open_pack


class Architecture(NamedTuple):
    """What a pack of one architecture loads into: the model class and the class that
    reads its arguments from the pack."""

    model: type
    args: type


# the one registry: every architecture name of monolith.checkpoint.config
MODELS = {
    QWEN3_5_MOE: Architecture(Qwen3_5Moe, ModelArgs),
    QWEN3_5: Architecture(Qwen3_5, ModelArgs),
    **{name: Architecture(Draft, DraftArgs) for name in DRAFT_FORMATS},
}
# pack tensors the draft does not read: t2d is the inverse of d2t; speculators' verifier_norm
# is a training-time copy of the target's final norm
UNUSED_DRAFT_TENSORS = ("t2d", "verifier_norm")


def load_model(pack_dir, dtype=None, dense: bool | None = None, layers: range | None = None,
               head: bool = True, verify: str = "first") -> Qwen3_5:
    """The target model of a pack directory (monolith.engine_setup resolves a checkpoint
    directory or hub id into one). `dtype` is the compute dtype ("bfloat16", "float32",
    or None: the device's default); weights stay in pack precision, or are dense F32
    (`dense`, default: on the CPU when they fit, see weights.py). A pipeline stage
    (`layers`, `head`: see Qwen3_5) reads only its own tensors. The pack is verified
    first as `verify` (--verify-pack) says."""
    dtype = compute_dtype(dtype)
    pack_dir = open_pack(pack_dir, verify)
    manifest = read_manifest(pack_dir)
    architecture = manifest.get("architecture")
    if architecture not in TARGET_ARCHITECTURES:
        raise PackError(f"{pack_dir}: architecture {architecture!r} is not a supported target "
                        f"(supported: {', '.join(sorted(TARGET_ARCHITECTURES))})")
    weights = PackWeights(pack_dir, dtype, dense, verify)
    model_class, args_class = MODELS[architecture]
    args = args_class.from_config(weights.config, architecture, weights.generation_config,
                                  where=str(pack_dir / "config.json"))
    model = model_class(args, weights, layers, head)
    model.pack_sha256 = manifest.get("pack_sha256")  # what a prompt-cache saved state was computed with
    unused = [n for n in weights.unused() if _held(n, model)]
    if unused:
        raise PackError(f"{pack_dir}: tensors the {architecture} model does not use: {_listed(unused)}")
    mx.eval(model_arrays(model))  # read the shards and derive F32 copies now, not in the first forward
    if model.head and len(model.owned) == args.num_hidden_layers:
        check_kernels(lambda: model(mx.array([0, 1, 2], dtype=mx.int32), model.make_cache(8))[0])
    else:
        check_kernels(lambda: model.forward_stage(mx.ones((1, 3, args.hidden_size), model.dtype),
                                                  [model.make_cache(8)], [3])[0])
    return model


def _held(name: str, model) -> bool:
    """Is tensor `name` one a model of these layers (and head) should have read?"""
    m = LAYER.match(name)
    if m is not None:
        return int(m.group(1)) in model.owned or int(m.group(1)) >= model.args.num_hidden_layers
    return model.head or not name.startswith(("model.embed_tokens", "lm_head", "model.norm"))


def load_mtp(pack_dir, target_model, dense: bool | None = None, verify: str = "first") -> MTPHead:
    """The MTP head (models/mtp.py) of a target pack built with --with-mtp, for
    `target_model`, the model loaded from that same pack (its compute dtype is the head's).
    PackError when the pack has no MTP head or is another pack than the target's."""
    pack_dir = open_pack(pack_dir, verify)
    manifest = read_manifest(pack_dir)
    if manifest.get("role") != "target" or not (manifest.get("layout") or {}).get("mtp"):
        raise PackError(f"{pack_dir}: the pack has no MTP head (build the target pack with "
                        "`python -m monolith.pack build --with-mtp`)")
    if manifest.get("pack_sha256") != target_model.pack_sha256:
        raise PackError(f"{pack_dir}: the MTP head's pack is not the pack the target model was loaded from")
    weights = PackWeights(pack_dir, target_model.dtype, dense, verify)
    head = MTPHead(target_model, weights)
    unused = [n for n in weights.arrays if n.startswith("mtp.") and n not in weights.used]
    if unused:
        raise PackError(f"{pack_dir}: MTP tensors the head does not use: {_listed(unused)}")
    mx.eval(model_arrays(head.fc), model_arrays(head.layer), head.norm, head.pre_fc_norm_embedding,
            head.pre_fc_norm_hidden)  # evaluated here: lazy arrays belong to this thread's stream
    return head


def load_draft(pack_dir, target_model, dtype=None, dense: bool | None = None, verify: str = "first") -> Draft:
    """The DSpark / DFlash draft of a pack directory for `target_model` (monolith.engine_setup
    resolves checkpoints and hub ids), its pack verified first as `verify` says. Checked
    against the target at load: taps, hidden size, vocabulary (DraftError names the field)."""
    dtype = compute_dtype(dtype)
    pack_dir = open_pack(pack_dir, verify)
    manifest = read_manifest(pack_dir)
    where = str(pack_dir)
    architecture = manifest.get("architecture")
    settings = (manifest.get("layout") or {}).get("draft")
    if architecture not in DRAFT_ARCHITECTURES or not settings:
        raise DraftError(f"{where}: not a draft pack (architecture {architecture!r}; drafts: "
                         f"{', '.join(DRAFT_ARCHITECTURES)})")
    weights = PackWeights(pack_dir, dtype, dense, verify)
    model_class, args_class = MODELS[architecture]
    args = args_class.from_pack(weights.config, settings, architecture, f"{where}/config.json")
    mapping = _check_fit(args, settings, weights, target_model, where)
    draft = model_class(args, weights, target_model, mapping)
    draft.pack_sha256 = manifest.get("pack_sha256")
    unused = [n for n in weights.unused() if n not in UNUSED_DRAFT_TENSORS]
    if unused:
        raise DraftError(f"{where}: tensors the draft does not use: {_listed(unused)}")
    mx.eval(model_arrays(draft))
    return draft


def _listed(names: list[str]) -> str:
    return ", ".join(names[:8]) + (f" and {len(names) - 8} more" if len(names) > 8 else "")


# ----------------------------------------------------------------------- does the draft fit the target


def _check_fit(args: DraftArgs, settings: dict, w: PackWeights, target, where: str) -> mx.array | None:
    """Raise DraftError naming the field when the draft cannot run on this target; return
    the draft -> target id map (arange + d2t) of a reduced vocabulary, else None."""
    t = target.args
    if any(not 0 <= i < t.num_hidden_layers for i in args.taps):
        raise DraftError(f"{where}: {args.stated_taps()} reach beyond the target's {t.num_hidden_layers} layers")
    if args.hidden_size != t.hidden_size:
        raise DraftError(f"{where}: draft hidden_size {args.hidden_size} != the target's {t.hidden_size}")
    vocab = t.vocab_size
    if not 0 <= args.mask_token_id < vocab:
        raise DraftError(f"{where}: mask_token_id {args.mask_token_id} is outside the target vocabulary ({vocab})")
    embed = _rows(w, "embed_tokens")
    if embed is not None and embed != vocab:
        raise DraftError(f"{where}: embed_tokens has {embed} rows, the target vocabulary {vocab}")
    draft_vocab, mapping = _draft_vocabulary(settings, w, vocab, where)
    if args.markov_rank:
        w1, w2 = _rows(w, "markov_head.markov_w1"), _rows(w, "markov_head.markov_w2")
        if w1 != vocab:
            raise DraftError(f"{where}: markov_head.markov_w1 has {w1} rows, the target vocabulary {vocab}")
        if w2 != draft_vocab:
            raise DraftError(f"{where}: markov_head.markov_w2 has {w2} rows, the draft vocabulary {draft_vocab}")
    if "t2d" in w.entries:
        t2d = w.tensor("t2d")
        if t2d.shape != (vocab,):
            raise DraftError(f"{where}: t2d has shape {list(t2d.shape)}, the target vocabulary is {vocab}")
    return mapping


def _rows(w: PackWeights, name: str) -> int | None:
    """Output rows of the linear entry `name` (or its split group name.0, ...), None when absent."""
    entry = w.entries.get(name) or w.entries.get(name + ".0")
    if entry is None:
        return None
    if name in w.entries:
        return entry["shape"][0]
    return w.linear(name).out_features


def _draft_vocabulary(settings: dict, w: PackWeights, vocab: int, where: str) -> tuple[int, mx.array | None]:
    """(draft vocabulary size, draft -> target id map or None) for a target vocabulary of `vocab`."""
    lm_head = _rows(w, "lm_head")
    reduced = settings.get("draft_vocab_size")
    if "d2t" not in w.entries:
        if reduced and reduced != vocab:  # equal to the target's: the whole vocabulary, not a reduced one
            raise DraftError(f"{where}: draft_vocab_size {reduced} is not the target vocabulary ({vocab}), and "
                             "there is no d2t tensor mapping a reduced vocabulary")
        if lm_head is not None and lm_head != vocab:
            raise DraftError(f"{where}: lm_head has {lm_head} rows but the target vocabulary is {vocab} "
                             "and there is no d2t")
        return vocab, None
    d2t = np.asarray(w.tensor("d2t"), dtype=np.int64)
    draft_vocab = d2t.shape[0]
    if lm_head is None:
        raise DraftError(f"{where}: reduced vocabulary (d2t) without its own lm_head")
    if lm_head != draft_vocab or (reduced and reduced != draft_vocab):
        raise DraftError(f"{where}: lm_head has {lm_head} rows, d2t {draft_vocab}, draft_vocab_size {reduced}")
    ids = np.arange(draft_vocab, dtype=np.int64) + d2t
    if ids.min() < 0 or ids.max() >= vocab:
        raise DraftError(f"{where}: d2t maps draft ids to target ids [{ids.min()}, {ids.max()}], outside the "
                         f"target vocabulary ({vocab})")
    return draft_vocab, mx.array(ids.astype(np.int32))
