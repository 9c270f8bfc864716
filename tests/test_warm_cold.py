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

import httpx
import pytest
from serving_rig import Server

from monolith import launch
from monolith.pack.demo import bundle_dir
from monolith.serve import build_parser

TURN1 = [{"role": "user", "content": "What does os.path.join do?"}]
MAX_TOKENS = 24


def serve_engine(loaded, *argv, **kw):
    """An Engine made as `python -m monolith.serve ARGV` makes it, on already loaded
    models (the demo pair's: no pack is read again)."""
    model, drafter, _ = loaded
    args = build_parser().parse_args(["--dtype", "float32", "--no-warmup", "--max-context", "1024", *argv])
    draft = None if "--no-draft" in argv else "the demo draft"
    sources = launch.Sources(bundle_dir() / "target", draft)
    return launch.load_engine(args, launch.plan_model(args), lambda line: None, sources=sources,
                              load=lambda *a, **k: model, load_draft=lambda *a, **k: drafter, **kw)


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
    warm server answers as a cold one does (before the fix: a 400 "a checkpoint of N
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
