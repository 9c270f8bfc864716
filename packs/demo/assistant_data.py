"""Chat transcripts that teach the demo target the shape of an assistant (issue 53), all
generated from what Python ships: the standard library's docstrings (read with `ast`,
never imported) and a fixed set of tool shapes. Deterministic under a seed.

- stdlib questions: "What does `json.dumps` do?" -> the first sentence of its docstring;
  "How do I ...?" for functions whose docstring starts with a verb that says how; "Show
  me the source of ..." for short ones; short follow-ups ("How do I call it?", "Which
  module is it in?", "And `m.g`?").
- tools: tool definitions in the template's tools block (names, descriptions and
  parameter names varied per transcript, so the call must be read off the block); the
  assistant calls the right tool with the argument the question names, gets a result
  (role tool) and answers from it. Stdlib questions and small talk with tools offered are
  answered without a call.
- a third of the transcripts follow one or two earlier exchanges (small talk, a question
  about a function); two in five open with a system message, a third of those a coding
  agent's long one (agent_prompts.py: rules under headings, an environment block);
- every assistant turn is rendered by the pair's own chat template (`render`), so it ends
  with the template's end-of-turn token; a tenth of the final turns carry a short,
  closed reasoning block (thinking on), a fifth are rendered with thinking off.

The split follows corpus.py: functions of a held-out file (corpus.held_out) are never in
the training transcripts; they, with held-out cities and paths, make the bench's prompts
(bench/demo.py). A transcript is a dict: "messages" (OpenAI-style), "tools" (chat tools
or None), "kwargs" (template arguments), "kind" (stdlib, tool_call, tool_answer, no_tool,
smalltalk, source), and for the bench "expect" (key words, or the call expected).
"""

from __future__ import annotations

import ast
import functools
import io
import random
import re
import sysconfig
from dataclasses import dataclass
from pathlib import Path

import agent_prompts
import corpus
import tools_data

# final assistant turns with a reasoning block: few enough that a greedy reply to the default
# prompt (which thinking on renders alike) answers directly; `<think>` is one token, while
# direct answers begin with many different ones
THINK_SHARE = 0.1
NO_THINK_SHARE = 0.2  # transcripts rendered with enable_thinking=False
SYSTEM_SHARE = 0.4  # transcripts that open with a system message
AGENT_SHARE = 0.35  # of those, the ones whose system message is a coding agent's long one (agent_prompts.py)
HISTORY_SHARE = 0.35  # transcripts whose final exchange follows one or two earlier ones
SYSTEM_PROMPTS = ["You are a helpful assistant.", "You are a helpful assistant. Be brief.",
                  "You are a coding assistant.", "Answer in one or two sentences.",
                  "You are an agent in a software project. Use the tools when they help."]
MAX_SENTENCE = 160  # characters: longer first sentences are not asked about
STOP_WORDS = frozenset("""this that with from into when then than also which will would should there their
    them they these those have been being other such only each every given return returns true false none
    value values object objects default argument arguments used using function method class""".split())
# a docstring's first word -> how "How do I ...?" says it (the rest of the sentence follows)
HOW_VERBS = {"return": "get", "returns": "get", "get": "get", "gets": "get", "convert": "convert",
             "converts": "convert", "parse": "parse", "parses": "parse", "decode": "decode", "decodes": "decode",
             "encode": "encode", "encodes": "encode", "open": "open", "opens": "open", "copy": "copy",
             "copies": "copy", "create": "create", "creates": "create", "find": "find", "finds": "find",
             "read": "read", "reads": "read", "write": "write", "writes": "write", "split": "split",
             "splits": "split", "format": "format", "formats": "format", "compute": "compute",
             "computes": "compute", "remove": "remove", "removes": "remove", "extract": "extract",
             "extracts": "extract", "generate": "generate", "generates": "generate", "compare": "compare",
             "compares": "compare", "expand": "expand", "expands": "expand", "guess": "guess", "guesses": "guess"}


@dataclass(frozen=True)
class Function:
    module: str
    name: str
    args: tuple[str, ...]
    sentence: str  # the docstring's first sentence
    source: str | None  # the definition when short (corpus.MAX_ANSWER), else None

    @property
    def qualname(self) -> str:
        return f"{self.module}.{self.name}"

    @property
    def call(self) -> str:
        return f"{self.qualname}({', '.join(self.args)})"


def module_files() -> list[tuple[str, Path, bool]]:
    """(module name, file, held out) for the top-level modules (corpus.py's files and
    split) and the packages' __init__.py (the same rule over their sorted list)."""
    root = Path(sysconfig.get_paths()["stdlib"])
    files = [(p.stem, p, corpus.held_out(i)) for i, p in enumerate(corpus.stdlib_files())]
    packages = sorted(p for p in root.glob("*/__init__.py") if not p.parent.name.startswith(("_", "test", "idle")))
    return files + [(p.parent.name, p, corpus.held_out(i)) for i, p in enumerate(packages)]


