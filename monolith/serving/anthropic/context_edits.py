"""Anthropic's context editing (`context_management.edits`) on the server side: old tool
results and old thinking are cleared from the conversation before it is rendered, and
what was cleared is reported back (`context_management.applied_edits`).

The edits work on the OpenAI-shaped messages requests.py makes of the request (tool
results are `tool` messages, tool uses an assistant message's `tool_calls`, thinking its
`reasoning_content`), in the order the request lists them, each seeing the previous
one's result. Token counts are the rendered prompt's own (`count(messages)` renders the
template and tokenizes), so `cleared_input_tokens` is exact.

- `clear_tool_uses_20250919`: when `trigger` is passed (default: more than 100,000 input
  tokens; or `{"type": "tool_uses", "value": N}`: more than N tool uses), every tool use
  but the last `keep` (default 3) has its result replaced by a short placeholder, except
  uses of the `exclude_tools`; `clear_tool_inputs` (true, or a list of tool names) also
  empties the call's input. With `clear_at_least`, nothing is cleared unless that many
  tokens would go.
- `clear_thinking_20251015`: the thinking of all but the last `keep` assistant turns
  that have any (default 1; `"all"` keeps everything) is dropped.
- `compact_20260112` (a summary written by the model) is refused, as is any other type.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, replace

from ..errors import bad
from ..fields import refuse_unknown
from ..images import prompt_ids

CLEAR_TOOL_USES = "clear_tool_uses_20250919"
CLEAR_THINKING = "clear_thinking_20251015"
COMPACT = "compact_20260112"
CLEARED_RESULT = "[This tool result was cleared to save context.]"
DEFAULT_TRIGGER = ("input_tokens", 100_000)
DEFAULT_KEEP_TOOL_USES = 3
DEFAULT_KEEP_THINKING = 1
TOOL_USE_FIELDS = {"type", "trigger", "keep", "clear_at_least", "exclude_tools", "clear_tool_inputs"}

Count = Callable[[list[dict]], int]


@dataclass(frozen=True)
class ClearToolUses:
    trigger: tuple[str, int] = DEFAULT_TRIGGER  # ("input_tokens" | "tool_uses", more than this)
    keep: int = DEFAULT_KEEP_TOOL_USES
    clear_at_least: int = 0
    exclude: frozenset[str] = frozenset()
    clear_inputs: bool | frozenset[str] = False

    def apply(self, messages: list[dict], count: Count) -> tuple[list[dict], dict | None]:
        uses = _tool_uses(messages)
        kind, limit = self.trigger
        if (len(uses) if kind == "tool_uses" else count(messages)) <= limit:
            return messages, None
        old = uses[:max(len(uses) - self.keep, 0)]
        cleared = [(at, call) for at, call in old if call["function"]["name"] not in self.exclude]
        if not cleared:
            return messages, None
        edited = self._clear(messages, cleared)
        tokens = count(messages) - count(edited)
        if tokens < self.clear_at_least:
            return messages, None
        return edited, {"type": CLEAR_TOOL_USES, "cleared_tool_uses": len(cleared), "cleared_input_tokens": tokens}

    def _clear(self, messages: list[dict], cleared: list[tuple[int, dict]]) -> list[dict]:
        ids = {call["id"] for _, call in cleared}
        inputs = {call["id"] for _, call in cleared if self.clear_inputs is True
                  or (self.clear_inputs and call["function"]["name"] in self.clear_inputs)}
        out = []
        for m in messages:
            if m["role"] == "tool" and m.get("tool_call_id") in ids:
                m = {**m, "content": CLEARED_RESULT}
            elif m["role"] == "assistant" and any(c["id"] in inputs for c in m.get("tool_calls") or ()):
                calls = [{**c, "function": {**c["function"], "arguments": "{}"}} if c["id"] in inputs else c
                         for c in m["tool_calls"]]
                m = {**m, "tool_calls": calls}
            out.append(m)
        return out


@dataclass(frozen=True)
class ClearThinking:
    keep: int | None = DEFAULT_KEEP_THINKING  # None: all

    def apply(self, messages: list[dict], count: Count) -> tuple[list[dict], dict | None]:
        turns = [i for i, m in enumerate(messages) if m["role"] == "assistant" and m.get("reasoning_content")]
        if self.keep is None or len(turns) <= self.keep:
            return messages, None
        drop = set(turns[:len(turns) - self.keep])
        edited = [{k: v for k, v in m.items() if k != "reasoning_content"} if i in drop else m
                  for i, m in enumerate(messages)]
        return edited, {"type": CLEAR_THINKING, "cleared_thinking_turns": len(drop),
                        "cleared_input_tokens": count(messages) - count(edited)}


@dataclass(frozen=True)
class ContextEdits:
    edits: tuple

    def apply(self, messages: list[dict], count: Count) -> tuple[list[dict], list[dict]]:
        """(the edited messages, the applied edits as the reply reports them)."""
        applied = []
        for edit in self.edits:
            messages, report = edit.apply(messages, count)
            if report is not None:
                applied.append(report)
        return messages, applied


def _tool_uses(messages: list[dict]) -> list[tuple[int, dict]]:
    return [(i, call) for i, m in enumerate(messages) if m["role"] == "assistant" for call in m.get("tool_calls") or ()]


def edit_context(req, tokenizer, original: bool, images) -> tuple[object, list[dict] | None, int | None]:
    """(req.chat after req.edits, the edits applied (None: none were asked for), with
    `original` the prompt's tokens before them, its images' tokens included: `images`, the
    request's images.ImageLoader). Renders the template: a worker thread's work."""
    if req.edits is None:
        return req.chat, None, None
    chat, counted = req.chat, {}

    def count(messages: list[dict]) -> int:
        key = json.dumps(messages, sort_keys=True)
        if key not in counted:
            try:
                text = tokenizer.apply_chat_template(messages, chat.tools, **chat.template_kwargs)
            except ValueError as e:  # TokenizerError: the template refused the conversation
                raise bad(str(e), "messages") from None
            counted[key] = len(prompt_ids(tokenizer, text, images.of(messages), images.vision))
        return counted[key]

    messages, applied = req.edits.apply(chat.messages, count)
    return replace(chat, messages=messages), applied, count(chat.messages) if original else None


# ------------------------------------------------------------------ the request field


def parse_context_management(value) -> ContextEdits | None:
    """`context_management` -> ContextEdits (None: no edits)."""
    if value is None:
        return None
    if not isinstance(value, dict):
        raise bad("context_management must be an object like {\"edits\": [...]}", "context_management")
    refuse_unknown(value, {"edits"}, "context_management.")
    edits = value.get("edits")
    if edits is None:
        return None
    if not isinstance(edits, list):
        raise bad("context_management.edits must be a list of edit objects", "context_management.edits")
    return ContextEdits(tuple(_edit(e, f"context_management.edits[{i}]") for i, e in enumerate(edits)))


def _edit(value, at: str):
    if not isinstance(value, dict):
        raise bad(f"{at} must be an object with a \"type\"", at)
    kind = value.get("type")
    if kind == CLEAR_TOOL_USES:
        refuse_unknown(value, TOOL_USE_FIELDS, f"{at}.")
        return ClearToolUses(_trigger(value.get("trigger"), f"{at}.trigger"),
                             _amount(value.get("keep"), ("tool_uses",), f"{at}.keep", DEFAULT_KEEP_TOOL_USES),
                             _amount(value.get("clear_at_least"), ("input_tokens",), f"{at}.clear_at_least", 0),
                             _names(value.get("exclude_tools"), f"{at}.exclude_tools"),
                             _clear_inputs(value.get("clear_tool_inputs"), f"{at}.clear_tool_inputs"))
    if kind == CLEAR_THINKING:
        refuse_unknown(value, {"type", "keep"}, f"{at}.")
        keep = value.get("keep")
        if keep == "all" or (isinstance(keep, dict) and keep.get("type") == "all" and len(keep) == 1):
            return ClearThinking(None)
        return ClearThinking(_amount(keep, ("thinking_turns",), f"{at}.keep", DEFAULT_KEEP_THINKING))
    if kind == COMPACT:
        raise bad(f"{at}.type: {COMPACT} (a summary of the conversation written by the model) is not supported by "
                  f"this server; {CLEAR_TOOL_USES} and {CLEAR_THINKING} are", f"{at}.type")
    raise bad(f"{at}.type: unknown context edit {str(kind)[:60]!r} (supported: {CLEAR_TOOL_USES}, {CLEAR_THINKING})",
              f"{at}.type")


def _amount(value, kinds: tuple[str, ...], at: str, default: int) -> int:
    if value is None:
        return default
    if not isinstance(value, dict) or value.get("type") not in kinds or set(value) != {"type", "value"} \
            or isinstance(value["value"], bool) or not isinstance(value["value"], int) or value["value"] < 0:
        raise bad(f"{at} must be {{\"type\": \"{kinds[0]}\", \"value\": N}} with an integer N >= 0", at)
    return value["value"]


def _trigger(value, at: str) -> tuple[str, int]:
    if value is None:
        return DEFAULT_TRIGGER
    kind = value.get("type") if isinstance(value, dict) else None
    if kind not in ("input_tokens", "tool_uses"):
        raise bad(f"{at} must be {{\"type\": \"input_tokens\" | \"tool_uses\", \"value\": N}}", at)
    return kind, _amount(value, (kind,), at, 0)


def _names(value, at: str) -> frozenset[str]:
    if value is None:
        return frozenset()
    if not isinstance(value, list) or not all(isinstance(n, str) for n in value):
        raise bad(f"{at} must be a list of tool names", at)
    return frozenset(value)


def _clear_inputs(value, at: str) -> bool | frozenset[str]:
    if value is None or isinstance(value, bool):
        return bool(value)
    return _names(value, at)
