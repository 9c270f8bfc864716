"""Ollama's request bodies (POST /api/chat, /api/generate, /api/show, /api/pull), typed
with pydantic: a field of the wrong type, or one Ollama's API does not have, is a 400
naming its path (`messages[0].content`, `options.temperature`). A JSON null means "not
given", as in Ollama's own server.

The field policy (docs/api-fields.md, "Ollama"): what changes the result and can be
honoured is (`options` mapped onto our sampling: `num_predict`, `num_ctx`,
`temperature`, `top_k`, `top_p`, `min_p`, `seed`, `stop`); what changes nothing here is
accepted (`Options`' inert ones: threads, GPUs, batch size, memory mapping, and the
options that only matter with a penalty that is off); what would change the result and is not
implemented is refused, unless at its neutral value (`NEUTRAL_OPTIONS`, the penalties
and mirostat; `suffix`, `template`, `context`, image generation's fields). A chat or
generate request becomes the ChatRequest every API builds (../requests.py's
`chat_request`): the model's own chat template renders it, tools
and `format` go through the same grammar (../structured.py) as OpenAI's `tools` and
`response_format`."""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from ..errors import APIError, bad
from ..images import image_item, message_content
from ..requests import (
    ChatRequest,
    GenerationFields,
    SamplingDefaults,
    chat_request,
    sampling,
    stop_strings,
    template_kwargs,
)
from ..structured import response_format
from ..tools.specs import check_parameters

# accepted only at the value that means "off": no penalty, no mirostat, no tail-free or
# typical sampling (sampling.py has none of them)
NEUTRAL_OPTIONS = {"repeat_penalty": 1.0, "presence_penalty": 0.0, "frequency_penalty": 0.0, "mirostat": 0,
                   "tfs_z": 1.0, "typical_p": 1.0}
OPTION_FIELDS = {"temperature", "top_p", "top_k", "min_p", "seed", "stop"}  # the shared body's, from `options`
TYPE_TAGS = {"str", "bool", "int", "float"}  # a union member's tag in pydantic's error locations
PATH_NAMES = {"max_tokens": "options.num_predict", "response_format": "format", "chat_template_kwargs": "think"}


class Body(BaseModel):
    """A request object: no field Ollama's API lacks, no type coercion (a string is not
    a number)."""

    model_config = ConfigDict(extra="forbid", strict=True)


class Options(Body):
    """Ollama's runner options: honoured, neutral only (NEUTRAL_OPTIONS), or inert."""

    # honoured
    num_predict: int | None = None
    num_ctx: Annotated[int, Field(ge=1)] | None = None
    temperature: Annotated[float, Field(ge=0)] | None = None
    top_k: int | None = None
    top_p: float | None = None
    min_p: float | None = None
    seed: int | None = None
    stop: list[str] | str | None = None
    # neutral only
    repeat_penalty: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    mirostat: int | None = None
    tfs_z: float | None = None
    typical_p: float | None = None
    # inert
    numa: bool | None = None
    num_batch: int | None = None
    num_gpu: int | None = None
    main_gpu: int | None = None
    low_vram: bool | None = None
    f16_kv: bool | None = None
    logits_all: bool | None = None
    vocab_only: bool | None = None
    use_mmap: bool | None = None
    use_mlock: bool | None = None
    embedding_only: bool | None = None
    num_thread: int | None = None
    num_keep: int | None = None
    repeat_last_n: int | None = None
    penalize_newline: bool | None = None
    mirostat_tau: float | None = None
    mirostat_eta: float | None = None


class CallFunction(Body):
    name: str
    arguments: dict[str, Any] = {}
    index: int | None = None  # Ollama numbers a reply's calls


class ToolCall(Body):
    id: str | None = None
    type: Literal["function"] | None = None
    function: CallFunction


class Message(Body):
    role: Literal["system", "user", "assistant", "tool"]
    content: str = ""
    thinking: str | None = None  # an assistant's reasoning, sent back
    images: list[str] | None = None  # base64
    tool_calls: list[ToolCall] | None = None
    tool_name: str | None = None  # a tool result's tool
    tool_call_id: str | None = None


class Tool(Body):
    type: Literal["function"] = "function"
    function: dict[str, Any]  # name, description, parameters: checked as OpenAI's (../tools/specs.py)


