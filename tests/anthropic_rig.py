"""What the Anthropic Messages tests share: two client tools (weather, add) with strict
input schemas, an SDK client on a test server, and a template line that opens the think
block as Qwen3.6's generation prompt does with thinking on."""

from __future__ import annotations

import anthropic

TOOLS = [
    {"name": "get_weather", "description": "Weather in a city", "input_schema": {
        "type": "object", "properties": {"city": {"type": "string", "maxLength": 20},
                                         "days": {"type": "integer", "minimum": 1, "maximum": 7}},
        "required": ["city", "days"], "additionalProperties": False}},
    {"name": "add", "description": "Add two numbers", "input_schema": {
        "type": "object", "properties": {"a": {"type": "integer", "minimum": -99, "maximum": 99},
                                         "b": {"type": "integer", "minimum": -99, "maximum": 99}},
        "required": ["a", "b"], "additionalProperties": False}},
]


OPENS_THINKING = "{%- if add_generation_prompt and enable_thinking is defined and enable_thinking %}<think>\n{%- endif %}"


def client(server, **kw) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=server.url, api_key=kw.pop("api_key", "x"), max_retries=0, timeout=60,
                               **kw)
