"""OpenAI's chat and completion requests: the bodies of POST /v1/chat/completions
(`ChatBody`) and POST /v1/completions (`CompletionBody`), typed, with their field policy
declared on them (fields.py), into the requests the engine driving runs.

Fields a client may send that would change the result but are not implemented
(penalties, logit_bias, n > 1, audio, ...) are refused naming them, never
ignored; fields that change nothing (ids, metadata, caching and service hints) are
accepted. A JSON null means "not given", as the OpenAI API treats it. The `monolith`
field is our extension (speculation.py). docs/api-fields.md has the table of every
field and why.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Annotated, Any, Literal

from pydantic import Discriminator, Field, Tag

from ...runtime.events import MAX_TOP_LOGPROBS
from .. import images
from ..errors import bad
from ..fields import (
    Body,
    Flag,
    Integer,
    Object,
    Positive,
    Real,
    Strict,
    Text,
    by_type,
    inert,
    neutral,
    parse,
    refused,
)
from ..requests import (
    THINKING_BY_EFFORT,
    ChatRequest,
    ChatTool,
    GenerationFields,
    SamplingDefaults,
    chat_request,
    chat_tools,
    sampling,
    stop_strings,
    template_kwargs,
)
from ..structured import response_format
from ..tools.specs import json_arguments, named

Effort = Literal[tuple(THINKING_BY_EFFORT)]
TopLogprobs = Annotated[Integer, Field(ge=0, le=MAX_TOP_LOGPROBS)]
CACHE = "the prompt cache is automatic"


class StreamOptions(Strict):
    include_usage: Flag | None = None
    include_obfuscation: Flag | None = None  # no obfuscation padding is sent


class SamplingBody(Body):
    """What the chat and completion bodies share: sampling, limits, streaming, and the
    fields accepted and refused alike."""

    model: Text | None = None
    stream: Flag = False
    stream_options: StreamOptions | None = None  # changes nothing when not streaming
    max_tokens: Positive | None = None
    temperature: Real | None = None
    top_p: Real | None = None
    top_k: Integer | None = None  # vLLM's extension: 0 or -1 is off
    min_p: Real | None = None  # vLLM's extension
    seed: Integer | None = None
    stop: Text | list[Text] | None = None
    # ids, metadata, caching and service hints, a predicted output (a latency hint)
    user: Annotated[Any, inert("an end-user id")] = None
    safety_identifier: Annotated[Any, inert("an end-user id")] = None
    metadata: Annotated[Any, inert("client metadata; nothing is stored")] = None
    store: Annotated[Any, inert("chat completions are not stored")] = None
    service_tier: Annotated[Any, inert("one tier here")] = None
    prompt_cache_key: Annotated[Any, inert(CACHE)] = None
    prompt_cache_options: Annotated[Any, inert(CACHE)] = None
    prompt_cache_retention: Annotated[Any, inert("entries live until the cache needs the room")] = None
    prediction: Annotated[Any, inert("a latency hint: a predicted output does not change what is generated")] = None
    # accepted only at the value that means "off" (or the API's default)
    presence_penalty: Annotated[Any, neutral(0, "penalties are not implemented")] = None
    frequency_penalty: Annotated[Any, neutral(0, "penalties are not implemented")] = None
    repetition_penalty: Annotated[Any, neutral(1, "not implemented")] = None
    logit_bias: Annotated[Any, neutral({}, "not implemented")] = None
    n: Annotated[Any, neutral(1, "one choice per request", "only n=1 is supported")] = None
    best_of: Annotated[Any, neutral(1, "one candidate per request", "only best_of=1 is supported")] = None
    echo: Annotated[Any, neutral(False, "the prompt is not echoed")] = None
    suffix: Annotated[Any, neutral("", "no fill-in-the-middle")] = None
    modalities: Annotated[Any, neutral(["text"], "audio output is not supported")] = None
    verbosity: Annotated[Any, neutral("medium", "the model has no verbosity control")] = None
    # refused whatever their value: what they ask for does not exist here
    audio: Annotated[Any, refused("audio output is not supported")] = None
    web_search_options: Annotated[Any, refused("there is no web search")] = None
    moderation: Annotated[Any, refused("no moderation model runs here")] = None
    functions: Annotated[Any, refused("deprecated and not supported: send tools")] = None
    function_call: Annotated[Any, refused("deprecated and not supported: send tool_choice")] = None

    def fields(self, defaults: SamplingDefaults, max_tokens: int | None, logprobs: int | None) -> GenerationFields:
        params = sampling(defaults, self.temperature, self.top_p, self.top_k, self.min_p, self.seed)
        usage = bool(self.stream_options and self.stream_options.include_usage) and self.stream
        return GenerationFields(self.model, self.stream, usage, max_tokens, params, stop_strings(self.stop), logprobs)


# ------------------------------------------------------------------ chat


class TextPart(Strict, extra="ignore"):  # other keys (prompt_cache_breakpoint, cache_control): no effect
    type: Literal["text"]
    text: Text


# a text part, or another part (an image: images.py reads it)
ContentPart = Annotated[Annotated[TextPart, Tag("text")] | Annotated[Object, Tag("other")],
                        by_type({"text": "text"})]


class CalledFunction(Strict, extra="ignore"):
    name: Annotated[Text, Field(min_length=1)]
    arguments: Text | Object = Field(default_factory=dict)  # JSON text in the API; templates iterate a mapping


class MessageCall(Strict, extra="ignore"):
    function: CalledFunction
    id: Any = None


class ChatMessage(Strict):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: Text | list[ContentPart] | None = None
    name: Text | None = None
    tool_calls: list[MessageCall] | None = None
    tool_call_id: Text | None = None
    reasoning_content: Text | None = None  # our extension: an assistant turn's reasoning
    refusal: Annotated[Any, inert("a past refusal text; not rendered")] = None


class NamedFunction(Strict, extra="ignore"):
    name: Text


class NamedChoice(Strict, extra="ignore"):
    type: Literal["function"]
    function: NamedFunction


class AllowedTool(Strict, extra="ignore"):
    type: Literal["function"]
    function: NamedFunction


class AllowedTools(Strict, extra="ignore"):
    mode: Literal["auto", "required"]
    tools: list[AllowedTool]


class AllowedChoice(Strict, extra="ignore"):
    type: Literal["allowed_tools"]
    allowed_tools: AllowedTools


def _choice_kind(choice) -> str:
    if not isinstance(choice, dict):
        return "mode"
    return "allowed" if choice.get("type") == "allowed_tools" else "named"


ToolChoice = Annotated[Annotated[Literal["auto", "none", "required"], Tag("mode")] | Annotated[NamedChoice, Tag("named")]
                       | Annotated[AllowedChoice, Tag("allowed")], Discriminator(_choice_kind)]


class MonolithOptions(Strict):
    spec: Flag | None = None  # how each token came, in the stream (speculation.py)
    draft: Flag | None = None  # draft every round whatever the start measured


class ChatBody(SamplingBody):
    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    max_completion_tokens: Positive | None = None
    logprobs: Flag | None = None
    top_logprobs: TopLogprobs | None = None
    tools: list[ChatTool] | None = None
    tool_choice: ToolChoice | None = None
    parallel_tool_calls: Flag | None = None
    chat_template_kwargs: Object | None = None
    response_format: Object | None = None  # structured.py reads it
    reasoning_effort: Effort | None = None  # Qwen's thinking switch
    monolith: MonolithOptions | None = None  # our extension (speculation.py)


@dataclass(frozen=True)
class CompletionRequest(GenerationFields):
    prompts: tuple[str | list[int], ...]  # one choice each, in order (choice index = position)
    echo: bool = False  # the prompt before the completion, its tokens in logprobs (the first one's null)
    score_only: bool = False  # max_tokens 0: no generation (the prompt's own logprobs with echo)

    @property
    def batched(self) -> bool:
        """Answered by serving/openai/scoring.py (several prompts, echo, or no generation)."""
        return len(self.prompts) > 1 or self.echo or self.score_only


def parse_chat_request(body: dict, defaults: SamplingDefaults = SamplingDefaults()) -> ChatRequest:
    chat = parse(ChatBody, body)
    fields = chat.fields(defaults, _max_tokens(chat), _chat_logprobs(chat))
    tools = chat_tools(chat.tools, body.get("tools"))
    choice = chat.tool_choice
    if isinstance(choice, AllowedChoice):
        tools, choice = _allowed_tools(choice.allowed_tools, tools)
    forced = choice
    if isinstance(choice, NamedChoice):
        name = choice.function.name
        forced = (named(tools, name) or [None])[0]
        if forced is None:
            raise bad(f"tool_choice names function {name!r}, which is not in tools", "tool_choice.function.name")
    thinking = None if chat.reasoning_effort is None else THINKING_BY_EFFORT[chat.reasoning_effort]
    request = chat_request(fields, [_message(m, f"messages[{i}]") for i, m in enumerate(chat.messages)], tools,
                           forced, chat.parallel_tool_calls is False, response_format(chat.response_format),
                           template_kwargs(chat.chat_template_kwargs, thinking))
    options = chat.monolith or MonolithOptions()
    return replace(request, spec=bool(options.spec), draft=bool(options.draft))


def _max_tokens(chat: ChatBody) -> int | None:
    completion, tokens = chat.max_completion_tokens, chat.max_tokens
    if completion is not None and tokens is not None and completion != tokens:
        raise bad("max_tokens and max_completion_tokens disagree; send one", "max_completion_tokens")
    return tokens if completion is None else completion


def _chat_logprobs(chat: ChatBody) -> int | None:
    if chat.top_logprobs is not None and not chat.logprobs:
        raise bad("top_logprobs needs logprobs: true", "top_logprobs")
    return (chat.top_logprobs or 0) if chat.logprobs else None


def _allowed_tools(allowed: AllowedTools, tools: list[dict] | None) -> tuple[list[dict] | None, str]:
    """tool_choice {"type": "allowed_tools", ...} -> (the tools the model is shown: only
    the allowed ones, the tool_choice "auto" or "required")."""
    where = "tool_choice.allowed_tools"
    names = {entry.function.name for entry in allowed.tools}
    shown = [t for t in tools or () if t["function"]["name"] in names]
    missing = sorted(names - {t["function"]["name"] for t in shown})
    if missing:
        raise bad(f"{where}.tools names {', '.join(missing)}, not in tools", f"{where}.tools")
    return shown or None, allowed.mode


def _message(m: ChatMessage, where: str) -> dict:
    """A message as the chat template reads it (developer is rendered as system:
    templates know no developer role; text parts joined, images as items: images.py)."""
    out = {"role": "system" if m.role == "developer" else m.role}
    if m.tool_calls is not None:
        if m.role != "assistant":
            raise bad(f"{where}.tool_calls is only allowed in assistant messages", f"{where}.tool_calls")
        out["tool_calls"] = [_call(call, f"{where}.tool_calls[{i}]") for i, call in enumerate(m.tool_calls)]
    if m.content is None and not (m.role == "assistant" and m.tool_calls):
        raise bad(f"{where}.content is required", f"{where}.content")
    out["content"] = _content(m.content, out["role"], f"{where}.content")
    given = {"name": m.name, "tool_call_id": m.tool_call_id, "reasoning_content": m.reasoning_content}
    return out | {name: value for name, value in given.items() if value is not None}


def _content(content, role: str, where: str) -> str | list[dict]:
    if content is None or isinstance(content, str):
        return content or ""
    return images.message_content([part.text if isinstance(part, TextPart) else
                                   images.chat_image(part, role, f"{where}[{i}]") for i, part in enumerate(content)])


def _call(call: MessageCall, at: str) -> dict:
    arguments = call.function.arguments
    if isinstance(arguments, str):
        arguments = json_arguments(arguments, f"{at}.function.arguments")
    entry = {"type": "function", "function": {"name": call.function.name, "arguments": arguments}}
    if isinstance(call.id, str):
        entry["id"] = call.id
    return entry


# ------------------------------------------------------------------ completions


class CompletionBody(SamplingBody):
    prompt: Text | list[Integer] | list[Text | list[Integer]]
    max_tokens: Annotated[Integer, Field(ge=0)] | None = None  # 0: the prompt scored, nothing generated
    logprobs: TopLogprobs | None = None  # the k most likely tokens
    echo: Flag = False  # the prompt before the completion (and its tokens' logprobs)


def parse_completion_request(body: dict, defaults: SamplingDefaults = SamplingDefaults()) -> CompletionRequest:
    completion = parse(CompletionBody, body)
    score_only = completion.max_tokens == 0
    fields = completion.fields(defaults, None if score_only else completion.max_tokens, completion.logprobs)
    request = CompletionRequest(**vars(fields), prompts=_prompts(completion.prompt), echo=completion.echo,
                                score_only=score_only)
    if request.batched and request.stream:
        raise bad("stream is not supported with echo, max_tokens 0 or several prompts", "stream")
    return request


def _prompts(prompt) -> tuple[str | list[int], ...]:
    """The completion's prompts: a string, a list of token ids, or a list of either (the
    body's type has checked the shapes)."""
    one = isinstance(prompt, str) or (bool(prompt) and all(isinstance(t, int) for t in prompt))
    prompts = [prompt] if one else prompt
    if not prompts:
        raise bad("prompt must be a non-empty string, a non-empty list of token ids, or a list of those", "prompt")
    for i, p in enumerate(prompts):
        if not p:
            raise bad("prompt is empty" if one else f"prompt[{i}] is empty", "prompt")
        if isinstance(p, list) and min(p) < 0:
            raise bad("prompt token ids must be >= 0", "prompt")
    return tuple(prompts)
