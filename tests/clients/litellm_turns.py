"""Two turns through LiteLLM's completion() (argv: PROVIDER BASE_URL KEY MODEL FILE, PROVIDER
openai or anthropic): a plain one, then one with a tool loop whose tool reads a file; prints
the replies as JSON."""

import json
import sys
from pathlib import Path

import litellm

provider, base_url, key, model_name, note = sys.argv[1:6]
TOOLS = [{"type": "function", "function": {
    "name": "read_note", "description": "Read the note called `name` and return its text.",
    "parameters": {"type": "object", "properties": {"name": {"type": "string"}}, "required": ["name"]}}}]


def ask(messages, **kw):
    response = litellm.completion(model=f"{provider}/{model_name}", api_base=base_url, api_key=key,
                                  messages=messages, max_tokens=64, **kw)
    return response.choices[0].message


def main():
    messages = [{"role": "user", "content": "Say hello."}]
    first = ask(messages)
    messages += [{"role": "assistant", "content": first.content},
                 {"role": "user", "content": "Read the secret note with read_note and tell me what it says."}]
    call = ask(messages, tools=TOOLS).tool_calls[0]
    messages += [{"role": "assistant", "content": None, "tool_calls": [
        {"id": call.id, "type": "function",
         "function": {"name": call.function.name, "arguments": call.function.arguments}}]},
                 {"role": "tool", "tool_call_id": call.id, "content": Path(note).read_text()}]
    answer = ask(messages, tools=TOOLS)
    print(json.dumps({"replies": [first.content, answer.content], "tool": call.function.name}))


main()
