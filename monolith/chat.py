"""python -m monolith.chat [--model M] [--draft D | --no-draft] ...: a terminal chat.

Replies stream as they are generated, then one line of speed and acceptance. The
conversation's cache is kept across turns, so each turn prefills only its new
tokens. The model's reasoning (Qwen's <think> block) shows dimmed, or collapsed to one
line with /think off. Commands: /reset, /system TEXT, /stats, /think on|off, /image PATH,
/save FILE, /load FILE, /quit. /image attaches an image file (PNG, JPEG, ...) to the next
message, for a model with a vision tower (/save keeps the conversation's images too). /save
writes the conversation and its cached state to FILE (a state file: safetensors with
SHA-256s, runtime/state_file.py) and /load reads one back, checked against this model and
draft, so a long conversation goes on without prefilling it again. Ctrl-C stops the
current reply (the conversation keeps what was shown); Ctrl-D or /quit leaves.
"""

from __future__ import annotations

import json
import queue
import signal
import sys
import unicodedata
from pathlib import Path

from .blas import preload_openblas
from .cli import ArgumentParser, print_failure
from .conversation import Attachment, Conversation
from .distributed import add_distributed_arguments, join, to_stderr
from .engine_setup import load_engine
from .model_flags import NOT_A_BUG, SetupError, add_model_arguments, plan_model
from .models.image_inputs import ImageInputError
from .runtime.events import (
    ContextLengthError,
    Delta,
    Failed,
    Finished,
    GenerationRequest,
)
from .runtime.prompt_cache import layout_of
from .runtime.state_file import (
    StateFileError,
    device_rows,
    device_snapshot,
    host_arrays,
    identity,
    read_state_file,
    write_state_file,
)
from .sampling import SamplingParams, add_sampling_arguments
from .serving.errors import APIError
from .serving.reasoning import ReasoningSplitter, prompt_opens_reasoning

HELP = ("commands: /help  /reset  /system TEXT  /stats  /think on|off  /image PATH  /save FILE  /load FILE  /quit   "
        "(Ctrl-C stops a reply, Ctrl-D leaves)")
DIM, PLAIN = "\x1b[2m", "\x1b[0m"  # how a terminal shows the model's reasoning


def build_parser() -> ArgumentParser:
    ap = ArgumentParser(prog="python -m monolith.chat", description=__doc__)
    add_model_arguments(ap)
    ap.add_argument("--system", help="system prompt")
    ap.add_argument("--max-tokens", type=int, default=2048, help="per reply (default 2048)")
    add_sampling_arguments(ap)
    ap.add_argument("--no-thinking", action="store_true", help="render the template with enable_thinking=false")
    add_distributed_arguments(ap)
    return ap


