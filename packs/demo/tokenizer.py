"""A Qwen-style byte-level BPE trained on the demo corpus: the same pre-tokenizer,
special tokens, chat template and config files as monolith.synth.tokenizer, with a
larger vocabulary (BPE_VOCAB_SIZE merges + byte alphabet, specials after)."""

from __future__ import annotations

import json
from pathlib import Path

from monolith.synth import tokenizer as synth_tok
from monolith.synth.writers import write_json

BPE_VOCAB_SIZE = 2000  # + 10 special tokens = 2010 ids; the model's vocab is padded to 2048


def train(docs: list[str]) -> str:
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE(unk_token=None, fuse_unk=False, byte_fallback=False))
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(synth_tok.PRETOKENIZE_REGEX), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=BPE_VOCAB_SIZE, min_frequency=2, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), special_tokens=[])
    tok.train_from_iterator((line for d in docs for line in d.splitlines(keepends=True)), trainer=trainer)
    for t in synth_tok.SPECIAL_TOKENS:
        if t in synth_tok.TEXT_TAGS:
            tok.add_tokens([AddedToken(t, special=False, normalized=False)])
        else:
            tok.add_special_tokens([AddedToken(t, special=True, normalized=False)])
    return json.dumps(json.loads(tok.to_str()), indent=2, sort_keys=True, ensure_ascii=False) + "\n"


def special_ids(tokenizer_json: str) -> dict[str, int]:
    return {t["content"]: t["id"] for t in json.loads(tokenizer_json)["added_tokens"]}


def write(out_dir, tokenizer_json: str) -> dict[str, int]:
    """tokenizer.json, tokenizer_config.json, chat_template.jinja, generation_config.json."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    ids = special_ids(tokenizer_json)
    (out / "tokenizer.json").write_text(tokenizer_json, encoding="utf-8")
    cfg = synth_tok.tokenizer_config()
    cfg["added_tokens_decoder"] = {
        str(ids[t]): {"content": t, "lstrip": False, "normalized": False, "rstrip": False, "single_word": False,
                      "special": t not in synth_tok.TEXT_TAGS}
        for t in synth_tok.SPECIAL_TOKENS}
    write_json(out / "tokenizer_config.json", cfg)
    (out / "chat_template.jinja").write_text(synth_tok.CHAT_TEMPLATE, encoding="utf-8")
    pad, eos = ids[synth_tok.PAD_TOKEN], ids[synth_tok.EOS_TOKEN]
    write_json(out / "generation_config.json", {
        "bos_token_id": pad, "do_sample": True, "eos_token_id": [eos, pad], "pad_token_id": pad,
        "temperature": 1.0, "top_k": 20, "top_p": 0.95})
    return ids
