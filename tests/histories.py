"""Agent-style request histories for the warm-against-cold harness (test_warm_cold.py,
bench/archive/warm_cold.py): what coding agents resend every turn, which is rarely the bytes
the server generated.

A `Case` is a short script of requests. Each request is an `Ask`: chat messages (and
tools) to render with the model's chat template, or raw prompt ids. The harness sends a
case's asks in order to one long-lived server and hands each reply back
(`Case.play(ask)`), so later asks build on what the server really answered. The kinds:

- edited: a reply resent edited at its start, in the middle or at its end;
- tools: a tool call resent re-rendered (other key order, other whitespace, the
  arguments as a JSON string and as an object), with its result;
- reasoning: a reply resent with a reasoning block, then with it dropped;
- shared: two conversations with the same opening, their turns interleaved;
- again: a prompt sent before, sent again after other requests;
- cut: a conversation's prompt stopped inside a message, at a random token (inside a
  save interval as often as not), sent as raw ids.

Everything is drawn from one `random.Random`, so a seed names a fixed sample.
"""

from __future__ import annotations

import json
import random
from collections.abc import Callable
from dataclasses import dataclass

SYSTEMS = ["You are a coding agent. Work in small steps and explain each change.",
           "You are a careful Python reviewer. Answer with short code.",
           "You help with shell commands on Linux and macOS. Be brief."]
ASKS = ["What does os.path.join do?", "Write a function that reverses a list in place.",
        "How do I read a file line by line?", "Explain what a context manager is.",
        "Fix the bug: for i in range(len(xs)): xs.remove(xs[i])", "What is the difference between a list and a tuple?",
        "Write a shell loop that renames every .txt file to .md.", "How do I sort a dict by its values?"]
FOLLOW_UPS = ["Now add type hints.", "And what does os.path.split do?", "Make it shorter.", "Add a test for it.",
              "Why is that faster?", "Rewrite it without a loop."]
EDITS = ["Well: ", "Sure. ", "Note: this was edited. "]
TOOLS = [{"type": "function", "function": {
    "name": "read_file", "description": "Read a file of the workspace",
    "parameters": {"type": "object", "properties": {"path": {"type": "string"}, "limit": {"type": "integer"}},
                   "required": ["path"]}}},
    {"type": "function", "function": {
        "name": "run", "description": "Run a shell command",
        "parameters": {"type": "object", "properties": {"command": {"type": "string"}}, "required": ["command"]}}}]
CALLS = [("read_file", {"path": "src/app.py", "limit": 40}), ("run", {"command": "pytest -q tests/test_app.py"}),
         ("read_file", {"path": "README.md"})]
RESULTS = ["def main():\n    return 0\n", "3 passed in 0.12s", "# app\n\nA small app.\n"]


@dataclass
class Ask:
    """One request: `messages` (+ `tools`) to render, or raw `prompt` ids."""

    kind: str
    messages: list[dict] | None = None
    tools: list[dict] | None = None
    prompt: list[int] | None = None


Play = Callable[[Ask], str]  # sends an ask to the server under test, returns the reply text


@dataclass
class Case:
    kind: str
    script: Callable[[Play], None]

    def play(self, ask: Play) -> None:
        self.script(ask)


