"""The chat page's speculation display and images in Chromium (docs/serving.md, "The
chat page"; the browser and the page steps: tests/web_rig.py). The drafting server's
oracle drafter knows the target's greedy continuation (tests/oracles.py), so its rounds
accept; the references are the server's /metrics and prepare_image's digest."""

from __future__ import annotations

import pytest
from oracles import GreedyOracle, plain_greedy
from PIL import Image
from serving_rig import MAX_CONTEXT, NAME, Server
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

from monolith.models.image_inputs import prepare_image
from monolith.runtime.decoder import Decoder
from monolith.runtime.engine import Engine, Limits

ASK = "Draft for me"


@pytest.fixture(scope="module")
def drafting(model, tok):
    """A speculative server whose drafter proposes the target's own greedy continuation
    of ASK (tests/oracles.py): every draft token of that conversation is accepted."""
    prompt = tok.encode_chat([{"role": "user", "content": ASK}])
    oracle = GreedyOracle(prompt, plain_greedy(model, prompt, 64, MAX_CONTEXT), model.args.vocab_size)
    with Server(lambda: Engine(model, tok, Limits(max_context=MAX_CONTEXT),
                               decoder=Decoder(model, oracle, MAX_CONTEXT))) as s:
        yield s.wait_ready()


def spec_counters(server):
    return (server.metric("spec_decode_num_drafts_total"), server.metric("spec_decode_num_accepted_tokens_total"))


def test_tokens_are_tinted_by_how_speculation_made_them(browser, drafting, tmp_path):
    page = open_page(browser, drafting)
    set_setting(page, "set-temperature", 0)
    set_setting(page, "set-max-tokens", 24)
    drafts, accepted = spec_counters(drafting)
    send(page, ASK)
    settle(page)
    drafts, accepted = (now - then for now, then in zip(spec_counters(drafting), (drafts, accepted)))
    message = current_messages(page)[1]
    page.screenshot(path=str(tmp_path / "tinted.png"))
    pieces = message["spec"]
    assert "".join(p["text"] for p in pieces if p["part"] == "content") == message["content"]
    reply = page.locator(".message.assistant .content")
    assert reply.locator(".tok-accepted").count() > 0 and reply.locator(".tok-bonus").count() > 0
    assert "".join(reply.locator("span[class^=tok-]").all_text_contents()) == message["content"]
    assert drafts > 0 and message["stats"]["spec"]["rounds"] == drafts
    want = f"{(accepted + drafts) / drafts:.2f} tokens/round ({drafts:.0f} rounds)"
    expect(page.locator("#strip-round")).to_have_text(want)
    assert page.locator("#strip-positions .bar").count() == len(message["stats"]["spec"]["accepted_per_position"])
    close(page, tmp_path, "tinted")


def number(value: float) -> str:
    """As the status tab writes a value (status.js, `formatted`)."""
    for scale, unit, digits in ((1e9, "G", 2), (1e6, "M", 2), (1e3, "k", 1)):
        if value >= scale:
            return f"{value / scale:.{digits}f} {unit}"
    return str(int(value)) if float(value).is_integer() else f"{value:.2f}"


def test_the_status_tab_plots_the_metrics(browser, drafting, tmp_path):
    client = drafting.client()
    client.chat.completions.create(model=NAME, messages=[{"role": "user", "content": ASK}], max_tokens=16,
                                   temperature=0)
    page = open_page(browser, drafting)
    page.click("#tabs button[data-tab=status]")
    expect(page.locator("#chart-tok-s polyline")).to_have_count(1)
    wait_for(lambda: len(page.locator("#chart-tok-s polyline").get_attribute("points").split()) >= 2,
             "a second reading of /metrics")
    drafts, accepted = spec_counters(drafting)
    expect(page.locator("#chart-acceptance .now")).to_have_text(f"tokens/round {number((accepted + drafts) / drafts)}")
    expect(page.locator("#chart-queue polyline")).to_have_count(2)
    cache = drafting.metric("monolith_prompt_cache_bytes")
    expect(page.locator("#chart-cache .now")).to_have_text(f"bytes {number(cache)}")
    close(page, tmp_path, "status")


# ------------------------------------------------------------------ images


def test_an_attached_image_is_shown_and_sent_as_a_data_url(browser, vision_server, vision, tmp_path):
    picture = tmp_path / "red.png"
    Image.new("RGB", (40, 30), (200, 30, 30)).save(picture)
    page = open_page(browser, vision_server)
    set_setting(page, "set-max-tokens", 2)
    page.set_input_files("#attach", str(picture))
    expect(page.locator("#attachments img")).to_have_count(1)
    send(page, "What is this?")
    settle(page)
    expect(page.locator("#attachments img")).to_have_count(0)
    expect(page.locator(".message.user img.thumb")).to_have_count(1)
    request = vision_server.engine.submitted[-1]
    assert [image.digest for image in request.images] == [prepare_image(picture.read_bytes(), vision.settings).digest]
    assert current_messages(page)[0]["images"][0].startswith("data:image/png;base64,")
    close(page, tmp_path, "image")


def test_a_dropped_image_joins_the_message(browser, vision_server, tmp_path):
    page = open_page(browser, vision_server)
    page.evaluate("""async () => {
        const canvas = Object.assign(document.createElement("canvas"), {width: 8, height: 8});
        const blob = await new Promise((resolve) => canvas.toBlob(resolve, "image/png"));
        const drop = new DataTransfer();
        drop.items.add(new File([blob], "dot.png", {type: "image/png"}));
        document.getElementById("composer").dispatchEvent(new DragEvent("drop", {dataTransfer: drop, bubbles: true}));
    }""")
    expect(page.locator("#attachments img")).to_have_count(1)
    page.locator("#attachments button.remove-image").click()
    expect(page.locator("#attachments img")).to_have_count(0)
    close(page, tmp_path, "dropped")
