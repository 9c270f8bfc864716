"""Image parts on every API (docs/serving.md, "Images"; monolith/serving/images.py): each
API through its official SDK with a PNG data URL hands the engine the prompt ids with
one `<|image_pad|>` run per image and the prepared images in prompt order; the real
Qwen3.5 template's prompt ids match the ids its tokenizer would give (the vision tokens
as added special tokens, each pad expanded); token counting counts image tokens; limits,
URLs without --allow-image-urls, video parts and a text-only server are 400s naming the
part; a compaction keeps the images of the user messages it keeps."""

from __future__ import annotations

import base64
import http.server
import io
import shutil
import struct
import threading
import zlib
from pathlib import Path

import anthropic
import pytest
from openresponses_spec import check_response
from PIL import Image
from serving_rig import MAX_CONTEXT, NAME, Recording, Server, assert_error
from tokenizers import Tokenizer as RawTokenizer

from monolith.models.image_inputs import prepare_image
from monolith.runtime.engine import Limits
from monolith.serving.images import IMAGE_MARK, ImageLimits, ImageLoader, prompt_ids
from monolith.serving.responses.compact import input_parts
from monolith.serving.responses.items import items_to_messages
from monolith.tokenizer import load_tokenizer

QWEN_TEMPLATE = Path(__file__).parent / "data" / "qwen3.5" / "chat_template.jinja"
# the Open Responses compliance suite's `image-input` request: a red heart icon, 32 x 32
HEART = ("data:image/png;base64,iVBORw0KGgoAAAANSUhEUgAAACAAAAAgCAIAAAD8GO2jAAABmklEQVR42tyWAaTyUBzFew/eG4AHz+"
         "MBSAHKBiJRGFKwIgQQJKLUIioBIhCAiCAAEizAQIAECaASqFFJq84nudjnaqvuPnxzgP9xfrq5938csPn7PwHTKSoViCIEAYEAMh"
         "moKsU2mUCWEQqB5xEMIp/HaGQG2G6RSuH9HQ7H34rFrtPbdz4jl6PbwmEsl3QA1mt4vcRKk8dz9eg6IpF7tt9fzGY0gCgafFRFo5"
         "Blc5vLhf3eCOj1yNhM5GRMVK0aATxPZoz09YXjkQDmczJgquGQAPp9WwCNBgG027YACgUC6HRsAZRKBDAY2AJoNv/ZnwzA6WSczn"
         "G3p4UAymXGAEkyXrTFAh8fLAGqagQAyGaZpYsi7bHTNPz8MEj//LxuFPo+UBS8vb0KaLXubrRa7aX0RMLCykwmn0z3+XA4WACcTp"
         "Ckh9MFAZpmuVXo+mO/w+/HZvNgbblcUCxaSo/Hyck80Yu6XXDcvfVZr79cvMZjuN2U9O9vKAqjZrfbIZ0mV4TUi9Xqz6jddNy//7"
         "+e3n8Fhf/Llo2kxi8AQyGRoDkmAhAAAAAASUVORK5CYII=")


def png(width: int, height: int, color=(200, 30, 30)) -> bytes:
    out = io.BytesIO()
    Image.new("RGB", (width, height), color).save(out, format="PNG")
    return out.getvalue()


def data_url(data: bytes) -> str:
    return "data:image/png;base64," + base64.b64encode(data).decode()


RED, BLUE = png(40, 30), png(64, 56, (20, 40, 220))


def huge_png() -> bytes:
    """A PNG whose header says 9000 x 9000 pixels (over MAX_SOURCE_PIXELS), a few bytes long."""
    small = png(8, 8)
    ihdr = b"IHDR" + struct.pack(">II", 9000, 9000) + small[24:29]
    return small[:12] + ihdr + struct.pack(">I", zlib.crc32(ihdr)) + small[33:]