class Histories:
    """Cases drawn from `rng`; `encode(messages, tools)` renders a conversation into ids
    (the model's tokenizer and chat template) for the cut kind; `every` is the prompt
    cache's save interval (a cut lands inside one)."""

    KINDS = ("edited", "tools", "reasoning", "shared", "again", "cut")

    def __init__(self, rng: random.Random, encode: Callable[[list[dict], list | None], list[int]], every: int = 16):
        self.rng, self.encode, self.every = rng, encode, every
        self.seen: list[Ask] = []  # what was sent, for `again`

    def cases(self, n: int) -> list[Case]:
        """n cases; every kind comes up in turn, in a shuffled order per round of kinds."""
        order: list[str] = []
        while len(order) < n:
            kinds = list(self.KINDS)
            self.rng.shuffle(kinds)
            order += kinds
        return [Case(kind, getattr(self, "_" + kind)(self.rng.randrange(2**31))) for kind in order[:n]]

    # ---------------------------------------------------------------- the kinds

    def _opening(self, rng: random.Random) -> list[dict]:
        messages = [{"role": "system", "content": rng.choice(SYSTEMS)}] if rng.random() < 0.6 else []
        return messages + [user(rng.choice(ASKS))]

    def _send(self, ask: Play, request: Ask) -> str:
        self.seen.append(request)
        return ask(request)

    def _edited(self, seed: int):
        def script(ask: Play) -> None:
            rng = random.Random(seed)
            history = self._opening(rng)
            reply = self._send(ask, Ask("edited", history))
            history += [assistant(edit(reply, rng)), user(rng.choice(FOLLOW_UPS))]
            reply = self._send(ask, Ask("edited", history))
            history += [assistant(edit(reply, rng)), user(rng.choice(FOLLOW_UPS))]
            self._send(ask, Ask("edited", history))
        return script

    def _tools(self, seed: int):
        def script(ask: Play) -> None:
            rng = random.Random(seed)
            history = self._opening(rng)
            reply = self._send(ask, Ask("tools", history, TOOLS))
            name, arguments = rng.choice(CALLS)
            result = rng.choice(RESULTS)
            for form in rng.sample(range(4), 2):  # the same call, rendered two ways
                call = {"id": "call_1", "type": "function",
                        "function": {"name": name, "arguments": render_arguments(arguments, form)}}
                turn = history + [assistant(reply[:rng.randrange(len(reply) + 1)], [call]),
                                  {"role": "tool", "tool_call_id": "call_1", "content": result}]
                self._send(ask, Ask("tools", turn, TOOLS))
        return script

    def _reasoning(self, seed: int):
        def script(ask: Play) -> None:
            rng = random.Random(seed)
            history = self._opening(rng)
            reply = self._send(ask, Ask("reasoning", history))
            thought = "<think>\nThe user asks: " + history[-1]["content"] + "\n</think>\n\n"
            follow = user(rng.choice(FOLLOW_UPS))
            self._send(ask, Ask("reasoning", history + [assistant(thought + reply), follow]))
            self._send(ask, Ask("reasoning", history + [assistant(reply), follow]))  # the reasoning dropped
        return script

    def _shared(self, seed: int):
        def script(ask: Play) -> None:
            rng = random.Random(seed)
            opening = self._opening(rng)
            talks = [list(opening), list(opening)]
            for turn in range(4):
                talk = talks[turn % 2]
                reply = self._send(ask, Ask("shared", talk))
                talk += [assistant(reply), user(rng.choice(FOLLOW_UPS))]
        return script

    def _again(self, seed: int):
        def script(ask: Play) -> None:
            rng = random.Random(seed)
            if not self.seen:
                self._send(ask, Ask("again", self._opening(rng)))
                self._send(ask, Ask("again", [user(rng.choice(ASKS))]))
            earlier = self.seen[rng.randrange(len(self.seen))]
            self._send(ask, Ask("again", earlier.messages, earlier.tools, earlier.prompt))
        return script

    def _cut(self, seed: int):
        def script(ask: Play) -> None:
            rng = random.Random(seed)
            history = self._opening(rng)
            reply = self._send(ask, Ask("cut", history))
            ids = self.encode(history + [assistant(reply), user(rng.choice(FOLLOW_UPS))], None)
            for _ in range(2):
                end = rng.randrange(2, len(ids))
                if rng.random() < 0.5 and end > self.every:  # inside a save interval, off its multiple
                    end = end - end % self.every + rng.randrange(1, self.every)
                self._send(ask, Ask("cut", prompt=ids[:min(end, len(ids) - 1)]))
        return script


def user(text: str) -> dict:
    return {"role": "user", "content": text}


def assistant(text: str, tool_calls: list | None = None) -> dict:
    message = {"role": "assistant", "content": text}
    if tool_calls:
        message["tool_calls"] = tool_calls
    return message


def edit(reply: str, rng: random.Random) -> str:
    """The reply edited at its start, in its middle or at its end."""
    where = rng.randrange(3)
    if where == 0:
        return rng.choice(EDITS) + reply
    if where == 1:
        cut = rng.randrange(len(reply) + 1)
        return reply[:cut] + " (edited) " + reply[cut:]
    return reply + " " + rng.choice(EDITS).strip()


def render_arguments(arguments: dict, form: int):
    """A tool call's arguments as an agent resends them: 0 the object, 1 a compact JSON
    string, 2 a spaced one in the other key order, 3 an indented one."""
    if form == 0:
        return dict(arguments)
    if form == 1:
        return json.dumps(arguments, separators=(",", ":"))
    if form == 2:
        return json.dumps(dict(reversed(list(arguments.items()))), separators=(" , ", " : "))
    return json.dumps(arguments, indent=2)


# ------------------------------------------------------------------ warm against cold


