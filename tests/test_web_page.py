"""The chat page at `/` (docs/serving.md, "The chat page"; monolith/serving/page.py and
static/): its files, policy and access, and, in Chromium (tests/web_rig.py), chatting:
a streamed reply, stop, edit and regenerate, settings, the key prompt, conversations,
a server without the speculation field. Servers run on the tiny synthetic target with
serving_rig's Scripted decoder (a known reply, slow where a test stops it); the
references are the official SDK's reply, the server's own prompt encoding of the
conversation (the cold request) and its /metrics. Screenshots land in tmp_path."""

from __future__ import annotations

import json
import re
from pathlib import Path

import httpx
import pytest
from serving_rig import MAX_CONTEXT, NAME, Recording, Scripted, Server
from web_rig import (
    close,
    current_messages,
    expect,
    open_page,
    send,
    set_setting,
    settle,
    wait_for,
)

from monolith.runtime.engine import Engine, Limits
from monolith.serving.page import POLICY, STATIC, shipped_files

REPLY = ("<think>\nweighing it\n</think>\n\nHello **world**. <img src=\"data:,\" onerror=\"window.pwned=1\">"
         "<script>window.pwned=2</script>\n\n```python\nprint(1)\n```\n")
SLOW = " word" * 2000
CANCELLED = 'monolith_request_finished_total{finish_reason="cancelled"}'


# ------------------------------------------------------------------ servers


@pytest.fixture(scope="module")
def scripted(model, tok):
    """A server whose engine records its requests and always answers REPLY."""
    decoder = Scripted(tok.encode(REPLY), per_token=0.01)
    with Server(lambda: Recording(model, tok, Limits(max_context=MAX_CONTEXT), decoder=decoder)) as s:
        s.wait_ready()
        s.engine = s.app.state.monolith.engine
        yield s


@pytest.fixture(scope="module")
def slow(model, tok):
    """Replies long enough to stop: 2000 tokens, 20 ms each."""
    with Server(lambda: Recording(model, tok, Limits(max_context=60000),
                                  decoder=Scripted(tok.encode(SLOW), per_token=0.02))) as s:
        yield s.wait_ready()


# ------------------------------------------------------------------ the page as files


def test_the_page_is_served_without_the_key_under_a_policy_of_its_own_origin(model, tok):
    with Server(lambda: Recording(model, tok, Limits(max_context=MAX_CONTEXT), decoder=Scripted(tok.encode("ok"))),
                api_key="s3cret") as s:
        page = httpx.get(s.url + "/")
        assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
        policy = dict(part.strip().split(" ", 1) for part in page.headers["content-security-policy"].split(";"))
        assert policy["default-src"] == "'self'" and policy["connect-src"] == "'self'"
        assert policy["script-src"] == "'self'" and page.headers["content-security-policy"] == POLICY
        for src in re.findall(r'(?:src|href)="([^"]+)"', page.text):
            assert src.startswith(("/static/", "data:")), src
            if src.startswith("/static/"):
                assert httpx.get(s.url + src).status_code == 200, src
        assert httpx.get(s.url + "/static/vendor/README.md").status_code == 404  # only the page's files
        assert httpx.get(s.url + "/static/../page.py").status_code == 404
        assert httpx.get(s.url + "/", headers={"Host": "evil.example"}).status_code == 403  # DNS rebinding
        assert httpx.get(s.url + "/v1/models").status_code == 401
        # the page's own origin may call the API (with the key)
        own = {"Origin": s.url, "Authorization": "Bearer s3cret"}
        assert httpx.post(s.url + "/v1/chat/completions", headers=own,
                          json={"messages": [{"role": "user", "content": "hi"}]}).status_code == 200


def test_an_installed_wheel_carries_every_page_file():
    tomllib = pytest.importorskip("tomllib", reason="Python 3.11's tomllib reads pyproject.toml")
    data = tomllib.loads((Path(__file__).parents[1] / "pyproject.toml").read_text())
    package = STATIC.parents[1]  # monolith/
    packaged = {path for pattern in data["tool"]["setuptools"]["package-data"]["monolith"]
                for path in package.glob(pattern) if path.is_file()}
    wanted = {path for path in STATIC.rglob("*") if path.is_file()}
    assert wanted and wanted <= packaged, sorted(str(p) for p in wanted - packaged)
    assert {"index.html", "app.js", "style.css", "vendor/marked.umd.js", "vendor/purify.min.js",
            "vendor/highlight.min.js"} <= set(shipped_files())


# ------------------------------------------------------------------ chatting


