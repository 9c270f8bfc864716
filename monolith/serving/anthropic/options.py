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
from typing import Annotated, Literal

from pydantic import Field

from ...runtime.grammar import Grammar, GrammarError
from ..errors import APIError, bad
from ..fields import Object, Positive, Strict
from ..structured import THINK_END

EFFORTS = ("low", "medium", "high", "xhigh", "max")
MEDIUM_SHARE = 4  # effort "medium": reasoning up to max_tokens // MEDIUM_SHARE


class ThinkingConfig(Strict):
    type: Literal["enabled", "disabled", "adaptive", "between_tools"]
    budget_tokens: Positive | None = None  # of "enabled" only
    display: Literal["summarized", "omitted"] | None = None


class OutputFormat(Strict):
    type: Literal["json_schema"]
    schema_: Annotated[Object, Field(alias="schema")]


class OutputConfig(Strict):
    effort: Literal[EFFORTS] | None = None
    format: OutputFormat | None = None


@dataclass(frozen=True)
class Thinking:
    switch: bool | None = None  # enable_thinking for the template (None: the template's default)
    budget: int | None = None  # reasoning tokens at most, below max_tokens (None: no budget)
    required: bool = False  # the budget was asked for (budget_tokens): a template that cannot enforce it is a 400
    show: bool = True  # thinking.display is not "omitted"


def parse_thinking(value: ThinkingConfig | None, config: OutputConfig | None, max_tokens: int | None,
                   ends_with_tool_result: bool) -> Thinking:
    """The Thinking of a request's `thinking` and `output_config.effort`."""
    effort = config.effort if config is not None else None
    kind = "adaptive" if value is None else value.type
    show = value is None or value.display != "omitted"
    if value is not None and value.budget_tokens is not None and kind != "enabled":
        raise bad("unsupported field: thinking.budget_tokens (only \"enabled\" thinking takes a budget)",
                  "thinking.budget_tokens")
    if kind == "disabled":
        return Thinking(False, show=show)
    if kind == "between_tools":
        return Thinking(ends_with_tool_result, show=show)
    if kind == "enabled":
        budget = value.budget_tokens
        if budget is None:
            raise bad("thinking.budget_tokens must be an integer >= 1, got None", "thinking.budget_tokens")
        below = max_tokens is not None and budget < max_tokens
        return Thinking(True, budget if below else None, below, show)
    if effort is None:
        return Thinking(None, show=show)
    if effort == "medium" and max_tokens is not None and max_tokens >= MEDIUM_SHARE:
        return Thinking(True, max_tokens // MEDIUM_SHARE, False, show)
    return Thinking(effort != "low", show=show)


def output_format(config: OutputConfig | None) -> dict | None:
    """The chat body's `response_format` for `output_config` (None: free text)."""
    if config is None or config.format is None:
        return None
    return {"type": "json_schema", "json_schema": {"name": "output", "schema": config.format.schema_}}


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
