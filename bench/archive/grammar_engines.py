"""llguidance against xgrammar for `response_format` (issue 16, item 1): mask time per
token at Qwen3.5/3.6's 248,320-entry vocabulary, JSON-schema coverage, wheels.

The vocabulary: no model can be downloaded here, so a Qwen-style byte-level BPE (the
Qwen3.5 split rule, NFC, the byte alphabet, monolith.synth.tokenizer's special tokens at
the end, <|im_end|> = end of output) is trained with the `tokenizers` package on the Python
sources and docs on this machine (the base interpreter's standard library and its
site-packages, /usr/lib/python3*) up to exactly 248,320 ids (docs/target.md's vocab_size).
If the text cannot give that many merges, the ids past the trained ones are padding rows
(never allowed), as a model's lm_head may be wider than its tokenizer; the JSON records how
many. Built once (about 2.5 min on 2 cores) and cached by the corpus listing's hash under
$XDG_CACHE_HOME/monolith-bench (--cache), never in the repository. Its SHA-256 is recorded
per engine: both runs must see the same file. Unlike Qwen's, this vocabulary is mostly
English and code (no CJK pieces).

The machine here is shared (2 cores, other jobs running): in four runs the means moved by
up to 1.7x between runs; the orderings in the conclusion held in all of them.

Per schema (CASES; hand-written instances, checked with the `jsonschema` package when it
is installed): compile the schema (llguidance: grammar_from_json_schema + LLMatcher;
xgrammar: GrammarCompiler(max_threads=1, no cache).compile_json_schema + GrammarMatcher),
then walk the tokens of a valid instance, timing the next-token mask at every position
(llguidance.numpy.fill_next_token_bitmask / GrammarMatcher.fill_next_token_bitmask into one
preallocated int32 row) before consuming the token, plus the last mask (where the end token
must be allowed). The first walk is on the fresh matcher ("cold": caches empty), then
WARM_WALKS more after reset() ("warm": each position's median). Then an instance that
breaks the feature is fed: a feature is "enforced" when it is refused, "IGNORED" when the
engine compiled the schema and accepted the instance (silently dropped), "error" when
compiling refused the schema (the message is kept). All single-threaded
(RAYON_NUM_THREADS=1, torch threads 1).

Each engine runs in the interpreter that has it: xgrammar needs torch, transformers,
triton, pydantic and apache-tvm-ffi, which must not enter monolith's environment, so it
is measured from a separate venv (torch pinned first: the CPU build, not a CUDA one):

    python3.11 -m venv /work/xg-venv
    /work/xg-venv/bin/pip install torch==2.13.0
    /work/xg-venv/bin/pip install xgrammar llguidance numpy jsonschema

    python -m bench.archive.grammar_engines                            # monolith's venv: llguidance
    /work/xg-venv/bin/python -m bench.archive.grammar_engines --engine xgrammar
        [--engine llguidance|xgrammar] [--cases a,b] [--no-wheels] [--cache DIR] [--json PATH]

(without --engine, every engine installed in the interpreter runs.)

Each run merges its engines into bench/archive/results/grammar_engines.json and rewrites
bench/archive/results/grammar_engines.md from the whole file. Unless --no-wheels, it also asks
the package registry (pip download --no-deps) which wheels each engine publishes for
macOS arm64 and Linux and what they require.

Archived, a finished study (issue 16): monolith uses llguidance (runtime/grammar.py), for the
reasons in bench/archive/results/grammar_engines.md; bench/fuzz.py reads the control-token
finding from bench/archive/results/grammar_engines.json.
"""

from __future__ import annotations

import os

os.environ.setdefault("RAYON_NUM_THREADS", "1")  # llguidance's thread pool (single thread)
os.environ.setdefault("OMP_NUM_THREADS", "1")

import argparse
import importlib.metadata
import json
import platform
import re
import statistics
import subprocess
import sys
import tempfile
import time
import zipfile
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from bench.archive.vocabulary import VOCAB_SIZE, vocabulary
from bench.common import ROOT
from monolith.synth.tokenizer import (
    EOS_TOKEN,
    SPECIAL_TOKENS,
)

RESULTS = ROOT / "bench" / "archive" / "results" / "grammar_engines.json"
ENGINES = ("llguidance", "xgrammar")
MANYLINUX = re.compile(r"manylinux_2_(\d+)")
PLATFORMS = {  # pip download --platform tags tried for each (pip matches tags exactly)
    "macos_arm64": ["macosx_11_0_arm64", "macosx_12_0_arm64", "macosx_14_0_arm64"],
    "linux_x86_64": [f"manylinux_2_{m}_x86_64" for m in (17, 24, 27, 28, 31, 34, 35, 39)] + ["manylinux2014_x86_64"],
    "linux_aarch64": [f"manylinux_2_{m}_aarch64" for m in (17, 24, 26, 27, 28, 31, 34, 35, 39)] + ["manylinux2014_aarch64"],
}


# ---------------------------------------------------------------- the schemas

@dataclass(frozen=True)
class Case:
    name: str
    group: str  # "core": the features item 1 and the tests need; "hard": rarer keywords
    schema: dict
    valid: object  # an instance the schema accepts
    invalid: object  # one that breaks the case's feature (an engine must refuse it)


def _obj(props: dict, required=None, **extra) -> dict:
    return {"type": "object", "properties": props, "required": list(props) if required is None else required, **extra}


