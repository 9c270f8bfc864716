"""Two turns of the OpenAI Agents SDK against an OpenAI-compatible base URL: a plain one,
then one whose tool reads a file (argv: BASE_URL KEY MODEL FILE); prints the replies as JSON."""

import asyncio
import json
import sys
from pathlib import Path

from agents import Agent, OpenAIChatCompletionsModel, Runner, function_tool, set_tracing_disabled
from openai import AsyncOpenAI

base_url, key, model_name, note = sys.argv[1:5]


@function_tool
def read_note(name: str) -> str:
    """Read the note called `name` and return its text."""
    return Path(note).read_text()


async def main():
    set_tracing_disabled(True)
    model = OpenAIChatCompletionsModel(model=model_name, openai_client=AsyncOpenAI(base_url=base_url, api_key=key))
    agent = Agent(name="assistant", instructions="You are a helpful assistant.", model=model, tools=[read_note])
    first = await Runner.run(agent, "Say hello.", max_turns=4)
    second = await Runner.run(agent, first.to_input_list() + [
        {"role": "user", "content": "Read the secret note with read_note and tell me what it says."}], max_turns=4)
    print(json.dumps({"replies": [first.final_output, second.final_output]}))


asyncio.run(main())
