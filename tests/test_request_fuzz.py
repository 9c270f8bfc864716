"""Property-based fuzzing of every API's request bodies (issue 48): bodies drawn from the
published schemas (the Open Responses OpenAPI document; the `openai` and `anthropic` SDKs'
request types: bench/request_strategies.py), half of them with a value of the wrong JSON
type at one of their paths, sent to a live server whose engine 'generates' a fixed short
reply. No body may get a 5xx, and every 4xx names a path (`param`; Anthropic's message).
A few dozen bodies per endpoint here; bench/schema_fuzz.py sends 10,000 and more."""

from __future__ import annotations

import httpx
import pytest
from hypothesis import HealthCheck, Phase, given, settings
from serving_rig import MAX_CONTEXT, NAME, Scripted, Server

from bench.request_strategies import ENDPOINTS, bodies, names_a_path
from monolith.runtime.engine import Engine, Limits

EXAMPLES = 40  # per endpoint: a few seconds in all


@pytest.fixture(scope="module")
def server(model, tok):
    with Server(lambda: Engine(model, tok, Limits(max_context=MAX_CONTEXT), decoder=Scripted(tok.encode("Hi!")))) as s:
        s.wait_ready()
        with httpx.Client(base_url=s.url, timeout=60) as http:
            s.http = http
            yield s


def check(server, endpoint: str, body: dict, path) -> None:
    response = server.http.post(endpoint, json=body)
    assert response.status_code < 500, (endpoint, body, path, response.text[:500])
    if 400 <= response.status_code < 500:
        assert names_a_path(endpoint, body, response.json()), (endpoint, body, path, response.text[:500])


@pytest.mark.parametrize("endpoint", ENDPOINTS)
def test_no_generated_body_is_a_5xx_and_every_4xx_names_a_path(server, endpoint):
    @settings(max_examples=EXAMPLES, database=None, deadline=None, derandomize=True,
              phases=[Phase.explicit, Phase.generate, Phase.shrink],
              suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.filter_too_much])
    @given(bodies(endpoint, NAME))
    def run(case):
        check(server, endpoint, *case)

    run()