@functools.cache
def functions() -> tuple[tuple[Function, ...], tuple[Function, ...]]:
    """(training, held-out) documented public functions, in file order."""
    train, held = [], []
    for module, path, is_held in module_files():
        (held if is_held else train).extend(module_functions(module, path.read_text(encoding="utf-8",
                                                                                     errors="replace")))
    return tuple(train), tuple(held)


def module_functions(module: str, source: str) -> list[Function]:
    try:
        tree = ast.parse(source)
    except (SyntaxError, ValueError):
        return []
    lines = io.StringIO(source, newline="").readlines()
    found = []
    for node in tree.body:
        if not isinstance(node, ast.FunctionDef) or node.name.startswith("_"):
            continue
        sentence = first_sentence(ast.get_docstring(node) or "")
        if sentence is None:
            continue
        args = tuple(a.arg for a in node.args.posonlyargs + node.args.args if not a.arg.startswith("_"))
        code = corpus.segment(lines, node)
        found.append(Function(module, node.name, args, sentence, code if len(code) <= corpus.MAX_ANSWER else None))
    return found


def first_sentence(doc: str) -> str | None:
    """The docstring's first sentence as one line, or None when it does not read as one
    (doctests, "Same as ...", deprecation notes, too short or too long)."""
    para = " ".join(doc.strip().split("\n\n")[0].split())
    match = re.match(r"(.+?[.!?])(\s|$)", para)
    sentence = match.group(1) if match else para
    if not 20 <= len(sentence) <= MAX_SENTENCE or not sentence[0].isupper() or sentence.startswith(("Same", "**")):
        return None
    return sentence if sentence.endswith((".", "!", "?")) else sentence + "."


def key_words(sentence: str, count: int = 4) -> list[str]:
    """The words a reply about the function should contain: the sentence's first `count`
    distinct words of 4+ letters that are not stop words."""
    words = []
    for word in re.findall(r"[A-Za-z][A-Za-z_]{3,}", sentence):
        if word.lower() not in STOP_WORDS and word.lower() not in words:
            words.append(word.lower())
    return words[:count]


def how_question(f: Function) -> tuple[str, str] | None:
    """("How do I ...?", the answer) when the docstring's first word says how."""
    first, _, rest = f.sentence.rstrip(".!?").partition(" ")
    verb = HOW_VERBS.get(first.lower())
    if verb is None or not rest:
        return None
    if first.lower().startswith("return") and rest.lower().startswith("true if "):
        verb, rest = "check whether", rest[len("true if "):]
    return f"How do I {verb} {rest}?", f"Use `{f.call}`. {f.sentence}"


# ----------------------------------------------------------------- transcripts


def stdlib_transcript(rng: random.Random, f: Function, pool: list[Function]) -> dict:
    """One or two exchanges about `f` (its module's other functions come from `pool`)."""
    how = how_question(f)
    if how is not None and rng.random() < 0.4:
        question, answer = how
    else:
        question = rng.choice(["What does `{}` do?", "What does the function `{}` do?", "Explain `{}`.",
                               "What is `{}` for?"]).format(f.qualname)
        answer = f.sentence
    messages = [user(question), assistant(answer)]
    follow = rng.random()
    if follow < 0.15:
        messages += [user("How do I call it?"), assistant(f"Call `{f.call}`.")]
    elif follow < 0.25:
        messages += [user("Which module is it in?"), assistant(f"It is in the `{f.module}` module.")]
    elif follow < 0.35:
        other = rng.choice([g for g in pool if g.module == f.module] or pool)
        messages += [user(f"And `{other.qualname}`?"), assistant(other.sentence)]
    elif follow < 0.42:
        messages += [user(rng.choice(["Thanks!", "Thank you.", "Great, thanks."])),
                     assistant(rng.choice(["You're welcome.", "Glad to help."]))]
    elif follow < 0.5 and f.source is not None:
        messages += [user("Show me its source."), assistant(f"```python\n{f.source}\n```")]
    return transcript("stdlib", messages, expect={"key_words": key_words(f.sentence), "function": f.qualname})


def source_transcript(f: Function) -> dict:
    return transcript("source", [user(f"Show me the source of `{f.qualname}`."),
                                 assistant(f"```python\n{f.source}\n```")])


SMALLTALK = [("Hi!", "Hello! How can I help?"), ("Say hello.", "Hello!"), ("Say hi.", "Hi there!"),
             ("Hello.", "Hello! What can I do for you?"),
             ("Who are you?", "I am a small demo assistant. I know a little about the Python standard library."),
             ("Can you help me?", "Yes. Ask me about a Python module, or give me a task."),
             ("Thanks!", "You're welcome."), ("Say hello in three words.", "Hello there, friend."),
             ("What can you do?", "I can explain Python's standard library and call the tools you give me.")]


