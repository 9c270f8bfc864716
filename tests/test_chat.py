"""python -m monolith.chat, driven through a pseudo-terminal (pexpect) on a tiny
synthetic target in float32, plus the Conversation's token bookkeeping in-process."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys

import pexpect
import pytest
from chat_rig import run_chat

from monolith.conversation import Conversation
from monolith.models import load_model
from monolith.runtime.engine import Engine, Limits
from monolith.runtime.events import GenerationRequest

STATS = re.compile(r"-- (\d+) tokens, [\d.]+ tok/s \| prompt (\d+) tokens: (\d+) cached, (\d+) prefilled, "
                   r"[\d.]+ tok/s \| acceptance n/a \(no draft\) \| (\w+)")


def ignore_sigint() -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)


def spawn(pack, *args, sigint_ignored: bool = False) -> pexpect.spawn:
    """The chat in a terminal. `sigint_ignored`: started the way a background job or a
    CI runner starts it, with SIGINT ignored (the chat must still take Ctrl-C)."""
    child = pexpect.spawn(sys.executable, ["-m", "monolith.chat", "--model", str(pack), "--dtype", "float32", *args],
                          encoding="utf-8", timeout=60, dimensions=(50, 200),
                          preexec_fn=ignore_sigint if sigint_ignored else None)
    child.expect(r"monolith chat: [^\r\n]*, plain decoding, context \d+ tokens; /help for commands\r?\n")
    child.expect("> ")
    return child


def turn(child, text) -> tuple[int, int, int, int, str]:
    """Send a message; (generated, prompt, cached, prefilled, finish) from the stats line."""
    child.sendline(text)
    child.expect(STATS)
    generated, prompt, cached, prefilled, finish = child.match.groups()
    child.expect("> ")
    return int(generated), int(prompt), int(cached), int(prefilled), finish


def turn_suffix(tok, text) -> list[int]:
    """The synthetic ChatML template's tokens between a reply and the next generation."""
    return tok.encode(f"<|im_end|>\n<|im_start|>user\n{text}<|im_end|>\n<|im_start|>assistant\n",
                      add_special_tokens=False)


def test_two_turns_prefill_only_the_new_tokens_and_commands(pack, tok):
    child = spawn(pack, "--max-tokens", "8")
    generated1, prompt1, cached1, prefilled1, finish1 = turn(child, "Hello there")
    assert prompt1 == len(tok.encode_chat([{"role": "user", "content": "Hello there"}]))
    assert (cached1, prefilled1) == (0, prompt1)
    generated2, prompt2, cached2, prefilled2, finish2 = turn(child, "Tell me more")
    suffix = turn_suffix(tok, "Tell me more")
    assert prompt2 == prompt1 + generated1 - (finish1 == "stop") + len(suffix)
    if finish1 == "length":  # the last reply token was never fed: it is prefilled with the new turn
        assert (cached2, prefilled2) == (prompt1 + generated1 - 1, len(suffix) + 1)
    else:  # the end token was fed by the queued step and is the suffix's first token
        assert (cached2, prefilled2) == (prompt1 + generated1, len(suffix) - 1)
    assert cached2 + prefilled2 == prompt2

    child.sendline("/stats")
    child.expect(r"turns: 2 \| conversation: (\d+) tokens")
    child.expect(r"prompt tokens: (\d+) \((\d+) cached, (\d+) prefilled\)")
    assert [int(x) for x in child.match.groups()] == [prompt1 + prompt2, cached2, prompt1 + prefilled2]
    child.expect(r"generated: (\d+) tokens")
    assert int(child.match.group(1)) == generated1 + generated2
    child.expect("acceptance: n/a")
    child.expect("> ")

    child.sendline("/reset")
    child.expect(r"\(new conversation\)")
    child.expect("> ")
    _, prompt3, cached3, _, _ = turn(child, "Hello there")
    # /reset forgets the conversation; the prompt cache still holds the first turn's
    # saved states, the deepest one token before the prompt's end
    first = tok.encode_chat([{"role": "user", "content": "Hello there"}])
    assert prompt3 == prompt1 and cached3 == len(first) - 1

    child.sendline("/system You are a pirate.")
    child.expect(r"\(system prompt set; new conversation\)")
    child.expect("> ")
    _, prompt4, cached4, _, _ = turn(child, "Hello there")
    messages = [{"role": "system", "content": "You are a pirate."}, {"role": "user", "content": "Hello there"}]
    assert prompt4 == len(tok.encode_chat(messages)) and cached4 == 0

    child.sendline("/nonsense")
    child.expect("unknown command /nonsense; /help lists the commands")
    child.expect("> ")
    child.sendline("/help")
    child.expect(r"commands: /help  /reset  /system TEXT  /stats")
    child.expect("> ")
    child.sendline("/quit")
    child.expect(pexpect.EOF)
    child.close()
    assert child.exitstatus == 0