def test_a_streamed_reply_renders_markdown_code_and_reasoning_but_no_script(browser, scripted, tmp_path):
    page = open_page(browser, scripted)
    send(page, "Say hello")
    settle(page)
    reply = page.locator(".message.assistant").last
    expect(reply.locator(".content strong")).to_have_text("world")
    expect(reply.locator(".content pre code.hljs")).to_contain_text("print(1)")
    assert reply.locator(".content script, .content [onerror]").count() == 0
    assert page.evaluate("window.pwned") is None
    # the reasoning: dimmed, closed once the answer came, opened by a click
    reasoning = reply.locator("details.reasoning")
    expect(reasoning.locator(".reasoning-text")).to_have_text("weighing it\n")
    assert reasoning.evaluate("d => d.open") is False
    reasoning.locator("summary").click()
    assert reasoning.evaluate("d => d.open") is True
    messages = current_messages(page)
    assert [m["role"] for m in messages] == ["user", "assistant"]
    assert messages[1]["chunks"] > 1 and messages[1]["finish"] == "stop"  # it came in pieces
    sdk = scripted.client().chat.completions.create(model=NAME, messages=[{"role": "user", "content": "Say hello"}])
    assert messages[1]["content"] == sdk.choices[0].message.content
    assert messages[1]["stats"]["usage"] == sdk.usage.model_dump(exclude_none=True)
    close(page, tmp_path, "reply")


def test_stop_aborts_the_request_and_the_server_cancels_it(browser, slow, tmp_path):
    page = open_page(browser, slow)
    before = slow.metric(CANCELLED)
    send(page, "Go on and on")
    expect(page.locator(".message.assistant .content")).to_contain_text("word word")
    page.click("#stop")
    settle(page)
    expect(page.locator(".message.assistant .meta")).to_have_text("stopped")
    wait_for(lambda: slow.metric(CANCELLED) == before + 1, "the server finished the request as cancelled")
    wait_for(lambda: slow.metric("monolith_num_requests_running") == 0, "the slot freed")
    kept = current_messages(page)[1]["content"]
    assert kept and SLOW.startswith(kept) and len(kept) < len(SLOW)  # what came before the stop stays
    close(page, tmp_path, "stopped")


def test_edit_and_regenerate_resend_the_conversation_as_a_cold_request(browser, scripted, tok, tmp_path):
    page = open_page(browser, scripted)
    send(page, "First question")
    settle(page)
    send(page, "Second question")
    settle(page)
    first_reply = current_messages(page)[1]["content"]
    # edit the second question: the history after it goes, the edited turn is sent
    page.locator(".message.user").nth(1).locator("button.edit").click()
    page.fill(".message.user textarea.editing", "Second question, edited")
    page.click("button.save-edit")
    settle(page)
    messages = current_messages(page)
    assert [m["content"] for m in messages[::2]] == ["First question", "Second question, edited"]
    assert len(messages) == 4
    cold = [{"role": "user", "content": "First question"}, {"role": "assistant", "content": first_reply},
            {"role": "user", "content": "Second question, edited"}]
    assert list(scripted.engine.submitted[-1].prompt_ids) == tok.encode_chat(cold)
    # regenerate the first answer: everything after the first question goes
    page.locator(".message.assistant").first.locator("button.regenerate").click()
    settle(page)
    assert len(current_messages(page)) == 2 and page.locator(".message").count() == 2
    assert list(scripted.engine.submitted[-1].prompt_ids) == tok.encode_chat(cold[:1])
    close(page, tmp_path, "edited")


def test_settings_reach_the_request(browser, scripted, tok, tmp_path):
    page = open_page(browser, scripted)
    set_setting(page, "set-system", "Be brief.")
    set_setting(page, "set-thinking", False)
    set_setting(page, "set-temperature", 0.5)
    set_setting(page, "set-max-tokens", 7)
    send(page, "Hi")
    settle(page)
    request = scripted.engine.submitted[-1]
    want = tok.encode_chat([{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}],
                           enable_thinking=False)
    assert list(request.prompt_ids) == want
    assert request.params.temperature == 0.5 and request.max_tokens == 7
    page.reload()  # the settings are kept
    assert page.input_value("#set-max-tokens") == "7" and not page.is_checked("#set-thinking")
    close(page, tmp_path, "settings")