def pad_runs(ids, vision) -> list[int]:
    """The lengths of the <|image_pad|> runs, each checked to sit between vision_start and vision_end."""
    runs, i = [], 0
    while i < len(ids):
        if ids[i] != vision.image_token_id:
            i += 1
            continue
        j = i
        while j < len(ids) and ids[j] == vision.image_token_id:
            j += 1
        assert ids[i - 1] == vision.vision_start_id and ids[j] == vision.vision_end_id
        runs.append(j - i)
        i = j
    return runs


def expected_ids(tok, vision, messages, images, **kw) -> list[int]:
    """The rendered text's pieces between image marks, encoded, with each image's ids between them."""
    pieces = tok.apply_chat_template(messages, **kw).split(IMAGE_MARK)
    ids = tok.encode(pieces[0], add_special_tokens=False)
    for data, piece in zip(images, pieces[1:], strict=True):
        tokens = prepare_image(data, vision.settings).tokens
        ids += [vision.vision_start_id] + [vision.image_token_id] * tokens + [vision.vision_end_id]
        ids += tok.encode(piece, add_special_tokens=False)
    return ids


def last(server):
    return server.engine.submitted[-1]


def digests(request) -> list[str]:
    return [image.digest for image in request.images]


def claude(server) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=server.url, api_key="none", max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def limited_server(model, tok, vision):
    """Images of at most 2000 bytes, 2 a request; http(s) image URLs fetched."""
    limits = ImageLimits(max_bytes=2000, max_images=2, allow_urls=True, fetch_timeout=5)
    with Server(lambda: Recording(model, tok, Limits(max_context=MAX_CONTEXT), vision=vision), images=limits) as s:
        s.wait_ready()
        s.engine = s.app.state.monolith.engine
        yield s


@pytest.fixture(scope="module")
def image_site():
    """An http server on 127.0.0.1 serving /red.png and /big.png (over 2000 bytes)."""
    files = {"/red.png": RED, "/big.png": RED + b"\0" * 4000}

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            body = files.get(self.path)
            self.send_response(200 if body else 404)
            self.end_headers()
            self.wfile.write(body or b"")

        def log_message(self, *args):
            pass

    site = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=site.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{site.server_address[1]}"
    site.shutdown()


# ------------------------------------------------------------------ prompt ids


def test_prompt_ids_of_the_real_template_are_its_tokenizers(tmp_path, tok, vision):
    """The Qwen3.5 template renders a user image and a tool-result image; the ids equal
    the tokenizer's own encoding of the whole text with the vision tokens as added
    special tokens, each pad expanded, and the message boundaries fall after each end of turn."""
    folder = tmp_path / "qwen"
    folder.mkdir()
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        shutil.copy(tok.path / name, folder)
    shutil.copy(QWEN_TEMPLATE, folder / "chat_template.jinja")
    qwen = load_tokenizer(folder)
    call = {"id": "c1", "type": "function", "function": {"name": "shot", "arguments": {}}}
    messages = [{"role": "user", "content": [{"type": "text", "text": "What is this?"},
                                             {"type": "image", "image": data_url(RED), "param": "a"}]},
                {"role": "assistant", "content": "", "tool_calls": [call]},
                {"role": "tool", "tool_call_id": "c1", "content": [{"type": "image", "image": data_url(BLUE),
                                                                   "param": "b"}]}]
    text = qwen.apply_chat_template(messages)
    images = ImageLoader(vision, ImageLimits()).of(messages)
    ids = prompt_ids(qwen, text, images, vision)

    raw = RawTokenizer.from_file(str(folder / "tokenizer.json"))
    raw.add_special_tokens(["<|vision_start|>", "<|image_pad|>", "<|vision_end|>"])
    start, pad, end = (raw.token_to_id(t) for t in ("<|vision_start|>", "<|image_pad|>", "<|vision_end|>"))
    tokens = iter(image.tokens for image in images)
    reference = []
    for t in raw.encode(text, add_special_tokens=False).ids:
        reference += {start: [vision.vision_start_id], end: [vision.vision_end_id]}.get(
            t, [vision.image_token_id] * next(tokens) if t == pad else [t])
    assert ids == reference and pad_runs(ids, vision) == [prepare_image(RED, vision.settings).tokens,
                                                          prepare_image(BLUE, vision.settings).tokens]
    ends = qwen.message_ends(ids)
    assert len(ends) == text.count("<|im_end|>") and all(ids[e - 1] == qwen.token_to_id("<|im_end|>") for e in ends)