def serve_engine(loaded, *argv, target_dir=None, **kw):
    """An Engine made as `python -m monolith.serve ARGV` makes it, on already loaded
    (model, drafter, tokenizer), by default the demo pair's (no pack is read again);
    the tokenizer is read from `target_dir`. It runs argv's --max-batch sequences at
    once, as serve's does (one when argv gives none)."""
    from monolith import engine_setup, model_flags
    from monolith.pack.demo import bundle_dir
    from monolith.serve import build_parser

    model, drafter, _ = loaded
    args = build_parser().parse_args(["--dtype", "float32", "--no-warmup", "--max-context", "1024", *argv])
    drafts = () if "--no-draft" in argv else ("the loaded draft",)
    sources = engine_setup.Sources(target_dir or bundle_dir() / "target", drafts)
    kw.setdefault("max_batch", args.max_batch if "--max-batch" in argv else 1)
    return engine_setup.load_engine(args, model_flags.plan_model(args), lambda line: None, sources=sources,
                                    load=lambda *a, **k: model, load_draft=lambda *a, **k: drafter, **kw)


@dataclass
class Mismatch:
    kind: str
    prompt_tokens: int
    warm: list[int]
    cold: list[int]
    at: int  # the first token where they part
    margin: float  # the target's top-1/top-2 logit margin there (inf: one ended first)


class WarmCold:
    """Each ask goes to `warm` (one long-lived Engine: whatever it served before stays
    in its sessions and prompt cache) and to `cold` (an Engine that runs every request
    on a fresh Session without a prompt cache: a server that saw nothing before it);
    their greedy token ids must be equal. A parting where the target's top two logits
    lie within `near_tie` is float rounding (a resumed prefill runs other chunks than a
    cold one), counted apart; any other parting is a Mismatch."""

    def __init__(self, warm, cold, model, max_tokens: int = 8, near_tie: float = 1e-3):
        self.warm, self.cold, self.model = warm, cold, model
        self.max_tokens, self.near_tie = max_tokens, near_tie
        self.requests = self.near_ties = 0
        self.colds: dict = {}  # GenerationRequest -> the cold engine's token ids
        self.mismatches: list[Mismatch] = []

    def ids(self, ask: Ask) -> tuple[list[int], tuple[int, ...]]:
        """The prompt ids and message ends, as the server renders the request."""
        tok = self.warm.tokenizer
        if ask.prompt is not None:
            return list(ask.prompt), ()
        ids = tok.encode_chat(ask.messages, ask.tools)
        return ids, tuple(tok.message_ends(ids))

    def ask(self, ask: Ask) -> str:
        from monolith.runtime.events import GenerationRequest
        from monolith.runtime.session import Session

        prompt, ends = self.ids(ask)
        request = GenerationRequest(tuple(prompt), self.max_tokens, boundaries=ends)
        _, warm = self.warm.run_request(request)
        cold = self.colds.get(request)
        if cold is None:  # a cold server's greedy reply depends on the request alone
            _, finished = self.cold.run_request(request, Session())
            cold = self.colds[request] = list(finished.token_ids)
        self.requests += 1
        if list(warm.token_ids) != cold:
            from oracles import first_parting

            at, margin = first_parting(self.model, prompt, list(warm.token_ids), cold)
            if margin < self.near_tie:
                self.near_ties += 1
            else:
                self.mismatches.append(Mismatch(ask.kind, len(prompt), list(warm.token_ids), cold, at, margin))
        return self.warm.tokenizer.decode(list(warm.token_ids), skip_special_tokens=True)

    def run(self, cases: list[Case], clients: int = 1) -> None:
        """Play the cases, `clients` at a time (threads: the warm engine batches them)."""
        if clients == 1:
            for case in cases:
                case.play(self.ask)
            return
        import concurrent.futures

        with concurrent.futures.ThreadPoolExecutor(clients) as pool:
            for future in [pool.submit(case.play, self.ask) for case in cases]:
                future.result()


def synthetic_pair(root, dense: bool, seed: int):
    """A synthetic target (dense or MoE) and a DSpark draft for it under `root`, loaded in
    float32 with their packs in root/cache: (its checkpoint directory, (model, drafter,
    tokenizer))."""
    import pytest

    from monolith import engine_setup
    from monolith.synth import write_draft, write_target
    from monolith.tokenizer import load_tokenizer

    target = write_target(root / "target", dense=dense, seed=seed)
    draft = write_draft(root / "draft", target, seed=seed)
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("MONOLITH_CACHE", str(root / "cache"))
        model = engine_setup.load_target(target, dtype="float32")
        drafter = engine_setup.load_drafter(draft, model, dtype="float32", quantization="none")
    return target, (model, drafter, load_tokenizer(target))