def start_reply(child) -> None:
    """A reply that runs for a while: greedy decoding of this prompt goes 866 tokens
    before the synthetic model's end token (a second or two here)."""
    child.sendline("Hello there")
    child.expect("Hello there\r?\n")  # the terminal's echo
    child.expect(r"\S", timeout=30)  # the reply is streaming


@pytest.mark.parametrize("sigint_ignored", [False, True])
def test_ctrl_c_stops_the_reply_not_the_program(pack, sigint_ignored):
    child = spawn(pack, "--max-tokens", "5000", sigint_ignored=sigint_ignored)
    start_reply(child)
    child.sendintr()
    child.expect(r"\[stopped\] -- (\d+) tokens", timeout=30)
    assert int(child.match.group(1)) < 866
    child.expect("> ")
    child.sendline("/stats")
    child.expect(r"turns: 1 ")
    child.expect("> ")
    child.sendintr()  # at the prompt: a hint, not an exit
    child.expect(r"/quit or Ctrl-D")
    child.sendeof()
    child.expect(pexpect.EOF)
    child.close()
    assert child.exitstatus == 0


def test_stopped_reply_keeps_the_conversation_cached(pack, tok):
    child = spawn(pack, "--max-tokens", "5000")
    start_reply(child)
    child.sendintr()
    child.expect(r"\[stopped\] -- (\d+) tokens.*? prompt (\d+) tokens", timeout=30)
    generated, prompt = (int(x) for x in child.match.groups())
    child.expect("> ")
    _, prompt2, cached2, prefilled2, _ = turn(child, "Stop there")
    suffix = turn_suffix(tok, "Stop there")
    assert prompt2 == prompt + generated + len(suffix)
    assert cached2 >= prompt + generated - 1 and cached2 + prefilled2 == prompt2
    child.sendline("/quit")
    child.expect(pexpect.EOF)


def test_conversation_prompts_extend_the_cached_tokens(pack, tok):
    model = load_model(pack, dtype="float32")
    engine = Engine(model, tok, Limits(max_context=512))
    try:
        conversation = Conversation(tok, system="Be brief.")
        session = engine.new_session()
        for i, text in enumerate(["One", "Two", "Three"]):
            prompt = conversation.prompt(text)
            assert prompt[:len(conversation.tokens)] == conversation.tokens
            _, finished = engine.run_request(GenerationRequest(tuple(prompt), 6), session)
            if i:
                assert finished.usage.cached_tokens >= len(conversation.tokens) - 1
            conversation.commit(prompt, finished.token_ids)
        assert conversation.turns == 3
    finally:
        engine.close()


def test_usage_errors_exit_1():
    for args in (["--max-tokens", "0"], ["--temperature", "-1"], ["--no-draft", "--spec-sched", "cost"]):
        r = subprocess.run([sys.executable, "-m", "monolith.chat", *args], capture_output=True, text=True, timeout=60,
                           stdin=subprocess.DEVNULL)
        assert r.returncode == 1 and r.stderr.startswith("error:") and "Traceback" not in r.stderr


