"""Every reply equals a cold server's: a long-lived server that has served other
requests answers a request token for token as a server that saw nothing before it.

The reproduction first: a second chat turn whose history holds an edited first reply
(what agents resend), over HTTP on the demo pair built as `serve` builds it, with the
prompt cache off and on, streamed and not, plain and drafting. Then the differential
harness (tests/histories.py): generated agent-style histories sent to one long-lived
engine, each reply compared with a cold engine's (a fresh session, no prompt cache) for
plain decoding, drafting, batching and the prompt cache off, on and on disk after a
restart, on the demo pair and on dense and MoE synthetic targets."""

from __future__ import annotations

import json
import random

import httpx
import pytest
from histories import serve_engine, synthetic_pair
from serving_rig import Server

from monolith.pack.demo import bundle_dir

TURN1 = [{"role": "user", "content": "What does os.path.join do?"}]
MAX_TOKENS = 24
MEASURED: dict = {}


def chat(server, messages, stream=False):
    body = {"model": "monolith-demo", "messages": messages, "max_tokens": MAX_TOKENS, "temperature": 0,
            "stream": stream}
    if not stream:
        r = server.post("/v1/chat/completions", body)
        assert r.status_code == 200, r.text
        return r.json()["choices"][0]["message"]["content"]
    text = []
    with httpx.stream("POST", server.url + "/v1/chat/completions", json=body, timeout=60) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                event = json.loads(line[6:])
                assert "error" not in event, event
                text += [c["delta"].get("content") or "" for c in event["choices"]]
    return "".join(text)


MODES = {"plain, prompt cache on": ("--no-draft",), "plain, prompt cache off": ("--no-draft", "--prompt-cache-size", "0"),
         "drafting, prompt cache on": ("--spec-sched", "fixed"),
         "drafting, prompt cache off": ("--spec-sched", "fixed", "--prompt-cache-size", "0")}


@pytest.mark.parametrize("mode", MODES)
def test_an_edited_reply_in_the_history_gets_the_cold_servers_answer(demo_f32, mode):
    """Turn 2 resends turn 1 with its reply edited at the start ("Well: " + reply): the
    warm server answers as a cold one does (before the fix: a 400 "a saved state of N
    tokens with states after M rows" with the prompt cache, turn 1's answer without)."""
    argv = MODES[mode]
    with Server(lambda: serve_engine(demo_f32, *argv), model_names=("monolith-demo",)) as warm, \
            Server(lambda: serve_engine(demo_f32, *argv), model_names=("monolith-demo",)) as cold:
        warm.wait_ready(), cold.wait_ready()
        reply1 = chat(warm, TURN1)
        turn2 = TURN1 + [{"role": "assistant", "content": "Well: " + reply1},
                         {"role": "user", "content": "And what does os.path.split do?"}]
        want = chat(cold, turn2)
        assert chat(warm, turn2) == want
        assert chat(warm, turn2, stream=True) == want  # the same request again, streamed
        turn2b = TURN1 + [{"role": "assistant", "content": reply1 + " Also see pathlib."},
                          {"role": "user", "content": "And what does os.path.split do?"}]
        assert chat(warm, turn2b, stream=True) == chat(cold, turn2b)


# ------------------------------------------------------------------ the differential harness

CASES = 6  # one of each kind per mode: the suite's fixed sample (bench/archive/warm_cold.py runs thousands)
SEED = 31
EVERY = "16"  # the prompt cache's save interval here: cuts land inside intervals
HARNESS_MODES = {
    "plain": ("--no-draft", "--prompt-cache-size", "0"),
    "plain + prompt cache": ("--no-draft", "--prompt-cache-save-every", EVERY),
    "plain + prompt cache on disk + restart": ("--no-draft", "--prompt-cache-save-every", EVERY, "DIR"),
    "plain + 4 clients batched": ("--no-draft", "--prompt-cache-save-every", EVERY, "--max-batch", "4"),
    "drafting": ("--spec-sched", "fixed", "--prompt-cache-size", "0"),
    "drafting + prompt cache": ("--spec-sched", "fixed", "--prompt-cache-save-every", EVERY),
    "drafting + prompt cache on disk + restart": ("--spec-sched", "fixed", "--prompt-cache-save-every", EVERY,
                                                  "DIR"),
    "drafting + 4 clients batched": ("--spec-sched", "fixed", "--prompt-cache-save-every", EVERY,
                                    "--max-batch", "4"),
}
CACHE_FLAGS = {"--prompt-cache-size": 1, "--prompt-cache-save-every": 1, "--prompt-cache-dir": 1,
               "--max-batch": 1}