# ------------------------------------------------------------------ each API through its SDK


def test_chat_image_url(vision_server, tok, vision):
    messages = [{"role": "user", "content": [{"type": "text", "text": "Describe "},
                                             {"type": "image_url", "image_url": {"url": data_url(RED),
                                                                                 "detail": "low"}},
                                             {"type": "text", "text": " briefly."}]}]
    reply = vision_server.client().chat.completions.create(model=NAME, messages=messages, max_tokens=1)
    sent = last(vision_server)
    rendered = [{"role": "user", "content": [{"type": "text", "text": "Describe "}, {"type": "image"},
                                             {"type": "text", "text": " briefly."}]}]
    assert list(sent.prompt_ids) == expected_ids(tok, vision, rendered, [RED])
    assert digests(sent) == [prepare_image(RED, vision.settings).digest]
    assert reply.usage.prompt_tokens == len(sent.prompt_ids)
    assert list(sent.boundaries) == tok.message_ends(sent.prompt_ids)


def test_messages_image_blocks_and_count_tokens(vision_server, tok, vision):
    """A user image (base64) and a screenshot in a tool_result, in prompt order;
    count_tokens counts the same prompt."""
    body = {"model": NAME, "messages": [
        {"role": "user", "content": [{"type": "image", "source": {"type": "base64", "media_type": "image/png",
                                                                  "data": base64.b64encode(RED).decode()}},
                                     {"type": "text", "text": "Take a screenshot."}]},
        {"role": "assistant", "content": [{"type": "tool_use", "id": "toolu_1", "name": "shot", "input": {}}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1", "content": [
            {"type": "text", "text": "here"},
            {"type": "image", "source": {"type": "base64", "media_type": "image/png",
                                         "data": base64.b64encode(BLUE).decode()}}]}]}],
        "tools": [{"name": "shot", "input_schema": {"type": "object", "properties": {}}}]}
    client = claude(vision_server)
    client.messages.create(**body, max_tokens=1)
    sent = last(vision_server)
    assert digests(sent) == [prepare_image(data, vision.settings).digest for data in (RED, BLUE)]
    assert pad_runs(sent.prompt_ids, vision) == [image.tokens for image in sent.images]
    assert client.messages.count_tokens(**body).input_tokens == len(sent.prompt_ids)
    # context editing clears the old tool result, its image with it
    edits = {"edits": [{"type": "clear_tool_uses_20250919", "trigger": {"type": "tool_uses", "value": 0},
                        "keep": {"type": "tool_uses", "value": 0}}]}
    client.beta.messages.create(**body, max_tokens=1, context_management=edits,
                                betas=["context-management-2025-06-27"])
    assert digests(last(vision_server)) == digests(sent)[:1]


def test_responses_input_image(vision_server, vision):
    """The Open Responses `image-input` request, with a function_call_output's image and a
    follow-up on the stored response; input_tokens counts the same prompt."""
    client = vision_server.client()
    first = [{"type": "message", "role": "user", "content": [
        {"type": "input_text", "text": "What do you see in this image? Answer in one sentence."},
        {"type": "input_image", "image_url": HEART}]}]
    raw = client.responses.with_raw_response.create(model=NAME, input=first, max_output_tokens=2)
    check_response(raw.http_response.json())
    reply = raw.parse()
    heart = last(vision_server)
    assert len(heart.images) == 1 and pad_runs(heart.prompt_ids, vision) == [heart.images[0].tokens]
    more = [{"type": "function_call", "call_id": "call_1", "name": "shot", "arguments": "{}"},
            {"type": "function_call_output", "call_id": "call_1", "output": [
                {"type": "input_image", "image_url": data_url(BLUE), "detail": "high"}]}]
    client.responses.create(model=NAME, input=more, previous_response_id=reply.id, max_output_tokens=1)
    sent = last(vision_server)
    assert digests(sent) == digests(heart) + [prepare_image(BLUE, vision.settings).digest]
    counted = client.responses.input_tokens.count(model=NAME, input=more, previous_response_id=reply.id)
    assert counted.input_tokens == len(sent.prompt_ids)