def test_chat_with_a_draft_reports_acceptance(tmp_path):
    from monolith.synth import write_pair

    target, draft = write_pair(tmp_path / "pair")
    child = pexpect.spawn(sys.executable, ["-m", "monolith.chat", "--model", str(target), "--draft", str(draft),
                                           "--draft-quantization", "none", "--dtype", "float32", "--max-tokens", "16"],
                          encoding="utf-8", timeout=60, dimensions=(50, 200),
                          env={**os.environ, "MONOLITH_CACHE": str(tmp_path / "cache")})
    child.expect(r"monolith chat: [^\r\n]*, drafting with [^\r\n]*, context \d+ tokens; /help for commands\r?\n")
    child.expect("> ")
    child.sendline("Hello there")
    child.expect(r"-- 16 tokens, [\d.]+ tok/s \| prompt \d+ tokens: 0 cached, \d+ prefilled, [\d.]+ tok/s \| "
                 r"acceptance [\d.]+ tokens/round \| length")
    child.expect("> ")
    child.sendline("Tell me more")  # the speculative backend resumes the conversation's cache too
    child.expect(r"-- 16 tokens, [\d.]+ tok/s \| prompt (\d+) tokens: (\d+) cached, (\d+) prefilled")
    prompt, cached, prefilled = (int(x) for x in child.match.groups())
    assert cached > 0 and cached + prefilled == prompt and prefilled < 30
    child.expect("> ")
    child.sendline("/stats")
    child.expect(r"acceptance: [\d.]+ tokens/round over \d+ rounds")
    child.expect("> ")
    child.sendline("/quit")
    child.expect(pexpect.EOF)
    child.close()
    assert child.exitstatus == 0


def test_a_loaded_draft_that_does_not_draft_says_so_not_no_draft(tmp_path, monkeypatch):
    """The break-even check (serve's and chat's, here made to fail as on a Linux CPU)
    turns drafting off: the chat says the draft is loaded and why it does not draft, and
    only an engine without a draft says "no draft"."""
    from monolith import engine_setup, model_flags
    from monolith.chat import build_parser
    from monolith.runtime.calibrate import BreakEven
    from monolith.synth import write_pair

    target, draft = write_pair(tmp_path / "pair")
    monkeypatch.setattr(engine_setup, "measure_break_even", lambda *a, **k: BreakEven(9.0, (9.0, 9.0, 9.0)))
    args = build_parser().parse_args(["--model", str(target), "--draft", str(draft), "--draft-quantization", "none",
                                      "--dtype", "float32", "--max-context", "256", "--no-warmup"])
    engine = engine_setup.load_engine(args, model_flags.plan_model(args), lambda line: None)
    try:
        _, text = run_chat(engine, ["Hello", "/stats"], max_tokens=4)
    finally:
        engine.close()
    reason = f"draft {draft} loaded, not drafting: a drafted round costs 9.0 plain steps"
    assert engine.draft_name is None and "plain decoding (a draft is loaded but does not pay here; /stats says why)" in text
    assert "| acceptance n/a (draft loaded, not drafting) |" in text and f"acceptance: n/a ({reason}" in text
    assert "no draft" not in text


# ------------------------------------------------------------------ /save and /load


@pytest.fixture(scope="module")
def tiny_model(pack):
    return load_model(pack, dtype="float32")


def test_save_then_load_goes_on_like_one_conversation(tiny_model, tok, tmp_path):
    engine = Engine(tiny_model, tok, Limits(max_context=512))
    try:
        whole, _ = run_chat(engine, ["Hello there", "Tell me more"])
    finally:
        engine.close()
    saved = tmp_path / "conversation.safetensors"
    engine = Engine(tiny_model, tok, Limits(max_context=512))
    try:
        first, text = run_chat(engine, ["Hello there", f"/save {saved}"])
    finally:
        engine.close()
    assert "(saved 1 turns" in text and saved.is_file()
    engine = Engine(tiny_model, tok, Limits(max_context=512))  # a new process, as far as the caches go
    try:
        second, text = run_chat(engine, [f"/load {saved}", "Tell me more"])
    finally:
        engine.close()
    assert f"(loaded 1 turns, {len(first.conversation.tokens)} tokens" in text
    assert second.conversation.tokens == whole.conversation.tokens  # the same reply, token for token
    prompt, cached, prefilled = (int(x) for x in re.search(r"prompt (\d+) tokens: (\d+) cached, (\d+) prefilled",
                                                            text).groups())
    assert cached >= len(first.conversation.tokens) - 1 and cached + prefilled == prompt  # nothing prefilled again


