"""The sample each row of docs/api-fields.md is sent with (tests/test_api_fields.py): a
minimal valid body per API (CHAT, COMPLETION, MESSAGES, RESPONSES) and, per API and row,
what the row's field adds to it (SAMPLES; a callable takes the openai client)."""

from __future__ import annotations

import base64
import io

from PIL import Image
from serving_rig import NAME

CHAT = {"model": NAME, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
COMPLETION = {"model": NAME, "prompt": "hi", "max_tokens": 2}
MESSAGES = {"model": NAME, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
RESPONSES = {"model": NAME, "input": "hi", "max_output_tokens": 2}
FUNCTION = {"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {}}}}
CLAUDE_TOOL = {"name": "f", "input_schema": {"type": "object", "properties": {}}}
FLAT_TOOL = {"type": "function", "name": "f", "parameters": {"type": "object", "properties": {}}}


def chat_content(*parts):
    return {"messages": [{"role": "user", "content": list(parts)}]}


def chat_history(**assistant):
    return {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yes", **assistant},
                         {"role": "user", "content": "and?"}]}


def claude_blocks(*blocks, role="user"):
    """`blocks` as a user turn, or as an assistant turn between two user turns."""
    if role == "user":
        return {"messages": [{"role": "user", "content": list(blocks)}]}
    return {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": list(blocks)},
                         {"role": "user", "content": "and?"}]}


TOOL_USE = {"type": "tool_use", "id": "toolu_1", "name": "f", "input": {}}


def tool_round(result: dict) -> dict:
    return {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": [TOOL_USE]},
                         {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1", **result}]}],
            "tools": [CLAUDE_TOOL]}


TEXT = {"type": "text", "text": "hi"}


def _png() -> str:
    out = io.BytesIO()
    Image.new("RGB", (16, 16), (90, 160, 30)).save(out, format="PNG")
    return base64.b64encode(out.getvalue()).decode()


PNG = _png()  # base64 of a small PNG: the image rows' image
SAMPLES = {
    "chat": {
        "model": {"model": NAME},
        "keep_alive": {"keep_alive": -1},
        "messages": {},
        "messages[].role": {"messages": [{"role": "developer", "content": "be brief"},
                                         {"role": "user", "content": "hi"}]},
        "messages[].role: function": {"messages": [{"role": "function", "name": "f", "content": "1"},
                                                   {"role": "user", "content": "hi"}]},
        "messages[].name": {"messages": [{"role": "user", "content": "hi", "name": "ann"}]},
        "messages[].content[].text": chat_content(TEXT),
        "messages[].content[].prompt_cache_breakpoint": chat_content({**TEXT, "prompt_cache_breakpoint":
                                                                     {"mode": "explicit"}}),
        "messages[].content[].image_url": chat_content({"type": "image_url",
                                                        "image_url": {"url": "data:image/png;base64," + PNG}}),
        "messages[].content[].input_audio": chat_content({"type": "input_audio",
                                                          "input_audio": {"data": "AAAA", "format": "wav"}}),
        "messages[].content[].file": chat_content({"type": "file", "file": {"file_id": "file-1"}}),
        "messages[].content[].refusal": chat_history(content=[{"type": "refusal", "refusal": "no"}]),
        "messages[].tool_calls": chat_history(tool_calls=[{"id": "call_1", "type": "function",
                                                           "function": {"name": "f", "arguments": "{}"}}]),
        "messages[].tool_call_id": {"messages": [
            {"role": "user", "content": "hi"},
            {"role": "assistant", "content": None, "tool_calls": [{"id": "call_1", "type": "function",
                                                                   "function": {"name": "f", "arguments": "{}"}}]},
            {"role": "tool", "tool_call_id": "call_1", "content": "1"}]},
        "messages[].reasoning_content": chat_history(reasoning_content="thought"),
        "messages[].refusal": chat_history(refusal="no"),
        "messages[].audio": chat_history(audio={"id": "audio_1"}),
        "messages[].function_call": chat_history(function_call={"name": "f", "arguments": "{}"}),
        "frequency_penalty": {"frequency_penalty": 0.5},
        "presence_penalty": {"presence_penalty": 0.5},
        "logit_bias": {"logit_bias": {"5": 10}},
        "logprobs": {"logprobs": True},
        "top_logprobs": {"logprobs": True, "top_logprobs": 2},
        "max_completion_tokens": {"max_tokens": None, "max_completion_tokens": 2},
        "max_tokens": {"max_tokens": 2},
        "metadata": {"metadata": {"session": "s1"}},
        "modalities": {"modalities": ["text", "audio"]},
        "audio": {"audio": {"voice": "alloy", "format": "wav"}},
        "moderation": {"moderation": {"model": "omni-moderation-latest"}},
        "n": {"n": 2},
        "parallel_tool_calls": {"tools": [FUNCTION], "parallel_tool_calls": False},
        "prediction": {"prediction": {"type": "content", "content": "hello"}},
        "prompt_cache_key": {"prompt_cache_key": "conversation-1"},
        "prompt_cache_options": {"prompt_cache_options": {"mode": "implicit", "ttl": "30m"}},
        "prompt_cache_retention": {"prompt_cache_retention": "24h"},
        "reasoning_effort": {"reasoning_effort": "low"},
        "response_format": {"response_format": {"type": "json_object"}},
        "safety_identifier": {"safety_identifier": "user-hash"},
        "seed": {"seed": 7},
        "service_tier": {"service_tier": "flex"},
        "stop": {"stop": ["\n\n"]},
        "store": {"store": True},
        "stream": {"stream": True},
        "stream_options": {"stream_options": {"include_usage": True}},
        "stream_options.include_usage": {"stream": True, "stream_options": {"include_usage": True}},
        "stream_options.include_obfuscation": {"stream": True, "stream_options": {"include_obfuscation": False}},
        "temperature": {"temperature": 0.7},
        "tool_choice": {"tools": [FUNCTION], "tool_choice": "none"},
        "tool_choice.type: allowed_tools": {"tools": [FUNCTION], "tool_choice": {
            "type": "allowed_tools", "allowed_tools": {"mode": "auto", "tools": [
                {"type": "function", "function": {"name": "f"}}]}}},
        "tool_choice.type: custom": {"tools": [FUNCTION], "tool_choice": {"type": "custom", "custom": {"name": "f"}}},
        "tools": {"tools": [FUNCTION]},
        "tools[].function": {"tools": [{"type": "function", "function": {**FUNCTION["function"], "description": "F"}}]},
        "tools[].function.strict": {"tools": [{"type": "function", "function": {**FUNCTION["function"],
                                                                                "strict": True}}]},
        "tools[].type: custom": {"tools": [{"type": "custom", "custom": {"name": "patch"}}]},
        "top_p": {"top_p": 0.9},
        "user": {"user": "user-1"},
        "verbosity": {"verbosity": "low"},
        "best_of": {"best_of": 2},
        "echo": {"echo": True},
        "suffix": {"suffix": "x"},
        "web_search_options": {"web_search_options": {"search_context_size": "low"}},
        "functions": {"functions": [FUNCTION["function"]]},
        "function_call": {"function_call": "auto"},
        "top_k": {"top_k": 20},
        "min_p": {"min_p": 0.05},
        "repetition_penalty": {"repetition_penalty": 1.1},
        "chat_template_kwargs": {"chat_template_kwargs": {"enable_thinking": False}},
        "monolith": {"monolith": {"spec": True}, "stream": True},
    },
    "completions": {
        "model": {"model": NAME},
        "keep_alive": {"keep_alive": -1},
        "prompt": {"prompt": [1, 2, 3]},
        "best_of": {"best_of": 2},
        "echo": {"echo": True},
        "frequency_penalty": {"frequency_penalty": 0.5},
        "presence_penalty": {"presence_penalty": 0.5},
        "logit_bias": {"logit_bias": {"5": 10}},
        "logprobs": {"logprobs": 2},
        "max_tokens": {"max_tokens": 1},
        "n": {"n": 2},
        "seed": {"seed": 7},
        "stop": {"stop": "\n"},
        "stream": {"stream": True},
        "stream_options": {"stream": True, "stream_options": {"include_usage": True}},
        "suffix": {"suffix": "end"},
        "temperature": {"temperature": 0.7},
        "top_p": {"top_p": 0.9},
        "user": {"user": "user-1"},
        "top_k": {"top_k": 20},
        "min_p": {"min_p": 0.05},
        "repetition_penalty": {"repetition_penalty": 1.1},
    },
    "messages": {
        "model": {"model": NAME},
        "keep_alive": {"keep_alive": -1},
        "messages": {},
        "messages[].content[].type: text": claude_blocks(TEXT),
        "messages[].content[].type: thinking": claude_blocks({"type": "thinking", "thinking": "t",
                                                               "signature": "s"}, TEXT, role="assistant"),
        "messages[].content[].type: tool_use": tool_round({"content": "1"}),
        "messages[].content[].type: tool_result": tool_round({"content": [TEXT], "is_error": True}),
        "messages[].content[].cache_control": claude_blocks({**TEXT, "cache_control": {"type": "ephemeral"}}),
        "messages[].content[].type: redacted_thinking": claude_blocks({"type": "redacted_thinking", "data": "x"},
                                                                       TEXT, role="assistant"),
        "messages[].content[].type: image": claude_blocks({"type": "image", "source": {
            "type": "base64", "media_type": "image/png", "data": PNG}}),
        "messages[].content[].type: document": claude_blocks({"type": "document", "source": {
            "type": "text", "media_type": "text/plain", "data": "doc"}}),
        "messages[].content[].type: search_result": claude_blocks({"type": "search_result", "source": "s",
                                                                   "title": "t", "content": [TEXT]}),
        "messages[].content[].type: server_tool_use": claude_blocks({"type": "server_tool_use", "id": "srvtoolu_1",
                                                                     "name": "web_search", "input": {}}, TEXT,
                                                                    role="assistant"),
        "messages: assistant last": {"messages": [{"role": "user", "content": "hi"},
                                                  {"role": "assistant", "content": "The answer is"}]},
        "max_tokens": {"max_tokens": 1},
        "system": {"system": [{**TEXT, "cache_control": {"type": "ephemeral"}}]},
        "stop_sequences": {"stop_sequences": ["\n\n"]},
        "stream": {"stream": True},
        "temperature": {"temperature": 0.5},
        "top_p": {"top_p": 0.9},
        "top_k": {"top_k": 20},
        "tools": {"tools": [CLAUDE_TOOL]},
        "tools[].input_schema": {"tools": [{**CLAUDE_TOOL, "description": "F"}]},
        "tools[].cache_control": {"tools": [{**CLAUDE_TOOL, "cache_control": {"type": "ephemeral"}}]},
        "tools[].eager_input_streaming": {"tools": [{**CLAUDE_TOOL, "eager_input_streaming": True}]},
        "tools[].strict": {"tools": [{**CLAUDE_TOOL, "strict": True}]},
        "tools[].defer_loading": {"tools": [{**CLAUDE_TOOL, "defer_loading": True}]},
        "tools[].allowed_callers": {"tools": [{**CLAUDE_TOOL, "allowed_callers": ["code_execution_20250825"]}]},
        "tools[].input_examples": {"tools": [{**CLAUDE_TOOL, "input_examples": [{}]}]},
        "tools[].type: bash_20250124": {"tools": [{"type": "bash_20250124", "name": "bash"}]},
        "tool_choice": {"tools": [CLAUDE_TOOL], "tool_choice": {"type": "none"}},
        "tool_choice.disable_parallel_tool_use": {"tools": [CLAUDE_TOOL], "tool_choice": {
            "type": "any", "disable_parallel_tool_use": True}},
        "thinking": {"thinking": {"type": "adaptive"}},
        "thinking.type: between_tools": {"thinking": {"type": "between_tools"}},
        "thinking.display": {"thinking": {"type": "enabled", "budget_tokens": 1024, "display": "omitted"}},
        "output_config": {"output_config": {}},
        "output_config.effort": {"output_config": {"effort": "low"}},
        "output_config.format": {"output_config": {"format": {"type": "json_schema", "schema": {"type": "object"}}}},
        "context_management": {"context_management": {"edits": []}},
        "context_management.edits[].type: clear_tool_uses_20250919": {"context_management": {"edits": [{
            "type": "clear_tool_uses_20250919", "trigger": {"type": "input_tokens", "value": 100000},
            "keep": {"type": "tool_uses", "value": 3}, "clear_at_least": {"type": "input_tokens", "value": 1000},
            "exclude_tools": ["f"], "clear_tool_inputs": False}]}},
        "context_management.edits[].type: clear_thinking_20251015": {"context_management": {"edits": [{
            "type": "clear_thinking_20251015", "keep": {"type": "thinking_turns", "value": 1}}]}},
        "context_management.edits[].type: compact_20260112": {"context_management": {"edits": [
            {"type": "compact_20260112"}]}},
        "context_management.edits[].type: unknown": {"context_management": {"edits": [{"type": "shred_20990101"}]}},
        "cache_control": {"cache_control": {"type": "ephemeral", "ttl": "1h"}},
        "metadata": {"metadata": {"user_id": "u1"}},
        "service_tier": {"service_tier": "standard_only"},
        "speed": {"speed": "fast"},
        "inference_geo": {"inference_geo": "us"},
        "diagnostics": {"diagnostics": {"previous_message_id": "msg_1"}},
        "user_profile_id": {"user_profile_id": "up_1"},
        "workspace_id": {"workspace_id": "wrkspc_1"},
        "container": {"container": "container_1"},
        "mcp_servers": {"mcp_servers": [{"type": "url", "url": "https://example.com/mcp", "name": "m"}]},
        "billing_policy": {"billing_policy": {"type": "billing_policy", "bill_to": "self"}},
        "fallbacks": {"fallbacks": "default"},
        "fallback_credit_token": {"fallback_credit_token": "token"},
        "compaction": {"compaction": {}},
        "thread": {"thread": {"type": "create"}},
        "betas": {"betas": ["context-management-2025-06-27"]},
    },
    "responses": {
        "model": {"model": NAME},
        "keep_alive": {"keep_alive": -1},
        "input": {"input": [{"role": "user", "content": [{"type": "input_text", "text": "hi"}]}]},
        "input[].type: reasoning": {"input": [{"role": "user", "content": "hi"}, {
            "type": "reasoning", "summary": [], "content": [{"type": "reasoning_text", "text": "t"}]},
            {"role": "assistant", "content": "yes"}, {"role": "user", "content": "and?"}]},
        "input[].phase": {"input": [{"role": "user", "content": "Hi"}, {
            "type": "message", "role": "assistant", "phase": "final_answer", "content": "Hello."},
            {"role": "user", "content": "Again"}]},
        "input[].content[].type: input_image": {"input": [{"role": "user", "content": [
            {"type": "input_image", "image_url": "data:image/png;base64," + PNG}]}]},
        "input[].type: item_reference": {"input": [{"type": "item_reference", "id": "msg_1"}]},
        "instructions": {"instructions": "be brief"},
        "max_output_tokens": {"max_output_tokens": 1},
        "temperature": {"temperature": 0.7},
        "top_p": {"top_p": 0.9},
        "stream": {"stream": True},
        "store": {"store": False},
        "previous_response_id": lambda client: {"previous_response_id": client.responses.create(**RESPONSES).id},
        "metadata": {"metadata": {"session": "s1"}},
        "parallel_tool_calls": {"tools": [FLAT_TOOL], "parallel_tool_calls": False},
        "reasoning": {"reasoning": {}},
        "reasoning.effort": {"reasoning": {"effort": "low"}},
        "reasoning.summary": {"reasoning": {"summary": "auto"}},
        "text": {"text": {}},
        "text.format": {"text": {"format": {"type": "json_object"}}},
        "text.verbosity": {"text": {"verbosity": "low"}},
        "tool_choice": {"tools": [FLAT_TOOL], "tool_choice": "none"},
        "tools": {"tools": [{**FLAT_TOOL, "strict": True}]},
        "tools[].type: custom": {"tools": [{"type": "custom", "name": "apply_patch"}]},
        "tools[].type: web_search": {"tools": [{"type": "web_search"}]},
        "user": {"user": "user-1"},
        "safety_identifier": {"safety_identifier": "user-hash"},
        "prompt_cache_key": {"prompt_cache_key": "conversation-1"},
        "service_tier": {"service_tier": "auto"},
        "include": {"include": ["reasoning.encrypted_content"]},
        "client_metadata": {"client_metadata": {"session_id": "s-1", "turn_id": "t-1"}},
        "prompt_cache_retention": {"prompt_cache_retention": "24h"},
        "prompt_cache_options": {"prompt_cache_options": {"mode": "implicit"}},
        "stream_options": {"stream": True, "stream_options": {"include_obfuscation": False}},
        "truncation": {"truncation": "auto"},
        "background": {"background": True},
        "background_options": {"background_options": {}},
        "top_logprobs": {"top_logprobs": 2},
        "presence_penalty": {"presence_penalty": 0.5},
        "frequency_penalty": {"frequency_penalty": 0.5},
        "max_tool_calls": {"max_tool_calls": 2},
        "conversation": {"conversation": "conv_1"},
        "prompt": {"prompt": {"id": "pmpt_1"}},
        "context_management": {"context_management": [{"type": "compaction", "compact_threshold": 1000}]},
        "moderation": {"moderation": {"model": "omni-moderation-latest"}},
        "image": {"image": {}},
        "access_programs": {"access_programs": ["program"]},
    },
}