class Generation(Body):
    """What /api/chat and /api/generate share. `keep_alive` is taken out of the body
    before (handlers.py's `model_for`: models.keep_alive_seconds)."""

    model: str | None = None
    stream: bool = True
    format: Literal["", "json"] | dict[str, Any] | None = None
    options: Options | None = None
    think: bool | Literal["low", "medium", "high", "max"] | None = None
    logprobs: bool | None = None
    top_logprobs: Annotated[int, Field(ge=0, le=20)] | None = None


class ChatBody(Generation):
    messages: list[Message] = []
    tools: list[Tool] | None = None


class GenerateBody(Generation):
    prompt: str = ""
    system: str | None = None
    images: list[str] | None = None
    raw: bool = False
    suffix: str | None = None  # refused unless empty: no fill-in-the-middle
    template: str | None = None  # refused unless empty: the model's own template renders
    context: list[int] | None = None  # refused unless empty: deprecated, and never returned here
    width: int | None = None  # image generation: refused
    height: int | None = None
    steps: int | None = None


class NamedBody(Body):
    """/api/show and /api/pull: a model's name."""

    model: str | None = None
    name: str | None = None  # the name's older spelling
    verbose: bool | None = None  # /api/show: nothing is left out without it
    stream: bool = True  # /api/pull
    insecure: bool | None = None  # /api/pull: no registry is reached

    @property
    def model_name(self) -> str:
        name = self.model or self.name
        if not name:
            raise bad("model is required", "model")
        return name


@dataclass(frozen=True)
class OllamaRequest:
    """A chat or generate request for the engine: the shared ChatRequest (`chat`: None for
    a request with no prompt, Ollama's load or unload), and what only Ollama has."""

    chat: ChatRequest | None
    stream: bool
    num_ctx: int | None
    num_predict: int | None  # -1 / -2: up to the context
    raw_prompt: str | None = None  # /api/generate with raw: the prompt, not rendered


def parse(kind: type[Body], body: dict) -> Body:
    """`body` as `kind`, nulls dropped, or a 400 naming the first wrong field's path."""
    try:
        return kind.model_validate(_without_nulls(body))
    except ValidationError as e:
        errors = e.errors()
        where = _path(errors[0]["loc"])
        if errors[0]["type"] == "extra_forbidden":
            raise bad(f"{where}: unsupported field (fields that would change the result are refused, not ignored)",
                      where) from None
        # a union's members each say what they want: all of them, for the same field
        wants = list(dict.fromkeys(error["msg"] for error in errors if _path(error["loc"]) == where))
        raise bad(f"{where}: {'; or '.join(wants)}", where) from None


def _without_nulls(value):
    if isinstance(value, dict):
        return {k: _without_nulls(v) for k, v in value.items() if v is not None}
    if isinstance(value, list):
        return [_without_nulls(v) for v in value]
    return value


def _path(loc) -> str:
    """An error's place as the 400 names it (`messages[0].content`): pydantic's location
    without the union members' tags (`str`, `list[str]`, `literal['', 'json']`, ...)."""
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        elif part.isidentifier() and part not in TYPE_TAGS:
            out += f".{part}" if out else part
    return out or "body"


def parse_chat(body: dict, defaults: SamplingDefaults) -> OllamaRequest:
    req = parse(ChatBody, body)
    if not req.messages:  # Ollama's "load the model" request
        return OllamaRequest(None, req.stream, None, None)
    messages = [_message(m, f"messages[{i}]") for i, m in enumerate(req.messages)]
    tools = [tool.model_dump(exclude_none=True) for tool in req.tools or ()] or None
    return _request(req, messages, tools, defaults)


def parse_generate(body: dict, defaults: SamplingDefaults) -> OllamaRequest:
    req = parse(GenerateBody, body)
    if req.suffix:
        raise bad("suffix is not supported: there is no fill-in-the-middle", "suffix")
    if req.template:
        raise bad("template is not supported: the checkpoint's own chat template renders the prompt", "template")
    if req.context:
        raise bad("context is not supported (deprecated by Ollama): send the conversation to /api/chat", "context")
    for name in ("width", "height", "steps"):
        if getattr(req, name) is not None:
            raise bad(f"{name}: image generation is not supported", name)
    if not req.prompt and not req.images:  # Ollama's "load the model" request
        return OllamaRequest(None, req.stream, None, None)
    if req.raw:
        if req.images or req.system:
            raise bad("raw prompts take no images or system (nothing is rendered around them)",
                      "images" if req.images else "system")
        parsed = _request(req, [{"role": "user", "content": req.prompt}], None, defaults)
        return replace(parsed, raw_prompt=req.prompt)
    messages = [{"role": "system", "content": req.system}] if req.system else []
    user = Message(role="user", content=req.prompt, images=req.images)
    return _request(req, messages + [_message(user, "prompt", "images")], None, defaults)