class Chat:
    def __init__(self, engine, args, name: str = "", out=None):
        self.engine = engine
        self.name = name or engine.tokenizer.path.name
        self.out = out or sys.stdout
        self.params = SamplingParams.from_args(args)
        self.max_tokens = args.max_tokens
        self.template_kwargs = {"enable_thinking": False} if args.no_thinking else {}
        self.session = engine.new_session()
        self.conversation = self.new_conversation(args.system)
        self.attached: list = []  # /image: the images the next message takes
        self.totals = {"prompt": 0, "cached": 0, "generated": 0, "prefill_s": 0.0, "decode_s": 0.0, "steps": 0,
                       "drafts": 0, "accepted": 0}
        self.show_thinking = True  # /think on|off: the reasoning shown dimmed, or collapsed to a marker

    def write(self, text: str) -> None:
        self.out.write(text)
        self.out.flush()

    def run(self, read=input) -> int:
        engine = self.engine
        self.write(self.banner() + "\n")
        while True:
            try:
                line = read("> ")
            except EOFError:
                self.write("\n")
                return 0
            except KeyboardInterrupt:
                self.write("\n(Ctrl-C stops a reply; /quit or Ctrl-D leaves)\n")
                continue
            line = line.strip()
            if not line:
                continue
            if line.startswith("/"):
                if self.command(line):
                    return 0
                continue
            self.reply(line)

    def command(self, line: str) -> bool:
        """Run a /command; True to quit."""
        name, _, rest = line.partition(" ")
        if name in ("/quit", "/exit"):
            return True
        if name in ("/help", "/?"):
            self.write(HELP + "\n")
        elif name == "/reset":
            self.reset()
            self.write("(new conversation)\n")
        elif name == "/system":
            self.conversation.system = rest.strip() or None
            self.reset()
            self.write("(system prompt " + ("set" if rest.strip() else "cleared") + "; new conversation)\n")
        elif name == "/stats":
            self.write(self.stats() + "\n")
        elif name == "/think":
            if rest.strip() not in ("on", "off"):
                self.write("usage: /think on|off\n")
            else:
                self.show_thinking = rest.strip() == "on"
                self.write("(reasoning " + ("shown, dimmed" if self.show_thinking else "collapsed") + ")\n")
        elif name == "/image":
            self.write(self.attach(Path(rest.strip()).expanduser()) + "\n" if rest.strip() else "usage: /image PATH\n")
        elif name in ("/save", "/load") and not rest.strip():
            self.write(f"usage: {name} FILE\n")
        elif name == "/save":
            self.write(self.save(Path(rest.strip()).expanduser()) + "\n")
        elif name == "/load":
            self.write(self.load(Path(rest.strip()).expanduser()) + "\n")
        else:
            self.write(f"unknown command {name}; /help lists the commands\n")
        return False

    def banner(self) -> str:
        """One line: the model, whether it drafts (in words), the context, where help is."""
        engine = self.engine
        if engine.draft_name:
            mode = f"drafting with {engine.draft_name}"
        elif engine.not_drafting:
            mode = "plain decoding (a draft is loaded but does not pay here; /stats says why)"
        else:
            mode = "plain decoding"
        return f"monolith chat: {self.name}, {mode}, context {engine.max_context} tokens; /help for commands"

    def _drafter(self):
        return self.engine.decoder.drafter

    def attach(self, path: Path) -> str:
        """/image: an image file for the next message."""
        vision = self.engine.vision
        if vision is None:
            return "(this model takes no images: it has no vision tower, or chat was started with --no-vision)"
        try:
            attachment = Attachment.of(path.read_bytes(), vision)
        except (OSError, ImageInputError) as e:
            return f"(cannot attach {path}: {e})"
        self.attached.append(attachment)
        image = attachment.image
        height, width = image.size
        return (f"(image {len(self.attached)} attached: {path.name}, {width}x{height} pixels, {image.tokens} "
                "tokens; it goes with your next message)")

    def save(self, path: Path) -> str:
        """/save: the conversation and the state the session holds for it, in one state file."""
        conversation, engine = self.conversation, self.engine
        if not conversation.tokens:
            return "(nothing to save yet)"
        drafter, key = self._drafter(), conversation.key()
        try:
            def export():
                held, rows, snapshot = self.session.export(key, drafter is not None)
                return held, *host_arrays(rows, snapshot.states), snapshot.positions

            held, host_rows, host_states, positions = engine.call(export)
            about = {"system": conversation.system, "turns": conversation.turns, "tokens": conversation.tokens,
                     "template_kwargs": conversation.template_kwargs, "images": conversation.saved()}
            size = write_state_file(path, identity(engine.model, drafter), key[:held], 0, host_rows,
                                    host_states, {"conversation": json.dumps(about)}, positions)
        except (OSError, ValueError) as e:
            return f"(cannot save: {e})"
        return f"(saved {conversation.turns} turns, {held} tokens of state, {size / 2**20:.1f} MiB to {path})"

    def load(self, path: Path) -> str:
        """/load: a conversation saved by /save, checked against this model and draft."""
        engine, drafter = self.engine, self._drafter()

        def read():
            stored = read_state_file(path, identity(engine.model, drafter), layout_of(engine.model, drafter))
            about = json.loads(stored.metadata.get("conversation", "null") or "null")
            if not isinstance(about, dict):
                raise StateFileError(f"{path}: not a conversation saved by /save")
            conversation = self.new_conversation(about.get("system"), about.get("template_kwargs") or {})
            conversation.restore(about.get("tokens", []), about.get("images", []))
            if stored.start or conversation.key()[:stored.end] != stored.tokens:
                raise StateFileError(f"{path}: not a conversation saved by /save")
            layout = layout_of(engine.model, drafter)
            self.session.adopt(engine.model, engine.max_context, stored.tokens, device_rows(stored, layout),
                               device_snapshot(stored), drafter)
            conversation.turns = int(about.get("turns", 0))
            return conversation

        try:
            conversation = engine.call(read)
        except (OSError, ValueError) as e:  # a bad image's base64 or bytes too
            return f"(cannot load: {e})"
        self.conversation = conversation
        return f"(loaded {conversation.turns} turns, {len(conversation.tokens)} tokens from {path})"

    def reset(self) -> None:
        self.session.reset()
        self.conversation = self.new_conversation(self.conversation.system)
        self.attached = []

    def new_conversation(self, system: str | None, template_kwargs: dict | None = None) -> Conversation:
        kwargs = self.template_kwargs if template_kwargs is None else template_kwargs
        return Conversation(self.engine.tokenizer, system, kwargs, self.engine.vision)

    def reply(self, user_text: str) -> None:
        events: queue.Queue = queue.Queue()
        try:
            attached = list(self.attached)
            prompt = self.conversation.prompt(user_text, attached)
            request = GenerationRequest(tuple(prompt), self.max_tokens, self.params,
                                        boundaries=tuple(self.engine.tokenizer.message_ends(prompt)),
                                        images=tuple(self.conversation.images + [a.image for a in attached]))
            job = self.engine.submit(request, events.put, self.session)
        except ContextLengthError as e:
            self.write(f"(the conversation is {e.prompt_tokens} tokens and no longer fits the context of "
                       f"{e.max_context}; /reset starts over)\n")
            return
        except (ValueError, APIError) as e:  # APIError: the text holds the template's image mark
            self.write(f"(error: {e})\n")
            return
        finished, stopped = None, False
        tail = self.engine.tokenizer.decode(prompt[-8:], skip_special_tokens=False)
        shown = _Shown(self, ReasoningSplitter(prompt_opens_reasoning(tail)))
        while finished is None:
            try:
                try:
                    event = events.get(timeout=0.1)
                except queue.Empty:
                    continue
                if isinstance(event, Delta):
                    shown.feed(event.text)
                elif isinstance(event, Finished):
                    finished = event
                elif isinstance(event, Failed):
                    shown.finish()
                    self.write(f"\n(error: {event.error})\n")
                    self.session.reset()
                    self.conversation = self.new_conversation(self.conversation.system)
                    self.attached = []
                    return
            except KeyboardInterrupt:
                stopped = True
                job.cancel()
        shown.finish()
        self.conversation.commit(prompt, finished.token_ids, attached)
        self.attached = []
        self.write("\n" + ("[stopped] " if stopped else "") + self.reply_line(finished) + "\n")

    def reply_line(self, f: Finished) -> str:
        t = self.totals
        t["prompt"] += f.usage.prompt_tokens
        t["cached"] += f.usage.cached_tokens
        t["generated"] += f.usage.completion_tokens
        t["prefill_s"] += f.prefill_seconds
        t["decode_s"] += f.decode_seconds
        t["steps"] += f.decode_steps
        if f.spec is not None:
            t["drafts"] += f.spec.drafts
            t["accepted"] += f.spec.accepted_tokens
        acceptance = (f"acceptance {f.spec.acceptance_length:.2f} tokens/round" if f.spec and f.spec.drafts
                      else f"acceptance n/a ({self.no_acceptance('no round drafted')})")
        return (f"-- {f.usage.completion_tokens} tokens, {f.decode_tok_s:.1f} tok/s | prompt "
                f"{f.usage.prompt_tokens} tokens: {f.usage.cached_tokens} cached, {f.prefilled_tokens} prefilled, "
                f"{f.prefill_tok_s:.1f} tok/s | {acceptance} | {f.finish_reason}")

    def no_acceptance(self, drafting: str, loaded: str = "draft loaded, not drafting") -> str:
        """Why there is no acceptance to show: `drafting` when the engine drafts, `loaded`
        when a draft was loaded but the engine decodes plainly, else "no draft"."""
        return drafting if self.engine.draft_name else loaded if self.engine.not_drafting else "no draft"

    def stats(self) -> str:
        t = self.totals
        prefilled = t["prompt"] - t["cached"]
        prefill = prefilled / t["prefill_s"] if t["prefill_s"] > 0 else 0.0
        decode = t["steps"] / t["decode_s"] if t["decode_s"] > 0 else 0.0
        if t["drafts"]:
            acceptance = f"{(t['accepted'] + t['drafts']) / t['drafts']:.2f} tokens/round over {t['drafts']} rounds"
        else:
            acceptance = f"n/a ({self.no_acceptance('no round drafted yet', self.engine.not_drafting)})"
        return (f"turns: {self.conversation.turns} | conversation: {len(self.conversation.tokens)} tokens of "
                f"{self.engine.max_context}\n"
                f"prompt tokens: {t['prompt']} ({t['cached']} cached, {prefilled} prefilled), {prefill:.1f} tok/s\n"
                f"generated: {t['generated']} tokens, {decode:.1f} tok/s\n"
                f"acceptance: {acceptance}")


