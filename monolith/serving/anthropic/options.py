"""How a Messages request shapes the reply: `thinking`, `output_config.effort` and
`output_config.format`, mapped onto Qwen's thinking switch (the template's
`enable_thinking`), a reasoning budget and the output grammar.

The switch:
- `thinking: {"type": "enabled", "budget_tokens": N}` on, `{"type": "disabled"}` off;
- `{"type": "between_tools"}` on only when the conversation ends with a tool result (the
  model thinks between its tool calls, not before the first);
- `{"type": "adaptive"}` or no `thinking`: what `output_config.effort` says (`low` off;
  `medium`, `high`, `xhigh`, `max` on), and without an effort the template's default
  (Qwen3.6 thinks).

The budget: `budget_tokens` below max_tokens is enforced (after that many reasoning
tokens the `</think>` token is forced, through speculation too: runtime.grammar's
budget), and needs a template that opens the think block (Qwen3.6's does with thinking
on), else it is refused. `effort: "medium"` without a budget of its own caps the
reasoning at a quarter of max_tokens where the template lets that be enforced (an
effort is a hint; elsewhere it only sets the switch). `thinking.display: "omitted"`
keeps the thinking blocks empty (the reasoning is still generated, as Anthropic's is).

`output_config.format` (`{"type": "json_schema", "schema": ...}`) is a JSON schema the
text must follow, enforced by the grammar as `response_format` is on the chat endpoint.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from ...runtime.grammar import Grammar, GrammarError
from ..errors import APIError, bad
from ..fields import refuse_unknown
from ..structured import THINK_END

EFFORTS = ("low", "medium", "high", "xhigh", "max")
MEDIUM_SHARE = 4  # effort "medium": reasoning up to max_tokens // MEDIUM_SHARE
THINKING_TYPES = ("enabled", "disabled", "adaptive", "between_tools")


@dataclass(frozen=True)
class Thinking:
    switch: bool | None = None  # enable_thinking for the template (None: the template's default)
    budget: int | None = None  # reasoning tokens at most, below max_tokens (None: no budget)
    required: bool = False  # the budget was asked for (budget_tokens): a template that cannot enforce it is a 400
    show: bool = True  # thinking.display is not "omitted"


def parse_thinking(body: dict, ends_with_tool_result: bool) -> Thinking:
    """The Thinking of a request's `thinking` and `output_config.effort`."""
    value = body.get("thinking")
    effort = _effort(body.get("output_config"))
    max_tokens = body.get("max_tokens")
    if value is not None and (not isinstance(value, dict) or value.get("type") not in THINKING_TYPES):
        raise bad("thinking must be {\"type\": \"enabled\", \"budget_tokens\": N}, {\"type\": \"adaptive\"}, "
                  "{\"type\": \"between_tools\"} or {\"type\": \"disabled\"}", "thinking")
    kind = "adaptive" if value is None else value["type"]
    refuse_unknown(value or {}, {"type", "display"} | ({"budget_tokens"} if kind == "enabled" else set()), "thinking.")
    show = _display(value or {})
    if kind == "disabled":
        return Thinking(False, show=show)
    if kind == "between_tools":
        return Thinking(ends_with_tool_result, show=show)
    if kind == "enabled":
        budget = value.get("budget_tokens")
        if isinstance(budget, bool) or not isinstance(budget, int) or budget < 1:
            raise bad(f"thinking.budget_tokens must be an integer >= 1, got {budget!r}", "thinking.budget_tokens")
        below = max_tokens is not None and budget < max_tokens
        return Thinking(True, budget if below else None, below, show)
    if effort is None:
        return Thinking(None, show=show)
    if effort == "medium" and max_tokens is not None and max_tokens >= MEDIUM_SHARE:
        return Thinking(True, max_tokens // MEDIUM_SHARE, False, show)
    return Thinking(effort != "low", show=show)


def _effort(config) -> str | None:
    if config is None:
        return None
    effort = config.get("effort") if isinstance(config, dict) else None
    if effort is not None and effort not in EFFORTS:
        raise bad(f"output_config.effort must be one of {', '.join(EFFORTS)}, got {str(effort)[:40]!r}",
                  "output_config.effort")
    return effort


def _display(value: dict) -> bool:
    display = value.get("display")
    if display not in (None, "summarized", "omitted"):
        raise bad(f"thinking.display must be \"summarized\" or \"omitted\", got {str(display)[:40]!r}",
                  "thinking.display")
    return display != "omitted"


def output_format(config) -> dict | None:
    """The chat body's `response_format` for `output_config` (None: free text)."""
    if config is None:
        return None
    if not isinstance(config, dict):
        raise bad("output_config must be an object like {\"effort\": \"high\"}", "output_config")
    refuse_unknown(config, {"effort", "format"}, "output_config.")
    value = config.get("format")
    if value is None:
        return None
    if not isinstance(value, dict) or value.get("type") != "json_schema":
        raise bad("output_config.format must be {\"type\": \"json_schema\", \"schema\": {...}}",
                  "output_config.format")
    refuse_unknown(value, {"type", "schema"}, "output_config.format.")
    if not isinstance(value.get("schema"), dict):
        raise bad("output_config.format.schema must be a JSON schema object", "output_config.format.schema")
    return {"type": "json_schema", "json_schema": {"name": "output", "schema": value["schema"]}}


def budget_grammar(thinking: Thinking, reasoning_open: bool, constraint: Grammar | None, tokenizer,
                   grammar_tokenizer) -> Grammar | None:
    """The grammar that ends the reasoning after thinking.budget tokens (the `</think>`
    token is then forced: runtime.grammar's budget), then lets the answer be free text,
    or what `constraint` (which starts after `</think>`) asks for. A budget the template
    cannot enforce is refused if it was asked for, else dropped (`constraint` as is)."""
    end = tokenizer.token_to_id(THINK_END)
    if not reasoning_open or end is None:
        if not thinking.required:
            return constraint
        raise bad(f"thinking.budget_tokens {thinking.budget} is below max_tokens, but this model's chat template "
                  "does not open a reasoning block, so the budget cannot be enforced; send budget_tokens >= "
                  "max_tokens", "thinking.budget_tokens")
    if constraint is not None:
        return replace(constraint, budget=thinking.budget)
    grammar = Grammar("start: /(?s:.*)/", end, thinking.budget)
    try:
        grammar_tokenizer.check(grammar)
    except GrammarError as e:  # not expected: the grammar allows any text
        raise APIError(500, f"the reasoning budget's grammar was refused: {e}") from None
    return grammar
