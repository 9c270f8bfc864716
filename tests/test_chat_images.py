"""The terminal chat's images (monolith/chat.py `/image`, monolith/conversation.py): a
tiny synthetic target with its packed vision tower, in-process. References: a cold
engine (warm == cold), the whole conversation run in one chat (/save then /load goes on
the same), the image's own prepare_image."""

from __future__ import annotations

import re

from chat_rig import chat_args, run_chat

from monolith.conversation import Attachment, Conversation
from monolith.runtime.engine import Engine, Limits
from monolith.runtime.events import GenerationRequest


def test_image_goes_with_the_next_message(model, tok, pack, tmp_path):
    """/image attaches a file to the next message: its prompt holds the image's pad run,
    later turns resend it (the session resumes past it), and each reply equals a cold
    engine's for the same prompt and images."""
    from vision_rig import png

    from monolith.models.image_inputs import prepare_image
    from monolith.models.vision import vision_of

    vision = vision_of(pack)
    shot = tmp_path / "shot.png"
    shot.write_bytes(png(3, (40, 72)))
    (tmp_path / "notes.txt").write_text("not an image")
    image = prepare_image(shot.read_bytes(), vision.settings)
    engine = Engine(model, tok, Limits(max_context=1024), vision=vision)
    try:
        chat, text = run_chat(engine, ["/image", f"/image {tmp_path / 'notes.txt'}", f"/image {shot}",
                                       "What is in it?", "And now?"])
        turns = chat.conversation
        assert "usage: /image PATH" in text and "(cannot attach" in text
        assert f"(image 1 attached: shot.png, {image.size[1]}x{image.size[0]} pixels, {image.tokens} tokens" in text
        assert [im.digest for im in turns.images] == [image.digest] and not chat.attached
        pads = [t for t in turns.tokens if t == vision.image_token_id]
        assert len(pads) == image.tokens
        conversation = Conversation(tok, system=chat_args().system, vision=vision)
        warm = engine.new_session()
        replies = []
        for words, attached in (("What is in it?", [Attachment.of(shot.read_bytes(), vision)]), ("And now?", [])):
            prompt = conversation.prompt(words, attached)
            request = GenerationRequest(tuple(prompt), 8,
                                        images=tuple(conversation.images + [a.image for a in attached]))
            _, finished = engine.run_request(request, warm)
            replies.append((request, finished))
            conversation.commit(prompt, finished.token_ids, attached)
        assert conversation.tokens == turns.tokens  # the chat's own turns, token for token
        assert replies[1][1].usage.cached_tokens > turns.tokens.index(vision.image_token_id) + image.tokens
    finally:
        engine.close()
    cold = Engine(model, tok, Limits(max_context=1024), vision=vision)
    try:
        for request, finished in replies:
            assert cold.run_request(request, cold.new_session())[1].token_ids == finished.token_ids
    finally:
        cold.close()
    text_only = Engine(model, tok, Limits(max_context=1024))
    try:
        _, text = run_chat(text_only, [f"/image {shot}"])
    finally:
        text_only.close()
    assert "(this model takes no images" in text


def test_save_then_load_a_conversation_with_an_image(model, tok, pack, tmp_path):
    """/save keeps the conversation's image; /load in a new engine goes on like the whole
    conversation, resuming past the image; a state whose image file changed does not load."""
    import json

    from safetensors import safe_open
    from safetensors.numpy import save_file
    from vision_rig import png

    from monolith.models.vision import vision_of

    vision = vision_of(pack)
    shot, saved = tmp_path / "shot.png", tmp_path / "talk.safetensors"
    shot.write_bytes(png(5, (40, 72)))
    lines = [f"/image {shot}", "What is in it?", "And now?"]

    def chat(script):
        engine = Engine(model, tok, Limits(max_context=1024), vision=vision)
        try:
            return run_chat(engine, script)
        finally:
            engine.close()

    whole, _ = chat(lines)
    first, text = chat(lines[:2] + [f"/save {saved}"])
    assert "(saved 1 turns" in text
    second, text = chat([f"/load {saved}", lines[2]])
    assert f"(loaded 1 turns, {len(first.conversation.tokens)} tokens" in text
    assert second.conversation.tokens == whole.conversation.tokens  # the same reply, token for token
    assert [im.digest for im in second.conversation.images] == [im.digest for im in whole.conversation.images]
    cached = int(re.search(r"prompt \d+ tokens: (\d+) cached", text).group(1))
    assert cached >= len(first.conversation.tokens) - 1  # the image was not prefilled again

    with safe_open(str(saved), "np") as f:
        metadata, tensors = f.metadata(), {name: f.get_tensor(name) for name in f.keys()}
    about = json.loads(metadata["conversation"])
    about["images"] = [base64_png(png(6, (40, 72)))]  # another picture of the same size
    metadata["conversation"] = json.dumps(about)
    save_file(tensors, str(saved), metadata)
    _, text = chat([f"/load {saved}"])
    assert "(cannot load" in text and "not a conversation saved by /save" in text


def base64_png(data: bytes) -> str:
    import base64

    return base64.b64encode(data).decode()