def decoder_flags(argv):
    """The flags of argv without the prompt cache's and the batch's: the cold engine's."""
    out, skip = [], 0
    for arg in argv:
        if skip:
            skip -= 1
        elif arg in CACHE_FLAGS:
            skip = CACHE_FLAGS[arg]
        else:
            out.append(arg)
    return out


def harness(loaded, target_dir, argv, tmp_path, cases=CASES, seed=SEED, prefill_chunk="32", max_tokens=8):
    """Play `cases` generated histories against a warm engine made with serve's `argv`
    ("DIR": a --prompt-cache-dir, the engine restarted half way) and a cold one: the
    WarmCold that saw them."""
    from histories import Histories, WarmCold

    restart = "DIR" in argv
    store = ["--prompt-cache-dir", str(tmp_path / "prompts")]
    argv = [flag for a in argv for flag in (store if a == "DIR" else [a])] + ["--prefill-chunk-size", prefill_chunk]
    clients = int(argv[argv.index("--max-batch") + 1]) if "--max-batch" in argv else 1
    warm = serve_engine(loaded, *argv, target_dir=target_dir)
    cold = serve_engine(loaded, *decoder_flags(argv), target_dir=target_dir)
    tok = warm.tokenizer
    generated = Histories(random.Random(seed), tok.encode_chat, int(EVERY)).cases(cases)
    check = WarmCold(warm, cold, loaded[0], max_tokens)
    try:
        if restart:
            check.run(generated[:cases // 2])
            warm.close()
            check.warm = warm = serve_engine(loaded, *argv, target_dir=target_dir)
            check.run(generated[cases // 2:])
        else:
            check.run(generated, clients)
    finally:
        warm.close()
        cold.close()
    return check


@pytest.mark.parametrize("mode", HARNESS_MODES)
def test_warm_equals_cold_on_the_demo_pair(demo_f32, mode, tmp_path):
    check = harness(demo_f32, bundle_dir() / "target", HARNESS_MODES[mode], tmp_path)
    assert check.requests >= 2 * CASES
    assert not check.mismatches, check.mismatches[:3]
    MEASURED[f"warm == cold, demo pair, {mode}: requests, near-ties"] = (check.requests, check.near_ties)


@pytest.fixture(scope="module", params=["MoE", "dense"])
def synthetic(request, tmp_path_factory):
    """A synthetic target (MoE or dense) and a DSpark draft for it, float32: (its
    checkpoint directory, (model, drafter, tokenizer))."""
    return synthetic_pair(tmp_path_factory.mktemp(request.param), request.param == "dense", 5)


@pytest.mark.parametrize("mode", ["plain + prompt cache", "drafting + prompt cache", "drafting + 4 clients batched"])
def test_warm_equals_cold_on_synthetic_targets(synthetic, mode, tmp_path):
    target, loaded = synthetic
    check = harness(loaded, target, HARNESS_MODES[mode], tmp_path)
    assert check.requests >= 2 * CASES
    assert not check.mismatches, check.mismatches[:3]


@pytest.mark.parametrize("decoding", [("--no-draft",), ("--spec-sched", "fixed")], ids=["plain", "drafting"])
def test_a_prompt_served_before_is_prefilled_only_for_its_last_token(demo_f32, decoding):
    """The same prompt after 5 other requests resumes from the prompt cache one token
    before its end (whatever is left in the live session), and cached_tokens says so."""
    from monolith.runtime.events import GenerationRequest

    engine = serve_engine(demo_f32, *decoding)
    tok = engine.tokenizer
    try:
        def send(text, system=None):
            messages = ([{"role": "system", "content": system}] if system else []) + [
                {"role": "user", "content": text}]
            ids = tok.encode_chat(messages)
            _, finished = engine.run_request(GenerationRequest(tuple(ids), 8, boundaries=tuple(tok.message_ends(ids))))
            return ids, finished

        ids, first = send("What does os.path.join do?", "Be brief.")
        for text in ["Write a function that reverses a list.", "What is a tuple?", "How do I sort a dict?",
                     "Explain context managers.", "What is a generator?"]:
            send(text)
        _, again = send("What does os.path.join do?", "Be brief.")
        assert again.usage.cached_tokens == len(ids) - 1
        assert again.token_ids == first.token_ids
    finally:
        engine.close()