def test_a_key_is_asked_for_on_a_401_kept_and_sent(browser, model, tok, tmp_path):
    with Server(lambda: Engine(model, tok, Limits(max_context=MAX_CONTEXT), decoder=Scripted(tok.encode("Keyed."))),
                api_key="s3cret") as s:
        s.wait_ready()
        page = open_page(browser, s)
        expect(page.locator("#key-dialog")).to_be_visible()  # /v1/models answered 401
        page.fill("#key-input", "s3cret")
        page.press("#key-input", "Enter")
        expect(page.locator("#model-pick")).to_have_value(NAME)
        send(page, "Hi")
        settle(page)
        expect(page.locator(".message.assistant .content")).to_have_text("Keyed.")
        assert page.evaluate("localStorage.getItem('monolith.apiKey')") == "s3cret"
        close(page, tmp_path, "keyed")


def test_conversations_are_kept_renamed_deleted_exported_and_imported(browser, scripted, tmp_path):
    page = open_page(browser, scripted)
    send(page, "Remember me")
    settle(page)
    page.reload()
    expect(page.locator(".message.user .user-text")).to_have_text("Remember me")
    page.click("#new-chat")
    assert page.locator(".message").count() == 0 and page.locator("#conversations li").count() == 2
    page.once("dialog", lambda d: d.accept("Kept chat"))
    page.locator("#conversations li", has_text="Remember me").locator("button.rename").click()
    expect(page.locator("#conversations li .title")).to_have_text(["New chat", "Kept chat"])
    with page.expect_download() as download:
        page.click("#export")
    exported = tmp_path / "export.json"
    download.value.save_as(exported)
    data = json.loads(exported.read_text())
    assert [c["title"] for c in data["conversations"]] == ["New chat", "Kept chat"]
    page.once("dialog", lambda d: d.accept())
    page.locator("#conversations li", has_text="Kept chat").locator("button.delete").click()
    expect(page.locator("#conversations li .title")).to_have_text(["New chat"])
    page.once("dialog", lambda d: d.accept())  # "Imported 2 conversations."
    page.set_input_files("#import", str(exported))
    expect(page.locator("#conversations li .title")).to_have_text(["New chat", "New chat", "Kept chat"])
    page.locator("#conversations li", has_text="Kept chat").click()
    expect(page.locator(".message.user .user-text")).to_have_text("Remember me")
    close(page, tmp_path, "conversations")


def test_a_server_without_the_speculation_field_still_chats(browser, scripted, tmp_path):
    """A server that refuses `monolith` (a 400 naming it) is asked again without it,
    and the page leaves it out from then on."""
    page = open_page(browser, scripted)
    bodies = []

    def refuse_the_extension(route):
        body = json.loads(route.request.post_data)
        bodies.append(body)
        if "monolith" in body:
            route.fulfill(status=400, content_type="application/json", body=json.dumps({"error": {
                "message": "unsupported field: monolith", "type": "invalid_request_error", "param": "monolith",
                "code": None}}))
        else:
            route.continue_()

    page.route("**/v1/chat/completions", refuse_the_extension)
    for text in ("One", "Two"):
        send(page, text)
        settle(page)
    assert ["monolith" in body for body in bodies] == [True, False, False]
    assert [m["finish"] for m in current_messages(page)[1::2]] == ["stop", "stop"]
    close(page, tmp_path, "no-extension")


def test_the_model_picker_lists_the_configured_models_and_sends_the_pick(browser, model, tok, tmp_path):
    """Two models configured: the picker lists both, the second "(not loaded)"; picked, it
    names the request's model, which loads it and answers with its own reply."""
    from monolith.serving.models import ModelPool, ModelSpec

    engines = {}

    def load(name, text):
        def make():
            engines[name] = Recording(model, tok, Limits(max_context=MAX_CONTEXT), decoder=Scripted(tok.encode(text)))
            return engines[name]
        return make

    pool = ModelPool([ModelSpec(("first",), load("first", "From the first.")),
                      ModelSpec(("second",), load("second", "From the second."))])
    with Server(pool, model_names=pool.names()) as s:
        s.wait_ready()
        page = open_page(browser, s)
        options = page.locator("#model-pick option")
        expect(options).to_have_text(["first", "second (not loaded)"])
        expect(page.locator("#model-pick")).to_have_value("first")
        page.select_option("#model-pick", "second")
        send(page, "Hi")
        settle(page)
        expect(page.locator(".message.assistant .content")).to_have_text("From the second.")
        assert len(engines["second"].submitted) == 1 and engines["first"].submitted == []
        page.focus("#model-pick")  # the loaded states as they are now
        expect(options).to_have_text(["first", "second"])
        close(page, tmp_path, "two models")
