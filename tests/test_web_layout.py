"""The chat page on a narrow screen (420 px: the sidebar folds away, nothing is clipped),
the status tab's plots from the server's kept minutes on first open, and drafting on
request where the server decodes plainly (docs/serving.md, "The chat page"), in Chromium
(tests/web_rig.py). Screenshots land in tmp_path."""

from __future__ import annotations

import time

import httpx
import pytest
from oracles import GreedyOracle, plain_greedy
from serving_rig import MAX_CONTEXT, Recording, Scripted, Server
from web_rig import close, expect, open_page, send, set_setting, settle

from monolith.runtime.decoder import Decoder
from monolith.runtime.engine import Drafting, Limits
from monolith.serving.metrics import PLOTTED

WIDTH = 420
ASK = "Draft for me"


@pytest.fixture(scope="module")
def scripted(model, tok):
    with Server(lambda: Recording(model, tok, Limits(max_context=MAX_CONTEXT),
                                  decoder=Scripted(tok.encode("Hello **world**."), per_token=0.01))) as s:
        s.wait_ready()
        s.engine = s.app.state.monolith.engine
        yield s


@pytest.fixture(scope="module")
def plain_with_a_drafter(model, tok):
    """Plain decoding, with a drafter for requests that ask (monolith.draft): an oracle
    that knows the target's greedy reply to ASK, so drafted rounds accept."""
    prompt = tok.encode_chat([{"role": "user", "content": ASK}])
    oracle = GreedyOracle(prompt, plain_greedy(model, prompt, 64, MAX_CONTEXT), model.args.vocab_size)
    with Server(lambda: Recording(model, tok, Limits(max_context=MAX_CONTEXT),
                                  drafting=Drafting(on_request=Decoder(model, oracle, MAX_CONTEXT),
                                                    on_request_name="oracle"))) as s:
        s.wait_ready()
        s.engine = s.app.state.monolith.engine
        yield s


def inside(page, selector) -> list[str]:
    """The elements of `selector` that reach past the viewport's width (clipped)."""
    boxes = [(page.locator(selector).nth(i).inner_text(), page.locator(selector).nth(i).bounding_box())
             for i in range(page.locator(selector).count())]
    assert boxes, selector
    return [text for text, box in boxes if box is None or box["x"] < 0 or box["x"] + box["width"] > WIDTH + 0.5]


def test_at_420_px_the_sidebar_folds_away_and_nothing_is_clipped(browser, scripted, tmp_path):
    page = open_page(browser, scripted, width=WIDTH, height=800)
    expect(page.locator("#sidebar")).to_be_hidden()
    page.click("#toggle-sidebar")
    expect(page.locator("#sidebar")).to_be_visible()
    page.screenshot(path=str(tmp_path / "narrow-sidebar.png"))
    page.click("#toggle-sidebar")
    expect(page.locator("#sidebar")).to_be_hidden()
    send(page, "Hi")
    settle(page)
    expect(page.locator("#strip")).to_be_visible()
    assert inside(page, "#tabs button:visible") == [] and inside(page, "#strip .legend span") == []
    assert page.evaluate("document.documentElement.scrollWidth") <= WIDTH
    page.click("#tabs button[data-tab=status]")
    expect(page.locator("#chart-tok-s polyline")).to_have_count(1)
    assert inside(page, ".chart") == [] and page.evaluate("document.documentElement.scrollWidth") <= WIDTH
    close(page, tmp_path, "narrow")


def test_the_status_tab_opens_with_the_minutes_the_server_kept(browser, scripted, tmp_path):
    history = scripted.app.state.monolith.history
    history.samples.clear()
    now = time.monotonic()
    for i in range(6):  # 12 s of an earlier load: 50 tok/s, 3 requests waiting
        history.add({"monolith_generation_tokens_total": 100.0 * i, "monolith_num_requests_waiting": 3.0,
                     "monolith_num_requests_running": 1.0}, at=now - 12 + 2 * i)
    kept = httpx.get(scripted.url + "/metrics/history").json()
    assert kept["interval_seconds"] == 2 and len(kept["samples"]) >= 6
    assert set(kept["samples"][0]["values"]) <= set(PLOTTED)
    page = open_page(browser, scripted)
    page.click("#tabs button[data-tab=status]")
    expect(page.locator("#chart-tok-s polyline")).to_have_count(1)
    assert len(page.locator("#chart-tok-s polyline").get_attribute("points").split()) >= 6  # at once, not after 12 s
    expect(page.locator("#chart-queue .axis")).to_have_text("max 3")
    close(page, tmp_path, "status-history")


def test_a_plain_server_with_a_drafter_drafts_the_page_by_default(browser, plain_with_a_drafter, tmp_path):
    server = plain_with_a_drafter
    page = open_page(browser, server)
    page.click("#tabs button[data-tab=settings]")
    expect(page.locator("#set-draft")).to_be_checked()
    expect(page.locator("#draft-note")).to_contain_text("decodes plainly")
    expect(page.locator("#draft-note")).to_contain_text("slower")
    page.screenshot(path=str(tmp_path / "draft-setting.png"))
    set_setting(page, "set-temperature", 0)  # the oracle knows the greedy reply
    set_setting(page, "set-max-tokens", 24)
    send(page, ASK)
    settle(page)
    assert server.engine.submitted[-1].draft is True
    expect(page.locator(".message.assistant .content .tok-accepted").first).to_be_visible()
    page.click("#tabs button[data-tab=settings]")  # turned off: kept, and sent
    page.set_checked("#set-draft", False)
    page.reload()
    expect(page.locator("body")).to_have_attribute("data-ready", "true")
    page.click("#tabs button[data-tab=settings]")
    expect(page.locator("#set-draft")).not_to_be_checked()
    page.click("#tabs button[data-tab=chat]")
    send(page, ASK)
    settle(page)
    assert server.engine.submitted[-1].draft is False
    close(page, tmp_path, "drafted")


def test_a_server_without_a_drafter_leaves_draft_off(browser, scripted, tmp_path):
    page = open_page(browser, scripted)
    page.click("#tabs button[data-tab=settings]")
    expect(page.locator("#set-draft")).to_be_disabled()
    expect(page.locator("#draft-note")).to_contain_text("holds no drafter")
    page.click("#tabs button[data-tab=chat]")
    send(page, "Hi")
    settle(page)
    assert scripted.engine.submitted[-1].draft is False
    close(page, tmp_path, "no-drafter")
