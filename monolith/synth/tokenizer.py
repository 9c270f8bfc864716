"""A small Qwen-style tokenizer: byte-level BPE trained on the bundled corpus, special
tokens at the end of the vocabulary (as in Qwen), a ChatML chat template with tools.

Training is deterministic: the trainer sees one fixed text, and the result is
serialized with sorted keys; the bytes are the same on every run.
"""

from __future__ import annotations

import functools
import json
from importlib import resources
from pathlib import Path

from .writers import write_json

BPE_VOCAB_SIZE = 400  # byte alphabet (256) + merges; special tokens come after
SPECIAL_TOKENS = (
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<think>",
    "</think>",
    "<tool_call>",
    "</tool_call>",
    "<tool_response>",
    "</tool_response>",
    "<|mask|>",
)
# Tokens a detokenizer keeps in text (Qwen marks the reasoning/tool tags non-special).
TEXT_TAGS = {"<think>", "</think>", "<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>"}
EOS_TOKEN = "<|im_end|>"
PAD_TOKEN = "<|endoftext|>"
MASK_TOKEN = "<|mask|>"
# The split rule of the Qwen3.5 tokenizer, applied before byte-level mapping.
PRETOKENIZE_REGEX = (
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}|"""
    r""" ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"""
)

CHAT_TEMPLATE = """\
{%- macro render_content(content) -%}
{%- if content is string -%}{{ content }}
{%- elif content is iterable -%}{%- for part in content -%}{%- if part.type == 'text' -%}{{ part.text }}
{%- elif part.type == 'image' or 'image' in part -%}{{ '<|vision_start|><|image_pad|><|vision_end|>' }}{%- endif -%}
{%- endfor -%}
{%- endif -%}
{%- endmacro -%}
{%- if tools is defined and tools %}
{{- '<|im_start|>system\\n' }}
{%- if messages[0].role == 'system' %}{{- render_content(messages[0].content) + '\\n\\n' }}{%- endif %}
{{- '# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\n' }}
{{- 'You are provided with function signatures within <tools></tools> XML tags:\\n<tools>' }}
{%- for tool in tools %}{{- '\\n' + (tool | tojson) }}{%- endfor %}
{{- '\\n</tools>\\n\\nFor each function call, return a json object with function name and arguments' }}
{{- ' within <tool_call></tool_call> XML tags:\\n<tool_call>\\n' }}
{{- '{"name": <function-name>, "arguments": <args-json-object>}\\n</tool_call><|im_end|>\\n' }}
{%- elif messages[0].role == 'system' %}
{{- '<|im_start|>system\\n' + render_content(messages[0].content) + '<|im_end|>\\n' }}
{%- endif %}
{%- for message in messages %}
{%- if message.role == 'user' or (message.role == 'system' and not loop.first) %}
{{- '<|im_start|>' + message.role + '\\n' + render_content(message.content) + '<|im_end|>\\n' }}
{%- elif message.role == 'assistant' %}
{{- '<|im_start|>assistant\\n' }}
{%- if message.reasoning_content is defined and message.reasoning_content and loop.last %}
{{- '<think>\\n' + message.reasoning_content.strip() + '\\n</think>\\n\\n' }}
{%- endif %}
{%- set content = message.content if message.content is defined and message.content else '' %}
{{- render_content(content) }}
{%- if message.tool_calls is defined and message.tool_calls %}
{%- for tool_call in message.tool_calls %}
{%- set call = tool_call.function if tool_call.function is defined else tool_call %}
{%- if content or not loop.first %}{{- '\\n' }}{%- endif %}
{{- '<tool_call>\\n{"name": "' + call.name + '", "arguments": ' }}
{%- if call.arguments is string %}{{- call.arguments }}{%- else %}{{- call.arguments | tojson }}{%- endif %}
{{- '}\\n</tool_call>' }}
{%- endfor %}
{%- endif %}
{{- '<|im_end|>\\n' }}
{%- elif message.role == 'tool' %}
{%- if loop.first or messages[loop.index0 - 1].role != 'tool' %}{{- '<|im_start|>user' }}{%- endif %}
{{- '\\n<tool_response>\\n' + render_content(message.content) + '\\n</tool_response>' }}
{%- if loop.last or messages[loop.index0 + 1].role != 'tool' %}{{- '<|im_end|>\\n' }}{%- endif %}
{%- endif %}
{%- endfor %}
{%- if add_generation_prompt is defined and add_generation_prompt %}
{{- '<|im_start|>assistant\\n' }}
{%- if enable_thinking is defined and enable_thinking is false %}{{- '<think>\\n\\n</think>\\n\\n' }}{%- endif %}
{%- endif %}
"""


def corpus_text() -> str:
    """The English + code corpus the package carries (monolith/data/corpus.txt)."""
    return resources.files("monolith").joinpath("data", "corpus.txt").read_text(encoding="utf-8")


@functools.lru_cache(maxsize=1)
def tokenizer_json() -> str:
    """tokenizer.json text (trained once per process)."""
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers

    corpus = corpus_text()
    tok = Tokenizer(models.BPE(unk_token=None, fuse_unk=False, byte_fallback=False))
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(PRETOKENIZE_REGEX), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=BPE_VOCAB_SIZE,
        min_frequency=2,
        show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        special_tokens=[],
    )
    tok.train_from_iterator(corpus.splitlines(keepends=True), trainer=trainer)
    for t in SPECIAL_TOKENS:  # one at a time keeps the ids in order
        if t in TEXT_TAGS:  # add_special_tokens would mark them special and decoding would drop them
            tok.add_tokens([AddedToken(t, special=False, normalized=False)])
        else:
            tok.add_special_tokens([AddedToken(t, special=True, normalized=False)])
    return json.dumps(json.loads(tok.to_str()), indent=2, sort_keys=True, ensure_ascii=False) + "\n"


@functools.lru_cache(maxsize=1)
def special_token_ids() -> dict[str, int]:
    """Special token -> id in the synthetic tokenizer."""
    added = json.loads(tokenizer_json())["added_tokens"]
    return {t["content"]: t["id"] for t in added}


def tokenizer_size() -> int:
    return max(special_token_ids().values()) + 1


def tokenizer_config() -> dict:
    ids = special_token_ids()
    return {
        "add_bos_token": False,
        "add_prefix_space": False,
        "added_tokens_decoder": {
            str(ids[t]): {
                "content": t,
                "lstrip": False,
                "normalized": False,
                "rstrip": False,
                "single_word": False,
                "special": t not in TEXT_TAGS,
            }
            for t in SPECIAL_TOKENS
        },
        "bos_token": None,
        "chat_template": CHAT_TEMPLATE,
        "clean_up_tokenization_spaces": False,
        "eos_token": EOS_TOKEN,
        "errors": "replace",
        "model_max_length": 262144,
        "pad_token": PAD_TOKEN,
        "split_special_tokens": False,
        "tokenizer_class": "Qwen2Tokenizer",
        "unk_token": None,
    }


def generation_config() -> dict:
    ids = special_token_ids()
    return {
        "bos_token_id": ids[PAD_TOKEN],
        "do_sample": True,
        "eos_token_id": [ids[EOS_TOKEN], ids[PAD_TOKEN]],
        "pad_token_id": ids[PAD_TOKEN],
        "temperature": 1.0,
        "top_k": 20,
        "top_p": 0.95,
    }


def write_tokenizer(out_dir) -> None:
    """Write tokenizer.json, tokenizer_config.json (with the chat template) and
    chat_template.jinja into out_dir."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "tokenizer.json").write_text(tokenizer_json(), encoding="utf-8")
    write_json(out / "tokenizer_config.json", tokenizer_config())
    (out / "chat_template.jinja").write_text(CHAT_TEMPLATE, encoding="utf-8")
