"""Ollama's request bodies (POST /api/chat, /api/generate, /api/show, /api/pull), typed
as every API's (../fields.py: `Body`, `Strict`, `parse`): a field of the wrong type, or
one Ollama's API does not have, is a 400 naming its path (`messages[0].content`,
`options.temperature`). A JSON null anywhere means "not given", as in Ollama's own server.

The field policy (docs/api-fields.md, "Ollama") is declared on the fields, as every
API's: what changes the result and can be honoured is (`options` mapped onto our
sampling: `num_predict`, `num_ctx`, `temperature`, `top_k`, `top_p`, `min_p`, `seed`,
`stop`); what changes nothing here is accepted (`Options`' inert ones: threads, GPUs,
batch size, memory mapping, and the options that only matter with a penalty that is
off); what would change the result and is not implemented is refused, unless at its
neutral value (the penalties and mirostat in `Options`; `suffix`, `template`, `context`)
or whatever its value (image generation's fields). A chat or generate request becomes
the ChatRequest every API builds (../requests.py's `chat_request`): the model's own chat
template renders it, tools and `format` go through the same grammar (../structured.py)
as OpenAI's `tools` and `response_format`."""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Annotated, Any, Literal

from pydantic import Field

from ..errors import APIError, bad
from ..fields import (
    Body,
    Flag,
    Integer,
    Object,
    Positive,
    Real,
    Strict,
    Text,
    inert,
    neutral,
    parse,
    refused,
)
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

OPTION_FIELDS = {"temperature", "top_p", "top_k", "min_p", "seed", "stop"}  # the shared body's, from `options`
PATH_NAMES = {"max_tokens": "options.num_predict", "response_format": "format", "chat_template_kwargs": "think"}
PENALTIES = "penalties are not implemented"
RUNNER = "Ollama's runner setting"


class Options(Body):
    """Ollama's runner options: honoured (mapped onto our sampling), refused unless at the
    value that means "off" (sampling.py has no penalty, mirostat, tail-free or typical
    sampling), or inert (how Ollama's runner uses the machine, and the settings of a
    penalty that is off). Nested in a body: its refusals name `options.FIELD`."""

    num_predict: Integer | None = None
    num_ctx: Positive | None = None
    temperature: Annotated[Real, Field(ge=0.0)] | None = None
    top_k: Integer | None = None
    top_p: Real | None = None
    min_p: Real | None = None
    seed: Integer | None = None
    stop: list[Text] | Text | None = None
    repeat_penalty: Annotated[Any, neutral(1.0, PENALTIES)] = None
    presence_penalty: Annotated[Any, neutral(0.0, PENALTIES)] = None
    frequency_penalty: Annotated[Any, neutral(0.0, PENALTIES)] = None
    mirostat: Annotated[Any, neutral(0, "mirostat sampling is not implemented")] = None
    tfs_z: Annotated[Any, neutral(1.0, "tail-free sampling is not implemented")] = None
    typical_p: Annotated[Any, neutral(1.0, "typical sampling is not implemented")] = None
    repeat_last_n: Annotated[Integer | None, inert("the window of the repeat penalty, which is off")] = None
    penalize_newline: Annotated[Flag | None, inert("part of the repeat penalty, which is off")] = None
    mirostat_tau: Annotated[Real | None, inert("mirostat's, which is off")] = None
    mirostat_eta: Annotated[Real | None, inert("mirostat's, which is off")] = None
    num_keep: Annotated[Integer | None, inert("this server never shifts a full context")] = None
    num_batch: Annotated[Integer | None, inert("the prefill chunk is the server's")] = None
    num_thread: Annotated[Integer | None, inert("CPU threads of Ollama's runner")] = None
    num_gpu: Annotated[Integer | None, inert("MLX runs every layer on the GPU")] = None
    main_gpu: Annotated[Integer | None, inert("Ollama's GPU choice")] = None
    low_vram: Annotated[Flag | None, inert("Ollama's memory mode")] = None
    numa: Annotated[Flag | None, inert("Ollama's NUMA mode")] = None
    use_mmap: Annotated[Flag | None, inert("how Ollama maps its weights")] = None
    use_mlock: Annotated[Flag | None, inert("how Ollama locks its weights")] = None
    f16_kv: Annotated[Flag | None, inert("Ollama's KV cache type")] = None
    logits_all: Annotated[Flag | None, inert(RUNNER)] = None
    vocab_only: Annotated[Flag | None, inert(RUNNER)] = None
    embedding_only: Annotated[Flag | None, inert(RUNNER)] = None