def _request(req: Generation, messages: list[dict], tools, defaults: SamplingDefaults) -> OllamaRequest:
    """The shared ChatRequest of `req` (../requests.py's pieces, as every API builds it);
    errors of the shared pieces name Ollama's fields."""
    options = req.options or Options()
    _check_options(options)
    num_predict = options.num_predict
    if num_predict is not None and (num_predict == 0 or num_predict < -2):
        raise bad(f"options.num_predict must be >= 1, or -1 / -2 (up to the context), got {num_predict}",
                  "options.num_predict")
    if req.top_logprobs is not None and not req.logprobs:
        raise bad("top_logprobs needs logprobs: true", "top_logprobs")
    for i, tool in enumerate(tools or ()):
        check_parameters(tool["function"].get("parameters") or {}, f"tools[{i}].function.parameters")
    try:
        seed = None if options.seed is None or options.seed < 0 else options.seed
        params = sampling(defaults, options.temperature, options.top_p, options.top_k, options.min_p, seed)
        fields = GenerationFields(req.model, req.stream, False, None, params, stop_strings(options.stop or None),
                                  (req.top_logprobs or 0) if req.logprobs else None)
        thinking = None if req.think is None else req.think is not False
        chat = chat_request(fields, messages, tools, form=response_format(_response_format(req.format)),
                            kwargs=template_kwargs(None, thinking, "think"), form_param="format")
    except APIError as e:
        raise renamed(e) from None
    return OllamaRequest(chat, req.stream, options.num_ctx, num_predict)


def _response_format(form) -> dict | None:
    """Ollama's `format` as the response_format of the same output ("json": any JSON
    object; a schema: that schema)."""
    if form == "json":
        return {"type": "json_object"}
    if isinstance(form, dict):
        return {"type": "json_schema", "json_schema": {"name": "format", "schema": form}}
    return None


def _check_options(options: Options) -> None:
    for name, neutral in NEUTRAL_OPTIONS.items():
        value = getattr(options, name)
        if value is not None and value != neutral:
            raise bad(f"options.{name} is not supported (only {neutral:g}, which means off), got {value:g}",
                      f"options.{name}")


def renamed(e: APIError) -> APIError:
    """An error of the shared parser or grammar (OpenAI's field names), naming the Ollama
    field it came from (`e` itself when the names agree)."""
    param = e.param or ""
    head = param.split(".")[0].split("[")[0]
    name = f"options.{param}" if head in OPTION_FIELDS else PATH_NAMES.get(head, param)
    if name == param:
        return e
    message = e.message.replace(param, name, 1)
    if name not in message:
        message = f"{name}: {message}"
    return APIError(e.status, message, name, e.code)


def _message(m: Message, where: str, images_at: str | None = None) -> dict:
    """An Ollama message as the shared parser's: images as image parts after the text,
    tool_name as a tool result's name, thinking as reasoning_content."""
    out: dict = {"role": m.role}
    if m.images:
        at = images_at or f"{where}.images"
        parts = [image_item(f"data:image/*;base64,{data}", f"{at}[{j}]") for j, data in enumerate(m.images)]
        out["content"] = message_content(parts + ([m.content] if m.content else []))
    else:
        out["content"] = m.content
    if m.tool_calls:
        out["tool_calls"] = [{"type": "function", "function": {"name": c.function.name,
                                                               "arguments": c.function.arguments},
                              **({"id": c.id} if c.id else {})} for c in m.tool_calls]
    if m.thinking:
        out["reasoning_content"] = m.thinking
    if m.tool_name:
        out["name"] = m.tool_name
    if m.tool_call_id:
        out["tool_call_id"] = m.tool_call_id
    return out