class _Shown:
    """A reply on the terminal: its reasoning dimmed (or, collapsed, one marker), then
    its content on a line of its own."""

    def __init__(self, chat: Chat, splitter: ReasoningSplitter):
        self.chat, self.splitter = chat, splitter
        self.styled = chat.out.isatty()
        self.reasoned = self.collapsed = self.answered = self.dimmed = False

    def feed(self, text: str) -> None:
        self.show(*self.splitter.feed(text))

    def finish(self) -> None:
        self.show(*self.splitter.finish())
        self._undim()

    def show(self, reasoning: str, content: str) -> None:
        if reasoning and self.chat.show_thinking:
            if self.styled and not self.dimmed:
                self.chat.write(DIM)
                self.dimmed = True
            self.chat.write(_printable(reasoning))
            self.reasoned = True
        elif reasoning and not self.collapsed:
            self.chat.write("[thinking... /think on shows it]\n")
            self.collapsed = True
        if content:
            self._undim()
            if self.reasoned and not self.answered:
                self.chat.write("\n")
            self.answered = True
            self.chat.write(_printable(content))

    def _undim(self) -> None:
        if self.dimmed:
            self.chat.write(PLAIN)
            self.dimmed = False


def _printable(text: str) -> str:
    """Model text for a terminal: control characters (escape sequences!) shown as U+FFFD."""
    return "".join(c if c in "\n\t" or unicodedata.category(c) != "Cc" else "\ufffd" for c in text)


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    # Ctrl-C stops a reply: take SIGINT even when started with it ignored (a background
    # job, a CI runner), as Python only installs its handler when SIGINT is not ignored
    signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        plan = plan_model(args)
        if args.max_tokens < 1:
            raise SetupError(f"--max-tokens must be at least 1, got {args.max_tokens}")
        SamplingParams.from_args(args)
    except (SetupError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    rank = None
    try:
        if args.distributed:
            rank = join(args, plan, to_stderr)
            if not rank.leader:  # a stage only: rank 0 chats
                return rank.serve()
        engine = load_engine(args, plan, to_stderr, max_queue=1, queue_timeout=1e9,
                             **({} if rank is None else {"sources": rank.sources, "load": rank.target}))
    except KeyboardInterrupt:
        print("\nerror: interrupted", file=sys.stderr)
        return 130
    except Exception as e:  # noqa: BLE001 - one error line (and a traceback if it is ours)
        print_failure(e, NOT_A_BUG)
        return 1
    try:
        try:
            import readline  # noqa: F401 - line editing and history for input()
        except ImportError:
            pass
        return Chat(engine, args, plan.name).run()
    finally:
        engine.close()
        if rank is not None:
            rank.close()


if __name__ == "__main__":
    preload_openblas()  # re-executes this command once with OpenBLAS, where one is installed
    sys.stdout.reconfigure(encoding="utf-8")
    sys.exit(main())