CASES = [
    Case("nested objects", "core",
         _obj({"user": _obj({"name": {"type": "string"},
                             "address": _obj({"city": {"type": "string"},
                                              "geo": _obj({"lat": {"type": "number"}, "lon": {"type": "number"}})})})}),
         {"user": {"name": "Ada Lovelace", "address": {"city": "London", "geo": {"lat": 51.5072, "lon": -0.1276}}}},
         {"user": {"name": "Ada Lovelace", "address": {"city": "London", "geo": {"lat": "north", "lon": -0.1276}}}}),
    Case("enum", "core",
         _obj({"color": {"enum": ["red", "green", "blue"]}, "size": {"type": "string", "enum": ["S", "M", "L", "XL"]}}),
         {"color": "green", "size": "XL"}, {"color": "purple", "size": "XL"}),
    Case("array minItems/maxItems", "core",
         _obj({"tags": {"type": "array", "items": {"type": "string"}, "minItems": 1, "maxItems": 3}}),
         {"tags": ["grammar", "decoding"]}, {"tags": ["a", "b", "c", "d"]}),
    Case("number minimum/maximum", "core",
         _obj({"age": {"type": "integer", "minimum": 0, "maximum": 120},
               "score": {"type": "number", "minimum": 0, "maximum": 1}}),
         {"age": 36, "score": 0.875}, {"age": 150, "score": 0.875}),
    Case("required + optional keys", "core",
         _obj({"id": {"type": "integer"}, "name": {"type": "string"}, "email": {"type": "string"},
               "note": {"type": "string"}}, required=["id", "name"]),
         {"id": 7, "name": "Grace", "note": "optional keys may be left out"}, {"id": 7, "note": "no name"}),
    Case("$defs/$ref (recursive)", "core",
         {"$defs": {"node": _obj({"label": {"type": "string"},
                                  "children": {"type": "array", "items": {"$ref": "#/$defs/node"}}})},
          "$ref": "#/$defs/node"},
         {"label": "root", "children": [{"label": "a", "children": []},
                                        {"label": "b", "children": [{"label": "b1", "children": []}]}]},
         {"label": "root", "children": [{"label": 5, "children": []}]}),
    Case("anyOf", "core",
         _obj({"id": {"anyOf": [{"type": "string"}, {"type": "integer"}]}}), {"id": "A-17"}, {"id": True}),
    Case("string pattern", "core",
         _obj({"code": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{4}$"}}), {"code": "ABC-1234"}, {"code": "AB-1234"}),
    Case("format date-time", "core",
         _obj({"at": {"type": "string", "format": "date-time"}}), {"at": "2026-12-02T03:15:38Z"}, {"at": "yesterday"}),
    Case("format email", "core",
         _obj({"to": {"type": "string", "format": "email"}}), {"to": "ada@example.com"}, {"to": "not an email"}),
    Case("format uuid", "core",
         _obj({"id": {"type": "string", "format": "uuid"}}), {"id": "123e4567-e89b-12d3-a456-426614174000"},
         {"id": "1234"}),
    Case("additionalProperties false", "core",
         _obj({"a": {"type": "integer"}, "b": {"type": "string"}}, additionalProperties=False),
         {"a": 1, "b": "x"}, {"a": 1, "b": "x", "c": 2}),
    Case("oneOf", "core",
         {"oneOf": [_obj({"kind": {"const": "circle"}, "radius": {"type": "number"}}),
                    _obj({"kind": {"const": "square"}, "side": {"type": "number"}})]},
         {"kind": "square", "side": 2.5}, {"kind": "triangle", "side": 2.5}),
    Case("const", "core", _obj({"version": {"const": 2}, "name": {"type": "string"}}),
         {"version": 2, "name": "v2"}, {"version": 3, "name": "v2"}),
    Case("json_object (any object)", "core", {"type": "object"},
         {"query": "weather", "days": [1, 2, 3], "units": None, "deep": {"ok": True}}, [1, 2, 3]),
    Case("tool call (strict)", "core",
         _obj({"name": {"const": "get_weather"},
               "arguments": _obj({"location": {"type": "string"},
                                  "unit": {"enum": ["celsius", "fahrenheit"]},
                                  "days": {"type": "integer", "minimum": 1, "maximum": 14}},
                                 additionalProperties=False)}, additionalProperties=False),
         {"name": "get_weather", "arguments": {"location": "Paris, France", "unit": "celsius", "days": 3}},
         {"name": "get_weather", "arguments": {"location": "Paris, France", "unit": "kelvin", "days": 3}}),
    Case("long report (many tokens)", "core",
         _obj({"title": {"type": "string"},
               "items": {"type": "array", "maxItems": 20,
                         "items": _obj({"id": {"type": "integer", "minimum": 1},
                                        "status": {"enum": ["open", "closed", "blocked"]},
                                        "summary": {"type": "string"},
                                        "owners": {"type": "array", "items": {"type": "string"}}},
                                       additionalProperties=False)}}),
         {"title": "Structured output through speculation: open work items",
          "items": [{"id": i + 1, "status": ["open", "closed", "blocked"][i % 3],
                     "summary": s, "owners": owners}
                    for i, (s, owners) in enumerate([
                        ("Mask the draft's logits along the proposed path", ["lead"]),
                        ("Verify rows masked along the same path", ["lead", "helper"]),
                        ("Chi-square test of the emitted distribution under a grammar", ["helper"]),
                        ("Jump-forward: emit forced tokens without sampling", []),
                        ("Reasoning split streamed as delta.reasoning_content", ["helper", "reviewer"]),
                        ("Logprobs from the target's verify distribution", ["lead"]),
                        ("Refuse an unsupported schema feature with a 400 naming it", ["reviewer"]),
                        ("Measure mask time per token at 248K vocabulary", ["helper"])])]},
         {"title": "x", "items": [{"id": 0, "status": "open", "summary": "", "owners": []}]}),
    # rarer keywords: an engine either enforces them, refuses them, or silently drops them
    Case("dependentSchemas", "hard",
         {"type": "object", "properties": {"card": {"type": "string"}, "billing": {"type": "string"}},
          "dependentSchemas": {"card": {"required": ["billing"]}}},
         {"card": "4111", "billing": "1 Main St"}, {"card": "4111"}),
    Case("dependentRequired", "hard",
         {"type": "object", "properties": {"card": {"type": "string"}, "billing": {"type": "string"}},
          "dependentRequired": {"card": ["billing"]}},
         {"card": "4111", "billing": "1 Main St"}, {"card": "4111"}),
    Case("if/then/else", "hard",
         {"type": "object", "properties": {"country": {"type": "string"}, "postal": {"type": "string"}},
          "required": ["country", "postal"],
          "if": {"properties": {"country": {"const": "US"}}},
          "then": {"properties": {"postal": {"pattern": "^[0-9]{5}$"}}},
          "else": {"properties": {"postal": {"pattern": "^[A-Z0-9 ]+$"}}}},
         {"country": "US", "postal": "94103"}, {"country": "US", "postal": "SW1A 1AA"}),
    Case("patternProperties", "hard",
         {"type": "object", "patternProperties": {"^x-": {"type": "integer"}}, "additionalProperties": False},
         {"x-a": 1, "x-b": 2}, {"x-a": "one"}),
    Case("uniqueItems", "hard",
         _obj({"ids": {"type": "array", "items": {"type": "integer"}, "uniqueItems": True}}),
         {"ids": [1, 2, 3]}, {"ids": [1, 1]}),
    Case("multipleOf", "hard",
         _obj({"n": {"type": "integer", "multipleOf": 5}}), {"n": 35}, {"n": 37}),
    Case("minLength/maxLength", "hard",
         _obj({"s": {"type": "string", "minLength": 3, "maxLength": 5}}), {"s": "abcd"}, {"s": "ab"}),
    Case("not", "hard",
         _obj({"v": {"not": {"type": "string"}}}), {"v": 3}, {"v": "three"}),
    Case("prefixItems", "hard",
         _obj({"point": {"type": "array", "prefixItems": [{"type": "number"}, {"type": "string"}], "items": False}}),
         {"point": [1.5, "m"]}, {"point": ["m", 1.5]}),
    Case("contains", "hard",
         _obj({"xs": {"type": "array", "items": {"type": "integer"}, "contains": {"const": 0}}}),
         {"xs": [3, 0, 4]}, {"xs": [3, 4]}),
    Case("required without properties", "hard", {"type": "object", "required": ["a"]}, {"a": 1}, {}),
    Case("minProperties", "hard",
         {"type": "object", "additionalProperties": {"type": "integer"}, "minProperties": 2},
         {"a": 1, "b": 2}, {"a": 1}),
]


def reference_check(cases: list[Case]) -> dict:
    """Check each hand-written instance with the `jsonschema` package (when installed):
    the valid one must pass, the invalid one fail. A case the reference cannot judge (a
    format it does not check) is reported, not hidden."""
    try:
        import jsonschema
    except ImportError:
        return {"checked": False, "why": "jsonschema is not installed in this interpreter"}
    checker = jsonschema.Draft202012Validator.FORMAT_CHECKER
    unjudged = []
    for case in cases:
        v = jsonschema.Draft202012Validator(case.schema, format_checker=checker)
        errors = list(v.iter_errors(case.valid))
        if errors:
            raise SystemExit(f"case {case.name!r}: its valid instance fails jsonschema: {errors[0].message}")
        if v.is_valid(case.invalid):
            unjudged.append(case.name)
    return {"checked": True, "jsonschema": importlib.metadata.version("jsonschema"),
            "invalid_not_refused_by_reference": unjudged}


def dumps(instance) -> str:
    return json.dumps(instance, ensure_ascii=False)  # ", " and ": " separators, as models write


# ---------------------------------------------------------------- the engines

class Llguidance:
    name = "llguidance"

    def __init__(self, tokenizer_json: str, eos: int):
        import llguidance
        import llguidance.numpy as llnp

        self.llg, self.llnp = llguidance, llnp
        t0 = time.perf_counter()
        self.tokenizer = llguidance.LLTokenizer(tokenizer_json, n_vocab=VOCAB_SIZE, eos_token=[eos])
        self.setup_s = time.perf_counter() - t0
        self.how = ("LLTokenizer(tokenizer.json, n_vocab); LLMatcher.grammar_from_json_schema + LLMatcher; "
                    "llguidance.numpy.fill_next_token_bitmask; consume_token")

    def compile(self, schema: dict):
        """A matcher, or raise ValueError with the engine's message."""
        grammar = self.llg.LLMatcher.grammar_from_json_schema(schema)
        matcher = self.llg.LLMatcher(self.tokenizer, grammar, log_level=0)
        if matcher.is_error():
            raise ValueError(matcher.get_error())
        return matcher

    def fill(self, matcher, mask: np.ndarray) -> None:
        self.llnp.fill_next_token_bitmask(matcher, mask)

    def fill_bytes(self, matcher, mask: np.ndarray) -> None:
        """The other API: compute_bitmask() returns a new bytes object (what
        monolith/runtime/grammar.py calls), copied into the row. At a vocabulary that is
        a multiple of 32 it holds one word more than ceil(vocab / 32) (zero: no token)."""
        words = np.frombuffer(matcher.compute_bitmask(), dtype=np.int32)
        mask[0] = words[: mask.shape[1]]

    def consume(self, matcher, token: int) -> bool:
        return matcher.consume_token(token)

    def reset(self, matcher) -> None:
        matcher.reset()


class Xgrammar:
    name = "xgrammar"

    def __init__(self, tokenizer_json: str, eos: int):
        import torch
        import transformers
        import xgrammar
        from tokenizers import Tokenizer

        torch.set_num_threads(1)
        self.xgr = xgrammar
        t0 = time.perf_counter()
        hf = transformers.PreTrainedTokenizerFast(tokenizer_object=Tokenizer.from_str(tokenizer_json),
                                                  eos_token=EOS_TOKEN)
        info = xgrammar.TokenizerInfo.from_huggingface(hf, vocab_size=VOCAB_SIZE, stop_token_ids=[eos])
        self.compiler = xgrammar.GrammarCompiler(info, max_threads=1, cache_enabled=False)
        self.setup_s = time.perf_counter() - t0
        self.vocab_type = str(info.vocab_type)
        self.how = ("TokenizerInfo.from_huggingface(PreTrainedTokenizerFast, vocab_size); "
                    "GrammarCompiler(max_threads=1, cache_enabled=False).compile_json_schema (defaults: "
                    "any_whitespace, strict_mode) + GrammarMatcher; fill_next_token_bitmask; accept_token")

    def compile(self, schema: dict):
        try:
            compiled = self.compiler.compile_json_schema(json.dumps(schema))
        except RuntimeError as e:  # what xgrammar raises for a schema it cannot convert
            raise ValueError(f"{type(e).__name__}: {e}") from None
        return self.xgr.GrammarMatcher(compiled)

    def fill(self, matcher, mask: np.ndarray) -> None:
        matcher.fill_next_token_bitmask(mask)

    def consume(self, matcher, token: int) -> bool:
        return matcher.accept_token(token)

    def reset(self, matcher) -> None:
        matcher.reset()


def allowed(mask: np.ndarray, token: int) -> bool:
    return bool((int(mask[0, token // 32]) >> (token % 32)) & 1)


def walk(engine, matcher, tokens: list[int], eos: int, mask: np.ndarray, timed: bool, fill=None) -> dict:
    """Feed `tokens` then the end token, computing the mask before each. Returns the mask
    times (µs), how far the matcher followed and whether the end was allowed."""
    times, fed = [], 0
    fill = fill or engine.fill
    for tok in tokens + [eos]:
        t0 = time.perf_counter_ns()
        fill(matcher, mask)
        if timed:
            times.append((time.perf_counter_ns() - t0) / 1000)
        if not allowed(mask, tok):
            break
        if tok == eos:
            return {"times_us": times, "fed": fed, "end_allowed": True, "mask_and_matcher_agree": True}
        if not engine.consume(matcher, tok):
            return {"times_us": times, "fed": fed, "end_allowed": False, "mask_and_matcher_agree": False}
        fed += 1
    return {"times_us": times, "fed": fed, "end_allowed": False, "mask_and_matcher_agree": True}


def stats(times: list[float]) -> dict:
    xs = sorted(times)
    p99 = xs[min(len(xs) - 1, round(0.99 * (len(xs) - 1)))]
    return {"mean_us": round(statistics.fmean(xs), 1), "p50_us": round(statistics.median(xs), 1),
            "p99_us": round(p99, 1), "max_us": round(xs[-1], 1), "first_us": round(times[0], 1), "n": len(xs)}


WARM_WALKS = 5  # warm: each position's median over this many walks (the machine is shared)


def run_case(engine, case: Case, encode, eos: int) -> dict:
    mask = np.full((1, (VOCAB_SIZE + 31) // 32), -1, dtype=np.int32)
    valid, invalid = encode(dumps(case.valid)), encode(dumps(case.invalid))
    t0 = time.perf_counter()
    try:
        matcher = engine.compile(case.schema)
    except ValueError as e:
        return {"verdict": "error", "compile_ms": round((time.perf_counter() - t0) * 1000, 2), "error": str(e)[:400]}
    compile_ms = (time.perf_counter() - t0) * 1000
    cold = walk(engine, matcher, valid, eos, mask, timed=True)
    out = {"compile_ms": round(compile_ms, 2), "tokens": len(valid)}
    if cold["fed"] < len(valid) or not cold["end_allowed"]:
        engine.reset(matcher)
        bad = walk(engine, matcher, invalid, eos, mask, timed=False)
        out.update(verdict="rejects valid", valid_tokens_followed=cold["fed"],
                   mask_and_matcher_agree=cold["mask_and_matcher_agree"],
                   invalid_accepted=bad["fed"] == len(invalid) and bad["end_allowed"])
        return out
    walks = []
    for _ in range(WARM_WALKS):
        engine.reset(matcher)
        walks.append(walk(engine, matcher, valid, eos, mask, timed=True)["times_us"])
    warm = {"times_us": [statistics.median(ts) for ts in zip(*walks)]}
    other = {}
    if hasattr(engine, "fill_bytes"):
        engine.reset(matcher)
        other = {"warm_compute_bitmask": stats(walk(engine, matcher, valid, eos, mask, True, engine.fill_bytes)["times_us"])}
    engine.reset(matcher)
    bad = walk(engine, matcher, invalid, eos, mask, timed=False)
    refused = bad["fed"] < len(invalid) or not bad["end_allowed"]
    out.update(verdict="enforced" if refused else "IGNORED", cold=stats(cold["times_us"]),
               warm=stats(warm["times_us"]), **other, cold_times_us=[round(t, 1) for t in cold["times_us"]],
               invalid_refused_at=f"token {bad['fed']} of {len(invalid)}" if bad["fed"] < len(invalid)
               else ("the end" if refused else None))
    return out


def special_token_in_string(engine, specials: dict[str, int], encode) -> dict:
    """Inside a free JSON string, may the chat template's control tokens be emitted?
    (They would end the turn or open a tool call in the middle of a value.)"""
    matcher = engine.compile({"type": "object", "properties": {"s": {"type": "string"}}, "required": ["s"]})
    for tok in encode('{"s": "abc'):
        engine.consume(matcher, tok)
    mask = np.full((1, (VOCAB_SIZE + 31) // 32), -1, dtype=np.int32)
    engine.fill(matcher, mask)
    return {t: allowed(mask, i) for t, i in specials.items() if t in ("<|im_start|>", "<|im_end|>", "<tool_call>", "<think>")}


def installed_requires(dist: str) -> list[str]:
    return [r for r in (importlib.metadata.requires(dist) or []) if "extra ==" not in r]


def installed_closure(dist: str) -> dict:
    """The installed distributions `dist` pulls in here (its requirements, recursively,
    markers evaluated, extras left out) and their size on disk."""
    from packaging.requirements import Requirement
    from packaging.utils import canonicalize_name

    seen, todo, size = {}, [dist], 0
    while todo:
        name = canonicalize_name(todo.pop())
        if name in seen:
            continue
        try:
            d = importlib.metadata.distribution(name)
        except importlib.metadata.PackageNotFoundError:
            seen[name] = None
            continue
        seen[name] = d.version
        size += sum((f.size or 0) for f in (d.files or []))
        for r in d.requires or []:
            req = Requirement(r)
            if req.marker is None or req.marker.evaluate({"extra": ""}):
                todo.append(req.name)
    return {"distributions": {k: v for k, v in sorted(seen.items())}, "mib": round(size / 2**20)}


def run_engine(cls, tokenizer_json: str, cases: list[Case]) -> dict:
    from tokenizers import Tokenizer

    tok = Tokenizer.from_str(tokenizer_json)
    specials = {t: tok.token_to_id(t) for t in SPECIAL_TOKENS}
    eos = specials[EOS_TOKEN]

    def encode(text: str) -> list[int]:
        return tok.encode(text, add_special_tokens=False).ids

    engine = cls(tokenizer_json, eos)
    # the process's first mask pays one-time set-up (kept out of the first case's numbers)
    mask = np.full((1, (VOCAB_SIZE + 31) // 32), -1, dtype=np.int32)
    warmup = engine.compile({"type": "object", "properties": {"w": {"type": "integer"}}, "required": ["w"]})
    t0 = time.perf_counter_ns()
    engine.fill(warmup, mask)
    first_mask_us = (time.perf_counter_ns() - t0) / 1000
    extra = {}
    if cls is Llguidance:
        words = np.frombuffer(warmup.compute_bitmask(), dtype=np.int32)
        extra["compute_bitmask_words"] = {"words": len(words), "ceil_vocab_32": mask.shape[1],
                                          "extra_words_nonzero": bool(words[mask.shape[1]:].any())}
    results = {}
    for case in cases:
        r = run_case(engine, case, encode, eos)
        results[case.name] = {"group": case.group, **r}
        line = f"  {cls.name:10s} {case.name:28s} {r['verdict']:13s}"
        if "cold" in r:
            line += f" compile {r['compile_ms']:8.1f} ms  mask mean {r['cold']['mean_us']:7.1f} µs (warm {r['warm']['mean_us']:.1f})"
        elif "error" in r:
            line += " " + r["error"][:90].replace("\n", " ")
        print(line, flush=True)
    return {"version": importlib.metadata.version(cls.name), "requires_dist": installed_requires(cls.name),
            "installed_closure": installed_closure(cls.name),
            "python": platform.python_version(), "interpreter": sys.executable, "machine": platform.machine(),
            "system": platform.system(), "how": engine.how, "tokenizer_setup_s": round(engine.setup_s, 2),
            "first_mask_in_process_us": round(first_mask_us, 1), **extra,
            "special_tokens_allowed_inside_a_string": special_token_in_string(engine, specials, encode),
            "cases": results, **({"vocab_type": engine.vocab_type} if hasattr(engine, "vocab_type") else {})}


# ---------------------------------------------------------------- wheels

def wheels(packages: dict[str, str]) -> dict:
    """For each package==version: the wheel pip picks for each platform (Python 3.11) and
    its Requires-Dist (extras left out), or why there is none."""
    out = {}
    with tempfile.TemporaryDirectory() as tmp:
        for pkg, version in packages.items():
            out[pkg] = {"version": version}
            for plat, tags in PLATFORMS.items():
                dest = Path(tmp) / pkg / plat
                cmd = [sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:",
                       "--python-version", "3.11", "-d", str(dest)]
                for tag in tags:
                    cmd += ["--platform", tag]
                done = subprocess.run(cmd + [f"{pkg}=={version}"], capture_output=True, text=True, check=False)
                found = sorted(dest.glob("*.whl")) if dest.exists() else []
                if not found:
                    err = [l for l in done.stderr.splitlines() if l.startswith("ERROR")]
                    out[pkg][plat] = {"wheel": None, "why": (err or ["no wheel"])[0]}
                    continue
                with zipfile.ZipFile(found[0]) as z:
                    meta = next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))
                    lines = z.read(meta).decode().splitlines()
                reqs = [l.split(":", 1)[1].strip() for l in lines if l.startswith("Requires-Dist:")]
                out[pkg][plat] = {"wheel": found[0].name, "kib": found[0].stat().st_size // 1024,
                                  "requires_dist": [r for r in reqs if "extra ==" not in r]}
    return out


# ---------------------------------------------------------------- report

def table(report: dict) -> str:
    rows = ["| schema | group | " + " | ".join(
        f"{e} verdict | {e} compile ms | {e} mask µs mean / p50 / p99 / max (cold) | {e} warm mean µs"
        for e in ENGINES if e in report["engines"]) + " |"]
    engines = [e for e in ENGINES if e in report["engines"]]
    rows.append("|---|---|" + "---|---|---|---|" * len(engines))
    names = list(dict.fromkeys(n for e in engines for n in report["engines"][e]["cases"]))
    for name in names:
        cells = []
        group = ""
        for e in engines:
            r = report["engines"][e]["cases"].get(name)
            if r is None:
                cells += ["-", "-", "-", "-"]
                continue
            group = r["group"]
            c = r.get("cold")
            cells += [f"**{r['verdict']}**" if r["verdict"] != "enforced" else "enforced",
                      f"{r['compile_ms']:.1f}",
                      f"{c['mean_us']:.0f} / {c['p50_us']:.0f} / {c['p99_us']:.0f} / {c['max_us']:.0f}" if c else "-",
                      f"{r['warm']['mean_us']:.0f}" if c else "-"]
        rows.append(f"| {name} | {group} | " + " | ".join(cells) + " |")
    return "\n".join(rows)


def summary(engine: dict) -> dict:
    cases = engine["cases"].values()
    verdicts = {}
    for r in cases:
        verdicts[r["verdict"]] = verdicts.get(r["verdict"], 0) + 1
    cold = [t for r in cases if "cold" in r for t in [r["cold"]["mean_us"]]]
    warm = [r["warm"]["mean_us"] for r in cases if "warm" in r]
    other = [r["warm_compute_bitmask"]["mean_us"] for r in cases if "warm_compute_bitmask" in r]
    p99 = [r["cold"]["p99_us"] for r in cases if "cold" in r]
    comp = [r["compile_ms"] for r in cases if "cold" in r]
    pooled = sorted(t for r in cases if r["group"] == "core" and "cold_times_us" in r for t in r["cold_times_us"])
    return {"verdicts": verdicts,
            "core_enforced": sum(r["verdict"] == "enforced" for r in cases if r["group"] == "core"),
            "core": sum(r["group"] == "core" for r in cases),
            "ignored": sorted(n for n, r in engine["cases"].items() if r["verdict"] == "IGNORED"),
            "errors": sorted(n for n, r in engine["cases"].items() if r["verdict"] == "error"),
            "rejects_valid": sorted(n for n, r in engine["cases"].items() if r["verdict"] == "rejects valid"),
            "median_cold_mean_us": round(statistics.median(cold), 1) if cold else None,
            "median_warm_mean_us": round(statistics.median(warm), 1) if warm else None,
            "median_warm_compute_bitmask_mean_us": round(statistics.median(other), 1) if other else None,
            "worst_p99_us": max(p99) if p99 else None,
            "median_compile_ms": round(statistics.median(comp), 1) if comp else None,
            "max_compile_ms": max(comp) if comp else None,
            "core_pooled": {"n": len(pooled), "mean_us": round(statistics.fmean(pooled), 1),
                            "p50_us": pooled[len(pooled) // 2], "p99_us": pooled[int(0.99 * (len(pooled) - 1))],
                            "max_us": pooled[-1]} if pooled else None}


def markdown(report: dict) -> str:
    v = report["vocabulary"]
    out = ["# Grammar engines: llguidance vs xgrammar (issue 16, item 1)", "",
           ("Written by `bench/archive/grammar_engines.py` (its docstring says how); numbers from "
           f"{report.get('host', '?')}, one thread."), "",
           (f"Vocabulary: a byte-level BPE with the Qwen3.5 split rule trained here, {v['vocab_size']:,} ids "
           f"({v['trained_ids']:,} trained incl. 10 special tokens, {v['padding_ids']} padding) on "
           f"{v['corpus_chars'] / 1e6:.0f}M characters of Python sources and docs, sha256 {v['sha256'][:16]}; "
           "both engines read the same file. Masks are int32 bitmasks of 7,760 words."), ""]
    engines = [e for e in ENGINES if e in report["engines"]]
    if len({report["engines"][e].get("vocabulary_sha256") for e in engines}) > 1:
        out += ["**Warning: the engines were measured on different vocabularies** (see the JSON).", ""]
    out += [table(report), "",
            ("Verdicts: enforced = compiled, the valid instance followed token by token, the instance that "
            "breaks the feature refused; **IGNORED** = compiled and that instance accepted (the keyword was "
            "dropped silently); **error** = the engine refused the schema when compiling; **rejects valid** = "
            "the valid instance was not followed. Mask µs: per position of the valid instance (n = its tokens "
            "+ the end), cold = first walk on a fresh matcher, warm = the same walk after reset() (each "
            f"position's median over {WARM_WALKS} walks). Instances "
            "are checked with the `jsonschema` package (it cannot judge the date-time one without its "
            "optional rfc3339 checker)."), "", "## Per engine", ""]
    for e in engines:
        r, s = report["engines"][e], summary(report["engines"][e])
        pool = s["core_pooled"] or {}
        closure = r.get("installed_closure", {})
        out += [(f"- **{e} {r['version']}** (Python {r['python']}, {r['system']} {r['machine']}): core features "
                f"enforced {s['core_enforced']}/{s['core']}; silently ignored: {', '.join(s['ignored']) or 'none'}; "
                f"refused when compiling: {', '.join(s['errors']) or 'none'}; valid instance rejected: "
                f"{', '.join(s['rejects_valid']) or 'none'}. Mask per token over all {pool.get('n')} positions of "
                f"the core schemas (cold): mean {pool.get('mean_us')} µs, p50 {pool.get('p50_us')}, p99 "
                f"{pool.get('p99_us')}, max {pool.get('max_us')}; warm, median of the schemas' means: "
                f"{s['median_warm_mean_us']} µs"
                + (f" (with compute_bitmask(), a new bytes object per mask, copied: "
                   f"{s['median_warm_compute_bitmask_mean_us']} µs)" if s["median_warm_compute_bitmask_mean_us"] else "")
                + f". Compile: median {s['median_compile_ms']} ms, max "
                f"{s['max_compile_ms']} ms. Tokenizer setup {r['tokenizer_setup_s']} s; the process's first mask "
                f"{r.get('first_mask_in_process_us')} µs (before the cases). Control tokens allowed "
                "inside a free JSON string: "
                f"{', '.join(t for t, ok in r['special_tokens_allowed_inside_a_string'].items() if ok) or 'none'}. "
                f"Requires-Dist: {', '.join(r['requires_dist']) or 'none'}; installed with its dependencies: "
                f"{len(closure.get('distributions', {}))} distributions, {closure.get('mib')} MiB.")]
        for n, c in r["cases"].items():
            if c["verdict"] == "error":
                out.append(f"  - {n}: `{c['error'][:160].replace('`', chr(39)).replace(chr(10), ' ')}`")
            elif c["verdict"] == "rejects valid":
                out.append(f"  - {n}: the valid instance stopped after {c['valid_tokens_followed']} of "
                           f"{c['tokens']} tokens; the invalid one was "
                           f"{'accepted' if c.get('invalid_accepted') else 'refused'}")
    for e in ENGINES:
        if e not in report["engines"]:
            out.append(f"- **{e}**: not measured yet (not installed in the interpreters run so far).")
    out.append("")
    if report.get("wheels"):
        out += ["## Wheels (pip download --no-deps, Python 3.11)", "",
                "| package | macOS arm64 | Linux x86_64 | Linux aarch64 | Requires-Dist (extras left out) |",
                "|---|---|---|---|---|"]
        for pkg, w in report["wheels"].items():
            cells = [f"`{w[p]['wheel']}` ({w[p]['kib']} KiB)" if w[p].get("wheel") else f"none ({w[p].get('why')})"
                     for p in PLATFORMS]
            out.append(f"| {pkg} {w['version']} | " + " | ".join(cells) + f" | {', '.join(wheel_requires(w)) or 'none'} |")
        out.append("")
    out += ["## Conclusion", "", conclusion(report), ""]
    return "\n".join(out)


def wheel_requires(w: dict) -> list[str]:
    return next((w[p]["requires_dist"] for p in PLATFORMS if w.get(p, {}).get("wheel")), [])


def wheel_facts(report: dict, pkg: str) -> str:
    w = report.get("wheels", {}).get(pkg)
    if not w:
        return "wheels not checked (run without --no-wheels)"
    names = [w[p]["wheel"] for p in PLATFORMS if w[p].get("wheel")]
    missing = [p for p in PLATFORMS if not w[p].get("wheel")]
    abi = "abi3 (one wheel for every CPython from its minimum)" if names and all("abi3" in n for n in names) \
        else "one wheel per CPython version"
    reqs = wheel_requires(w)
    glibc = []
    for plat in PLATFORMS:
        tags = [int(m) for m in MANYLINUX.findall(w[plat].get("wheel") or "")]
        if tags:
            glibc.append(f"{plat.split('_', 1)[1]} 2.{min(tags)}")
    abi += f"; glibc needed: {', '.join(glibc)}" if glibc else ""
    return (f"wheels for {', '.join(p for p in PLATFORMS if w[p].get('wheel'))}"
            f"{' (none for ' + ', '.join(missing) + ')' if missing else ''}, {abi}; requires "
            f"{', '.join(reqs) if reqs else 'nothing'}")


def slowest(engine: dict, k: int = 2) -> str:
    timed = sorted(((n, c) for n, c in engine["cases"].items() if "cold" in c), key=lambda nc: -nc[1]["cold"]["mean_us"])
    return "; ".join(f"{n}: mean {c['cold']['mean_us'] / 1000:.1f} ms, max {c['cold']['max_us'] / 1000:.1f} ms, "
                     f"warm mean {c['warm']['mean_us'] / 1000:.1f} ms" for n, c in timed[:k])


def conclusion(report: dict) -> str:
    engines = report["engines"]
    if not all(e in engines for e in ENGINES):
        return "Both engines must be measured before comparing (run the script in each venv)."
    lg, xg = summary(engines["llguidance"]), summary(engines["xgrammar"])
    lp, xp = lg["core_pooled"], xg["core_pooled"]
    lc, xc = engines["llguidance"]["installed_closure"], engines["xgrammar"]["installed_closure"]

    def names(xs):
        return ", ".join(xs) or "none"

    notes, required = [], engines["xgrammar"]["cases"].get("required without properties", {})
    if "patternProperties" in xg["rejects_valid"]:
        notes.append("it matches a patternProperties regex against the whole key: `^x-` admits only the key "
                     "`x-`, where JSON Schema searches the key")
    if required.get("verdict") == "rejects valid" and required.get("invalid_accepted"):
        notes.append('`{"type": "object", "required": ["a"]}` compiles to the empty object only: `{}`, which '
                     'breaks `required`, passes and `{"a": 1}` fails')
    note = f" ({'; '.join(notes)})" if notes else ""
    lspecial = [t for t, ok in engines["llguidance"]["special_tokens_allowed_inside_a_string"].items() if ok]
    xspecial = [t for t, ok in engines["xgrammar"]["special_tokens_allowed_inside_a_string"].items() if ok]
    return "\n".join([
        "The pick: **llguidance**, for these reasons (numbers above):",
        "",
        (f"1. Unsupported features are refused, never dropped. llguidance refused {len(lg['errors'])} of the "
        f"tried keywords when compiling, naming them ({names(lg['errors'])}), and silently ignored "
        f"{len(lg['ignored'])} ({names(lg['ignored'])}). xgrammar compiled {len(xg['ignored'])} of them and "
        f"then accepted output that violates them ({names(xg['ignored'])}), refused {len(xg['errors'])} "
        f"({names(xg['errors'])}), and rejected a valid instance for {names(xg['rejects_valid'])}{note}. "
        "The issue requires a 400 that names an unsupported feature; with xgrammar the server would have to "
        "re-implement the keyword check itself."),
        (f"2. Coverage of what the issue lists: both enforce the core set (llguidance {lg['core_enforced']}/"
        f"{lg['core']}, xgrammar {xg['core_enforced']}/{xg['core']})."),
        (f"3. Mask time per token at 248,320 ids, one thread, all positions of the core schemas (cold): "
        f"llguidance mean {lp['mean_us']} µs, p50 {lp['p50_us']}, p99 {lp['p99_us']}, max {lp['max_us']}; "
        f"xgrammar mean {xp['mean_us']} µs, p50 {xp['p50_us']}, p99 {xp['p99_us']}, max {xp['max_us']}. "
        f"Compile: llguidance median {lg['median_compile_ms']} ms (max {lg['max_compile_ms']}), xgrammar "
        f"median {xg['median_compile_ms']} ms (max {xg['max_compile_ms']}). xgrammar precomputes token masks "
        "when compiling: its median mask is tiny, but a new request schema waits for that compile before its "
        "first token (a few ms without free-text strings, longest with a complex regex such as format email), "
        "and free-string positions cost it a few hundred µs. llguidance compiles in milliseconds and computes "
        f"masks as it goes; its slowest schemas: {slowest(engines['llguidance'])}. The mean of either is well "
        "under a millisecond; its share of a decode step is bench/archive/structured.py's measure. Mask time does not "
        "decide between them."),
        (f"4. Wheels and dependencies: llguidance {engines['llguidance']['version']}: "
        f"{wheel_facts(report, 'llguidance')}; installed {lc['mib']} MiB in {len(lc['distributions'])} "
        f"distribution(s). xgrammar {engines['xgrammar']['version']}: {wheel_facts(report, 'xgrammar')}; "
        f"installed with its dependencies {xc['mib']} MiB in {len(xc['distributions'])} distributions, "
        "torch and transformers among them, which monolith (MLX) does not need at run time."),
        ("5. Control tokens: with TokenizerInfo.from_huggingface xgrammar reads the vocabulary's special tokens "
        f"as their literal text and allows {names(xspecial)} inside a JSON string; llguidance allows "
        f"{names(lspecial)}."),
    ])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--engine", choices=ENGINES, action="append", help="default: every installed one")
    ap.add_argument("--cases", help="comma-separated case names (default: all)")
    ap.add_argument("--cache", type=Path,
                    default=Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "monolith-bench")
    ap.add_argument("--json", type=Path, default=RESULTS)
    ap.add_argument("--no-wheels", action="store_true", help="do not ask the registry about wheels")
    args = ap.parse_args()

    cases = CASES
    if args.cases:
        wanted = [c.strip() for c in args.cases.split(",")]
        unknown = set(wanted) - {c.name for c in CASES}
        if unknown:
            raise SystemExit(f"unknown case(s) {sorted(unknown)}; known: {[c.name for c in CASES]}")
        cases = [c for c in CASES if c.name in wanted]
    report = json.loads(args.json.read_text()) if args.json.exists() else {"engines": {}}
    ref = reference_check(cases)
    print(f"instances checked with jsonschema: {ref}")
    tokenizer_json, vocab = vocabulary(args.cache)
    print(f"vocabulary: {vocab['vocab_size']} ids ({vocab['trained_ids']} trained), sha256 {vocab['sha256'][:16]}")
    classes = {"llguidance": Llguidance, "xgrammar": Xgrammar}
    for name in args.engine or ENGINES:
        try:
            importlib.metadata.version(name)
            __import__(name)
        except (ImportError, importlib.metadata.PackageNotFoundError) as e:
            print(f"{name}: not installed in {sys.executable} ({e})")
            if name not in report["engines"]:
                report.setdefault("not_installed", {})[name] = sys.executable
            continue
        result = run_engine(classes[name], tokenizer_json, cases)
        result["vocabulary_sha256"] = vocab["sha256"]
        result["instances_reference"] = ref
        result["measured_at"] = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
        report["engines"][name] = result
        report.get("not_installed", {}).pop(name, None)
    report["vocabulary"] = {k: v for k, v in vocab.items() if k != "path"}
    report["host"] = f"{platform.system()} {platform.machine()}, {os.cpu_count()} cores"
    if not args.no_wheels:
        versions = {e: report["engines"][e]["version"] for e in ENGINES if e in report["engines"]}
        if versions:
            report["wheels"] = {**report.get("wheels", {}), **wheels(versions)}
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(report, indent=1, ensure_ascii=False) + "\n")
    md = markdown(report)
    args.json.with_suffix(".md").write_text(md)
    print()
    print(table(report))
    print()
    print(conclusion(report))
    print(f"\nwrote {args.json} and {args.json.with_suffix('.md')}")


if __name__ == "__main__":
    main()