def test_a_compacted_window_keeps_its_images():
    """The user messages a compaction keeps come back as input parts that read as the same content."""
    sent = [{"role": "user", "content": [{"type": "input_text", "text": "see"},
                                         {"type": "input_image", "image_url": data_url(RED)}]}]
    content = items_to_messages(sent, "input")[0]["content"]
    kept = [{"type": "message", "role": "user", "content": input_parts(content)}]
    assert items_to_messages(kept, "input")[0]["content"] == content and len(content) == 2


# ------------------------------------------------------------------ refusals and limits

CHAT_PART = {"type": "image_url", "image_url": {"url": data_url(RED)}}


def chat_parts(*parts, role="user") -> dict:
    return {"model": NAME, "max_tokens": 1, "messages": [{"role": role, "content": list(parts)}]}


@pytest.mark.parametrize("body, words", [
    (chat_parts({"type": "image_url", "image_url": {"url": "https://example.com/a.png"}}), "--allow-image-urls"),
    (chat_parts({"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}), "not a readable image"),
    (chat_parts({"type": "image_url", "image_url": {"url": "data:image/png;base64,%%%"}}), "malformed"),
    (chat_parts({"type": "image_url", "image_url": {"url": data_url(huge_png())}}), "too large"),
    (chat_parts({"type": "image_url", "image_url": {"url": "ftp://x/a.png"}}), "data: URL"),
    (chat_parts({"type": "video_url", "video_url": {"url": "data:video/mp4;base64,AAAA"}}), "video"),
    (chat_parts({"type": "image_url", "image_url": {"url": "data:video/mp4;base64,AAAA"}}), "video"),
    (chat_parts(CHAT_PART, role="system"), "user messages"),
])
def test_chat_refusals_name_the_part(vision_server, body, words):
    error = assert_error(vision_server.post("/v1/chat/completions", body), 400, "messages[0].content[0]")
    assert words in error["message"]


def test_other_apis_refusals_name_the_part(vision_server):
    url = {"type": "image", "source": {"type": "url", "url": "https://example.com/a.png"}}
    response = vision_server.post("/v1/messages", {"model": NAME, "max_tokens": 1, "messages": [
        {"role": "user", "content": [{"type": "text", "text": "hi"}, url]}]})
    assert response.status_code == 400  # Anthropic's error body names the part in its message
    assert response.json()["error"]["message"].startswith("messages[0].content[1]: image URLs are not fetched")
    for part, words in (({"type": "input_image", "file_id": "file_1"}, "files API"),
                        ({"type": "input_video", "video_url": "data:video/mp4;base64,AAAA"}, "video")):
        body = {"model": NAME, "input": [{"role": "user", "content": [part]}]}
        error = assert_error(vision_server.post("/v1/responses", body), 400, "input[0].content[0]")
        assert words in error["message"]


def test_a_text_only_server_refuses_images(server):
    error = assert_error(server.post("/v1/chat/completions", chat_parts(CHAT_PART)), 400, "messages[0].content[0]")
    assert "takes no images" in error["message"]
    body = {"model": NAME, "messages": [{"role": "user", "content": [
        {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "AAAA"}}]}]}
    response = server.post("/v1/messages/count_tokens", body)
    assert response.status_code == 400 and "takes no images" in response.json()["error"]["message"]


def test_limits_and_fetched_urls(limited_server, image_site, vision):
    small = {"type": "image_url", "image_url": {"url": data_url(RED)}}
    error = assert_error(limited_server.post("/v1/chat/completions", chat_parts(small, small, small)), 400,
                         "messages[0].content[2]")
    assert "at most 2 images" in error["message"]
    big = {"type": "image_url", "image_url": {"url": data_url(RED + b"\0" * 4000)}}
    error = assert_error(limited_server.post("/v1/chat/completions", chat_parts(big)), 400, "messages[0].content[0]")
    assert "at most 2000 bytes" in error["message"]
    fetched = {"type": "image_url", "image_url": {"url": image_site + "/red.png"}}
    assert limited_server.post("/v1/chat/completions", chat_parts(fetched)).status_code == 200
    assert digests(last(limited_server)) == [prepare_image(RED, vision.settings).digest]
    for path, words in (("/big.png", "at most 2000 bytes"), ("/none.png", "could not be fetched")):
        part = {"type": "image_url", "image_url": {"url": image_site + path}}
        error = assert_error(limited_server.post("/v1/chat/completions", chat_parts(part)), 400,
                             "messages[0].content[0]")
        assert words in error["message"]


def test_replies_with_an_image_are_a_cold_engines(vision_server, model, tok, vision):
    """Each API's greedy reply to a message with an image is what a cold engine writes for
    the request the server submitted, and that request's image rows reach the model: the
    same text with another image is another request."""
    from monolith.runtime.engine import Engine

    blue, red = data_url(BLUE), data_url(png(64, 56))  # the same size: the same prompt ids
    client, words = vision_server.client(), "What is in the picture?"
    got = []
    for url in (blue, red):
        parts = [{"type": "text", "text": words}, {"type": "image_url", "image_url": {"url": url}}]
        chat = client.chat.completions.create(model=NAME, max_tokens=6, temperature=0,
                                              messages=[{"role": "user", "content": parts}])
        got.append((chat.choices[0].message, last(vision_server)))
    source = {"type": "base64", "media_type": "image/png", "data": base64.b64encode(BLUE).decode()}
    message = claude(vision_server).messages.create(model=NAME, max_tokens=6, extra_body={"temperature": 0}, messages=[
        {"role": "user", "content": [{"type": "image", "source": source}, {"type": "text", "text": words}]}])
    got.append((message, last(vision_server)))
    parts = [{"type": "input_text", "text": words}, {"type": "input_image", "image_url": blue}]
    response = client.responses.create(model=NAME, max_output_tokens=16, temperature=0,
                                       input=[{"role": "user", "content": parts}])
    got.append((response, last(vision_server)))
    assert digests(got[0][1]) != digests(got[1][1]) and got[0][1].prompt_ids == got[1][1].prompt_ids
    cold = Engine(model, tok, Limits(max_context=MAX_CONTEXT), vision=vision)
    try:
        for reply, request in got:
            text, _ = cold.run_request(request, cold.new_session())
            assert request.images and text == reply_text(reply)
    finally:
        cold.close()


def reply_text(reply) -> str:
    """The whole text an SDK reply carries: reasoning, then content."""
    if hasattr(reply, "output"):  # Responses
        return "".join(part.text for item in reply.output for part in (getattr(item, "content", None) or []))
    if hasattr(reply, "role") and hasattr(reply, "content") and isinstance(reply.content, list):  # Messages
        return "".join(getattr(block, "thinking", "") or getattr(block, "text", "") for block in reply.content)
    return (getattr(reply, "reasoning_content", None) or "") + (reply.content or "")


@pytest.mark.parametrize("payload", [base64.b64encode(b"not an image at all").decode(), "AAAA",
                                     base64.b64encode(b"GIF89a" + b"\0" * 5).decode()])
def test_an_undecodable_data_url_names_the_part_and_the_reason_not_an_object(vision_server, payload):
    """Pillow's own message names its BytesIO object (`<_io.BytesIO object at 0x...>`)."""
    body = chat_parts({"type": "text", "text": "see"},
                      {"type": "image_url", "image_url": {"url": f"data:image/png;base64,{payload}"}})
    error = assert_error(vision_server.post("/v1/chat/completions", body), 400, "messages[0].content[1]")
    assert error["message"].startswith("messages[0].content[1]: not a readable image (")
    assert "BytesIO" not in error["message"] and " at 0x" not in error["message"], error["message"]