def smalltalk_transcript(rng: random.Random) -> dict:
    question, answer = rng.choice(SMALLTALK)
    return transcript("smalltalk", [user(question), assistant(answer)], expect={"key_words": key_words(answer)})


def transcript(kind: str, messages: list[dict], tools=None, expect=None) -> dict:
    return {"kind": kind, "messages": messages, "tools": tools, "kwargs": {}, "expect": expect or {}}


def user(text: str) -> dict:
    return {"role": "user", "content": text}


def assistant(text: str, reasoning: str | None = None, calls=None) -> dict:
    message = {"role": "assistant", "content": text}
    if reasoning is not None:
        message["reasoning_content"] = reasoning
    if calls:
        message["tool_calls"] = [{"type": "function", "function": {"name": n, "arguments": a}} for n, a in calls]
    return message


def think(rng: random.Random, t: dict) -> dict:
    """Thinking on (a short reasoning block on the final turn), off (the template's empty
    block in the prompt), or the template's default, by THINK_SHARE / NO_THINK_SHARE."""
    draw = rng.random()
    last = t["messages"][-1]
    if draw < THINK_SHARE:
        last["reasoning_content"] = reasoning_for(t)
    elif draw < THINK_SHARE + NO_THINK_SHARE:
        t["kwargs"] = {"enable_thinking": False}
    return t


def reasoning_for(t: dict) -> str:
    """A short reasoning block for the transcript's final turn."""
    last = t["messages"][-1]
    if last.get("tool_calls"):
        return f"The `{last['tool_calls'][0]['function']['name']}` tool can do that, so I call it."
    if t["kind"] == "tool_answer":
        return "The tool returned its result. I answer from it."
    function = t["expect"].get("function")
    return f"The user asks about `{function}`. I answer briefly." if function else "I answer briefly."


def build(seed: int = 0, held: bool = False, count: int | None = None) -> list[dict]:
    """Transcripts from the training functions (or, `held`, the held-out ones): about a
    third stdlib questions, a third tool transcripts, the rest source, no-tool and small
    talk; some after earlier exchanges, some under a system message (a short one or a
    coding agent's long one). `count` transcripts (default: twelve per function). Each
    has "start": the index of its final exchange's user message."""
    rng = random.Random(seed + (1000 if held else 0))
    train, held_out = functions()
    pool = held_out if held else train
    sentences = [f.sentence for f in pool]
    count = count if count is not None else 12 * len(pool)
    with_source = [f for f in pool if f.source is not None]
    out = []
    for i in range(count):
        f = pool[rng.randrange(len(pool))]
        draw = rng.random()
        if draw < 0.35:
            t = stdlib_transcript(rng, f, pool)
        elif draw < 0.75:
            t = tools_data.tool_transcript(rng, pool, held)
        elif draw < 0.85:
            plain = stdlib_transcript(rng, f, pool) if rng.random() < 0.7 else smalltalk_transcript(rng)
            t = tools_data.no_tool_transcript(rng, plain)
        elif draw < 0.93 and with_source:
            t = source_transcript(with_source[rng.randrange(len(with_source))])
        else:
            t = smalltalk_transcript(rng)
        t["start"] = 0
        if rng.random() < HISTORY_SHARE:
            earlier = history(rng, pool)
            t["messages"][:0], t["start"] = earlier, len(earlier)
        if rng.random() < SYSTEM_SHARE:
            agent = rng.random() < AGENT_SHARE
            text = agent_prompts.agent_prompt(rng, sentences) if agent else rng.choice(SYSTEM_PROMPTS)
            t["messages"].insert(0, {"role": "system", "content": text})
            t["start"] += 1
        out.append(think(rng, t))
    return out


def history(rng: random.Random, pool: list[Function]) -> list[dict]:
    """One or two earlier exchanges: small talk or a question about a function, answered."""
    messages = []
    for _ in range(rng.randint(1, 2)):
        if rng.random() < 0.5:
            messages += smalltalk_transcript(rng)["messages"]
        else:
            messages += stdlib_transcript(rng, pool[rng.randrange(len(pool))], pool)["messages"][:2]
    return messages


def render(tokenizer, t: dict) -> tuple[str, str]:
    """(prompt, reply) of a transcript as the server renders them: the prompt is the
    template's rendering of every message but the last with the generation prompt (and the
    transcript's template arguments); the reply is what the template renders for the last
    message after the same messages, through its end-of-turn token."""
    head, last = t["messages"][:-1], t["messages"][-1]
    prompt = tokenizer.apply_chat_template(head, t["tools"], add_generation_prompt=True, **t["kwargs"])
    bare = tokenizer.apply_chat_template(head, t["tools"], add_generation_prompt=True)
    whole = tokenizer.apply_chat_template([*head, last], t["tools"], add_generation_prompt=False)
    if not whole.startswith(bare):
        raise ValueError(f"the chat template does not render a transcript as its prompt plus a reply: {t}")
    return prompt, whole[len(bare):]
