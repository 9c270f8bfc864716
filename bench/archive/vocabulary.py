"""The 248,320-id vocabulary bench/archive/grammar_engines.py and bench/archive/structured.py measure
grammars at: no model can be downloaded here, so a Qwen-style byte-level BPE (the
synthetic tokenizer's pre-tokenizer and special tokens) trained on this machine's Python
sources, once, and cached under the directory the caller names."""

from __future__ import annotations

import hashlib
import json
import sysconfig
import time
from pathlib import Path

from monolith.synth.tokenizer import PRETOKENIZE_REGEX, SPECIAL_TOKENS, TEXT_TAGS

VOCAB_SIZE = 248_320  # Qwen3.5/3.6 vocab_size (docs/target.md)
CORPUS_CHARS = 200_000_000  # enough text for 248K merges at min_frequency 2 here
CORPUS_EXTENSIONS = ("py", "pyi", "rst", "txt", "md", "json")


def corpus_files() -> list[Path]:
    roots = [Path(sysconfig.get_paths()["stdlib"])] + sorted(Path("/usr/lib").glob("python3*"))
    files = set()
    for root in roots:
        for ext in CORPUS_EXTENSIONS:
            files.update(p for p in root.rglob(f"*.{ext}") if p.is_file())
    return sorted(files)


def corpus_key(files: list[Path]) -> str:
    h = hashlib.sha256(json.dumps([VOCAB_SIZE, CORPUS_CHARS, PRETOKENIZE_REGEX, SPECIAL_TOKENS]).encode())
    for p in files:
        h.update(f"{p}\0{p.stat().st_size}\n".encode())
    return h.hexdigest()[:16]


def read_corpus(files: list[Path]) -> tuple[list[str], int]:
    texts, chars = [], 0
    for p in files:
        try:
            text = p.read_text(encoding="utf-8")
        except (UnicodeDecodeError, OSError):
            continue
        texts.append(text)
        chars += len(text)
        if chars >= CORPUS_CHARS:
            break
    return texts, chars


def train_tokenizer(texts: list[str]) -> str:
    from tokenizers import (
        AddedToken,
        Regex,
        Tokenizer,
        decoders,
        models,
        normalizers,
        pre_tokenizers,
        trainers,
    )

    tok = Tokenizer(models.BPE(unk_token=None, fuse_unk=False, byte_fallback=False))
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(PRETOKENIZE_REGEX), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=VOCAB_SIZE - len(SPECIAL_TOKENS), min_frequency=2,
                                  show_progress=False, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  special_tokens=[])
    tok.train_from_iterator(texts, trainer=trainer)
    for t in SPECIAL_TOKENS:  # as packs/demo/tokenizer.py: the reasoning/tool tags are text
        if t in TEXT_TAGS:
            tok.add_tokens([AddedToken(t, special=False, normalized=False)])
        else:
            tok.add_special_tokens([AddedToken(t, special=True, normalized=False)])
    return json.dumps(json.loads(tok.to_str()), sort_keys=True, ensure_ascii=False)


def vocabulary(cache: Path) -> tuple[str, dict]:
    """(tokenizer.json text, facts about it), built once per corpus listing."""
    files = corpus_files()
    key = corpus_key(files)
    path = cache / f"bpe-{VOCAB_SIZE}-{key}.json"
    meta_path = path.with_suffix(".meta.json")
    if not (path.exists() and meta_path.exists()):
        cache.mkdir(parents=True, exist_ok=True)
        print(f"training a {VOCAB_SIZE}-id BPE on up to {CORPUS_CHARS / 1e6:.0f}M characters "
              f"of {len(files)} files (once; cached in {path})", flush=True)
        t0 = time.perf_counter()
        texts, chars = read_corpus(files)
        text = train_tokenizer(texts)
        n = len(json.loads(text)["model"]["vocab"]) + len(SPECIAL_TOKENS)
        meta = {"corpus_roots": [sysconfig.get_paths()["stdlib"], "/usr/lib/python3*"],
                "corpus_extensions": list(CORPUS_EXTENSIONS), "corpus_files_listed": len(files),
                "corpus_files_used": len(texts), "corpus_chars": chars, "corpus_key": key,
                "trained_ids": n, "padding_ids": VOCAB_SIZE - n, "train_s": round(time.perf_counter() - t0, 1)}
        tmp = path.with_suffix(".tmp")
        tmp.write_text(text, encoding="utf-8")
        tmp.replace(path)
        meta_path.write_text(json.dumps(meta, indent=1))
    text = path.read_text(encoding="utf-8")
    meta = json.loads(meta_path.read_text())
    meta.update(vocab_size=VOCAB_SIZE, sha256=hashlib.sha256(text.encode()).hexdigest(), path=str(path))
    return text, meta