class CallFunction(Strict):
    name: Text
    arguments: Object = Field(default_factory=dict)
    index: Integer | None = None  # Ollama numbers a reply's calls


class ToolCall(Strict):
    id: Text | None = None
    type: Literal["function"] | None = None
    function: CallFunction


class Message(Strict):
    role: Literal["system", "user", "assistant", "tool"]
    content: Text = ""
    thinking: Text | None = None  # an assistant's reasoning, sent back
    images: list[Text] | None = None  # base64
    tool_calls: list[ToolCall] | None = None
    tool_name: Text | None = None  # a tool result's tool
    tool_call_id: Text | None = None


class Tool(Strict):
    type: Literal["function"] = "function"
    function: Object  # name, description, parameters: checked as OpenAI's (../tools/specs.py)


class Generation(Body):
    """What /api/chat and /api/generate share. `keep_alive` is taken out of the body
    before (handlers.py's `model_for`: models.keep_alive_seconds)."""

    nulls_anywhere_unset = True  # as Ollama's own server (Go's JSON decoder) reads a null

    model: Text | None = None
    stream: Flag = True
    format: Literal["", "json"] | Object | None = None
    options: Options | None = None
    think: Flag | Literal["low", "medium", "high", "max"] | None = None
    logprobs: Flag | None = None
    top_logprobs: Annotated[Integer, Field(ge=0, le=20)] | None = None


class ChatBody(Generation):
    messages: list[Message] = Field(default_factory=list)  # none: Ollama's "load the model" request
    tools: list[Tool] | None = None


IMAGE_GENERATION = "image generation is not supported"


class GenerateBody(Generation):
    prompt: Text = ""
    system: Text | None = None
    images: list[Text] | None = None
    raw: Flag = False
    suffix: Annotated[Any, neutral("", "no fill-in-the-middle",
                                   "suffix is not supported: there is no fill-in-the-middle")] = None
    template: Annotated[Any, neutral("", "the checkpoint's own chat template renders the prompt",
                                     "template is not supported: the checkpoint's own chat template renders "
                                     "the prompt")] = None
    context: Annotated[Any, neutral([], "deprecated by Ollama, and never returned here",
                                    "context is not supported (deprecated by Ollama): send the conversation to "
                                    "/api/chat")] = None
    width: Annotated[Any, refused(IMAGE_GENERATION)] = None
    height: Annotated[Any, refused(IMAGE_GENERATION)] = None
    steps: Annotated[Any, refused(IMAGE_GENERATION)] = None


class NamedBody(Body):
    """/api/show and /api/pull: a model's name."""

    nulls_anywhere_unset = True

    model: Text | None = None
    name: Text | None = None  # the name's older spelling
    verbose: Annotated[Flag | None, inert("/api/show leaves nothing out without it")] = None
    stream: Flag = True  # /api/pull
    insecure: Annotated[Flag | None, inert("/api/pull reaches no registry")] = None

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


def parse_chat(body: dict, defaults: SamplingDefaults) -> OllamaRequest:
    req = parse(ChatBody, body)
    if not req.messages:  # Ollama's "load the model" request
        return OllamaRequest(None, req.stream, None, None)
    messages = [_message(m, f"messages[{i}]") for i, m in enumerate(req.messages)]
    tools = [tool.model_dump(exclude_none=True) for tool in req.tools or ()] or None
    return _request(req, messages, tools, defaults)


def parse_generate(body: dict, defaults: SamplingDefaults) -> OllamaRequest:
    req = parse(GenerateBody, body)
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