def test_load_refuses_a_corrupt_truncated_or_foreign_file(tiny_model, tok, tmp_path):
    saved = tmp_path / "c.safetensors"
    engine = Engine(tiny_model, tok, Limits(max_context=512))
    try:
        run_chat(engine, ["Hello there", f"/save {saved}"])
        data = saved.read_bytes()
        corrupt, truncated, foreign = tmp_path / "corrupt", tmp_path / "truncated", tmp_path / "foreign"
        corrupt.write_bytes(data[:-5] + bytes([data[-5] ^ 1]) + data[-4:])
        truncated.write_bytes(data[:len(data) // 2])
        foreign.write_bytes(data.replace(tiny_model.pack_sha256.encode(), b"0" * 64))
        chat, text = run_chat(engine, [f"/load {corrupt}", f"/load {truncated}", f"/load {foreign}",
                                       f"/load {tmp_path / 'missing'}", "/load", "/stats"])
    finally:
        engine.close()
    lines = [line for line in text.splitlines() if line.startswith(("(cannot load", "usage"))]
    assert len(lines) == 5, text
    assert str(corrupt) in lines[0] and "SHA-256" in lines[0]
    assert str(truncated) in lines[1] and "truncated" in lines[1]
    assert str(foreign) in lines[2] and "pack_sha256" in lines[2]
    assert "missing" in lines[3] and lines[4] == "usage: /load FILE"
    assert chat.conversation.tokens == [] and "turns: 0" in text  # nothing was loaded


def test_save_and_load_with_a_draft(tmp_path, synth_pair_f32):
    from monolith.runtime.decoder import Decoder

    model, drafter, tok = synth_pair_f32
    saved = tmp_path / "c.safetensors"

    def engine():
        return Engine(model, tok, Limits(max_context=512), decoder=Decoder(model, drafter, 512))

    runs = {}
    for name, lines in (("whole", ["Hello there", "Tell me more"]), ("first", ["Hello there", f"/save {saved}"]),
                        ("second", [f"/load {saved}", "Tell me more"])):
        e = engine()
        try:
            runs[name] = run_chat(e, lines)
        finally:
            e.close()
    assert "(saved 1 turns" in runs["first"][1] and "(loaded 1 turns" in runs["second"][1]
    assert runs["second"][0].conversation.tokens == runs["whole"][0].conversation.tokens
    # the draft's context came back too: turn 2 drafts and accepts exactly as in one conversation
    totals = {name: run[0].totals for name, run in runs.items()}
    for key in ("drafts", "accepted"):
        assert totals["second"][key] == totals["whole"][key] - totals["first"][key]
    assert totals["second"]["drafts"] > 0
    plain = Engine(model, tok, Limits(max_context=512))  # a file with the draft's rows is not this engine's
    try:
        _, text = run_chat(plain, [f"/load {saved}"])
    finally:
        plain.close()
    assert "cannot load" in text and "draft_sha256" in text


def test_reasoning_is_dimmed_or_collapsed(tiny_model, tok):
    """A reply's <think> block shows dimmed on a terminal (/think on, the default) or as
    one marker line (/think off); the answer follows on its own line either way."""
    import io

    from serving_rig import Scripted

    from monolith.chat import DIM, PLAIN

    class Terminal(io.StringIO):
        def isatty(self):
            return True

    reply = "<think>\nweighing it\n</think>\n\nThe answer."
    engine = Engine(tiny_model, tok, Limits(max_context=512), decoder=Scripted(tok.encode(reply)))
    try:
        _, text = run_chat(engine, ["Hi", "/think off", "Hi again", "/think maybe"], Terminal(), max_tokens=64)
    finally:
        engine.close()
    first, second = text.split("(reasoning collapsed)")
    assert f"{DIM}weighing it\n{PLAIN}\nThe answer." in first
    assert "weighing it" not in second and "[thinking... /think on shows it]\nThe answer." in second
    assert "usage: /think on|off" in second
