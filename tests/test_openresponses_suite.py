"""The official Open Responses compliance suite (openresponses/openresponses'
bin/compliance-test.ts, run by bench/openresponses_suite.py) against the demo server: each
of its cases passes, or fails only for what the demo model wrote (a reply that does not
end, text where the case wants a tool call), and the cases no reply decides pass. The
suite is not published on npm: the run needs $OPENRESPONSES_CHECKOUT naming a checkout of
it at the pinned commit, and its runtime installed (tests/clients/install.sh with that
variable set); elsewhere it skips, saying why.

The server caps a reply at 1024 tokens where the request sets no limit (--max-output-tokens;
stock: 32768): a reply that has not ended by then fails its case as one running on to
32768 would (`incomplete`), minutes sooner, so that no non-streamed case meets Bun's 300 s
idle timeout. Also, without the checkout: how the script tells the model's failures from
the server's, on the suite's own messages."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from bench.openresponses_suite import INCOMPLETE, NO_CALL, NO_RESPONSE, PINNED, TIMEOUTS, cause, commit, missing

REPO = Path(__file__).resolve().parents[1]
CHECKOUT = os.environ.get("OPENRESPONSES_CHECKOUT")
# the suite's cases at PINNED (src/lib/compliance-tests.ts)
CASES = ["basic-response", "assistant-phase", "response-output-phase-schema", "streaming-response",
         "websocket-response", "websocket-sequential-responses", "websocket-continuation",
         "websocket-reconnect-store-false-recovery", "websocket-previous-response-not-found",
         "websocket-failed-continuation-evicts-cache", "websocket-compact-new-chain", "system-prompt",
         "tool-calling", "image-input", "multi-turn", "compact-response", "compact-missing-model"]
# cases whose outcome no reply of the model decides: a schema fixture, a refused request, a missing id
MODEL_FREE = {"response-output-phase-schema", "compact-missing-model", "websocket-previous-response-not-found"}


def unrunnable() -> str | None:
    if not CHECKOUT:
        return ("$OPENRESPONSES_CHECKOUT names no checkout of openresponses/openresponses (the suite is not on "
                "npm; bench/openresponses_suite.py says how to run it)")
    problem = missing(Path(CHECKOUT))
    if problem:
        return problem
    found = commit(Path(CHECKOUT))
    if found != PINNED:
        return f"the checkout is at {found}; the expectations here are the suite's at {PINNED}"
    return None


@pytest.fixture(scope="module")
def report(tmp_path_factory) -> dict:
    problem = unrunnable()
    if problem:
        pytest.skip(problem)
    out = tmp_path_factory.mktemp("suite")
    done = subprocess.run([sys.executable, "-m", "bench.openresponses_suite", CHECKOUT,
                           "--server-arg=--max-output-tokens=1024", "--out-dir", str(out)],
                          cwd=REPO, capture_output=True, text=True, timeout=1800, check=False)
    path = out / "openresponses_suite.json"
    assert path.is_file(), done.stdout[-3000:] + done.stderr[-3000:]
    return json.loads(path.read_text())


def test_every_case_of_the_suite_ran(report):
    assert sorted(c["id"] for c in report["cases"]) == sorted(CASES)
    assert {c["status"] for c in report["cases"]} <= {"passed", "failed"}, report["cases"]


@pytest.mark.parametrize("case", CASES)
def test_a_case_fails_only_for_the_models_reply(report, case):
    row = next(c for c in report["cases"] if c["id"] == case)
    if case in MODEL_FREE:
        assert row["status"] == "passed", row["errors"]
    else:
        assert row["status"] == "passed" or row["cause"] == "model", f"{row['cause']}: {row['why']}"


def failed(errors: list[str], response=None) -> dict:
    """A failed case as the suite's --json report writes it."""
    return {"id": "x", "name": "x", "status": "failed", "errors": errors, "response": response}


def reply(status: str, reason: str | None = None, output=()) -> dict:
    return {"object": "response", "status": status, "output": list(output), "usage": {"output_tokens": 1024},
            "incomplete_details": {"reason": reason} if reason else None}


def test_a_reply_that_ran_to_its_limit_is_the_models_failure():
    assert cause(failed([INCOMPLETE], reply("incomplete", "max_output_tokens")), True)[0] == "model"
    # over a WebSocket the response of each turn, the turn named before the error
    assert cause(failed(["Turn 2: " + INCOMPLETE], [reply("completed"), reply("incomplete", "max_output_tokens")]),
                 True)[0] == "model"
    assert cause(failed([INCOMPLETE], reply("incomplete", "content_filter")), True)[0] == "server"


def test_text_or_reasoning_where_a_tool_call_was_wanted_is_the_models_failure():
    text = {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "sunny"}]}
    kind, why = cause(failed([NO_CALL], reply("completed", output=[text])), True)
    assert kind == "model" and "sunny" in why
    assert cause(failed([NO_CALL], reply("incomplete", "max_output_tokens", output=[text])), True)[0] == "model"
    assert cause(failed([NO_CALL], reply("failed")), True)[0] == "server"
    thought = {"type": "reasoning", "content": [{"type": "reasoning_text", "text": "I call get_weather"}]}
    kind, why = cause(failed([NO_CALL], reply("completed", output=[thought])), True)
    assert kind == "model" and "only reasoning" in why and "get_weather" in why
    assert cause(failed([NO_CALL], reply("completed")), True)[0] == "server"  # nothing at all


def test_a_time_out_is_the_models_only_where_the_server_cancelled_as_many_generations():
    for timeout in TIMEOUTS:
        for none in NO_RESPONSE:
            case = failed(["Turn 1: " + timeout, "Turn 1: " + none, "Turn 2: " + none], [None, None])
            assert cause(case, True)[0] == "model"
            assert cause(case, False)[0] == "server"
            assert cause(failed([none]), True)[0] == "server"  # no terminal response, and no time-out


def test_turns_that_never_ran_after_a_time_out_are_the_models_failure_only_when_unanswered():
    # websocket-failed-continuation-evicts-cache: its seed turn timed out, so the turn that
    # should fail and the retry never ran (the suite's session ends at a time-out)
    errors = [TIMEOUTS[0], NO_RESPONSE[0], "Expected second WebSocket continuation turn to fail but got status "
              "no terminal response", "Expected previous_response_not_found after failed continuation eviction "
              "but got no error code"]
    assert cause(failed(errors, [None, None, None]), True)[0] == "model"
    # the seed answered: the turn that should have failed at once ran until the suite gave up
    assert cause(failed(errors, [reply("completed"), None, None]), True)[0] == "server"
    assert cause(failed(errors[2:], [None, None, None]), True)[0] == "server"  # no time-out


def test_any_other_failure_is_the_servers():
    assert cause(failed(["HTTP 500: internal server error"]), True) == ("server", "HTTP 500: internal server error")
    assert cause(failed([]), True)[0] == "server"
    assert cause({"id": "x", "name": "x", "status": "passed", "errors": []}, True) == (None, "")
