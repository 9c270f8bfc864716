"""Images: preprocessing, the vision tower and time to first token with a screenshot, and
what the tower would cost on a Mac (docs/performance.md, "Images").

    python -m bench.vision [--image 1280x800] [--real-image 640x400] [--real-blocks 1]
                           [--repeats 3] [--out-dir bench/results]

The image is a synthetic screenshot drawn here (window chrome, a sidebar, lines of text,
buttons), PNG-encoded; nothing is downloaded.

1. Preprocessing (models/image_inputs.prepare_image: decode, resize, patchify) at the
   demo target's processor settings (packs/demo/target/preprocessor_config.json) and at
   Qwen3.6's (`ImageSettings()`: patch 16, merge 2, 256x256 to 4096x4096 pixels).
2. The vision tower per image: the demo's (1 block, hidden 32) on the screenshot; and at
   Qwen3.6's widths (monolith.synth.presets.QWEN36_VISION, out_hidden the 35B-A3B's
   2048) with random values, float32, on `--real-image` with `--real-blocks` blocks and
   with none. The CPU's BLAS makes a whole 27-block screenshot take minutes here, so the
   screenshot's time is scaled: the no-block part (patch embedding, positions, merger)
   and one block each by their FLOPs on the screenshot over their FLOPs as measured,
   the block times 27. Measured and scaled numbers are reported apart.
3. Time to first token on the demo through the Engine with the screenshot in the
   prompt, against the same text without it: cold (a fresh Engine: the tower runs and
   the prompt is prefilled) and the warm repeat (the prompt cache holds the prompt, the
   tower does not run again: the engine's FeatureCache count says so).
4. The tower on Apple silicon for the screenshot at Qwen3.6's widths: FLOPs counted per
   piece (each attention full within the image), bytes read (BF16 weights once, plus
   an estimate of the activations each op reads and writes), each over the M5 Max
   figures of bench/projection.py; the larger of the two is the floor.

Writes bench/results/vision.json and .md (the tables, also printed).
"""

from __future__ import annotations

import argparse
import io
import math
import os
import random
import statistics
import tempfile
from dataclasses import replace
from pathlib import Path

import mlx.core as mx
from PIL import Image, ImageDraw

from bench.common import RESULTS, corpus_prompts, machine, machine_note, write
from bench.projection import BANDWIDTH, GPU_FLOPS
from monolith.models.image_inputs import ImageSettings, prepare_image
from monolith.models.vision import VisionArgs, expected_shapes, tower_of
from monolith.runtime.calibrate import median_seconds
from monolith.synth.presets import PRESETS, QWEN36_VISION

REAL_OUT_HIDDEN = PRESETS["qwen3.6-35b-a3b"].hidden_size  # the merger's output: the text model's width
TEXT_TOKENS = 96  # prompt text around the image (half before, half after)


def real_args(blocks: int | None = None) -> VisionArgs:
    """Qwen3.6's vision_config (the 35B-A3B's out_hidden), `blocks` deep (default 27)."""
    fields = {k.removeprefix("vision_"): v for k, v in QWEN36_VISION.items()}
    args = VisionArgs(out_hidden_size=REAL_OUT_HIDDEN, **fields)
    return args if blocks is None else replace(args, depth=blocks)


def screenshot(width: int, height: int, seed: int = 0) -> bytes:
    """A PNG of a UI-like picture: title bar, sidebar, text lines, buttons."""
    rng = random.Random(seed)
    image = Image.new("RGB", (width, height), (250, 250, 250))
    draw = ImageDraw.Draw(image)
    draw.rectangle((0, 0, width, 28), fill=(225, 225, 228))
    for i, color in enumerate(((255, 95, 86), (255, 189, 46), (39, 201, 63))):
        draw.ellipse((10 + 20 * i, 8, 22 + 20 * i, 20), fill=color)
    side = width // 5
    draw.rectangle((0, 28, side, height), fill=(236, 238, 242))
    for y in range(44, height - 20, 22):
        draw.text((14, y), f"file_{rng.randrange(1000)}.py", fill=(60, 60, 70))
    y = 44
    while y < height - 60:
        x = side + 20
        draw.text((x, y), " ".join(rng.choice(("def", "return", "self", "image", "tokens", "=", "(x)", "# note"))
                                   for _ in range(rng.randrange(3, 14))), fill=(rng.randrange(120), 40, 90))
        y += 18
    for i in range(3):
        x = width - 110 * (i + 1)
        draw.rounded_rectangle((x, height - 46, x + 96, height - 16), 6, fill=(10, 132, 255))
        draw.text((x + 22, height - 38), ("Run", "Cancel", "Save")[i], fill=(255, 255, 255))
    out = io.BytesIO()
    image.save(out, format="PNG")
    return out.getvalue()


# ------------------------------------------------------------------ preprocessing


def preprocessing_row(label: str, png: bytes, settings: ImageSettings, repeats: int) -> dict:
    from monolith.models.image_inputs import decode_image

    image = prepare_image(png, settings)
    return {"settings": label, "patch_size": settings.patch_size, "max_pixels": settings.max_pixels,
            "resized": f"{image.size[1]}x{image.size[0]}", "patches": len(image.patches), "tokens": image.tokens,
            "decode_ms": median_seconds(lambda: decode_image(png), repeats) * 1e3,
            "prepare_ms": median_seconds(lambda: prepare_image(png, settings), repeats) * 1e3}


# ------------------------------------------------------------------ FLOPs and bytes of the tower


def frames(image) -> list[int]:
    """Patches of each frame of a PreparedImage: attention is full within one frame."""
    t, h, w = image.grid_thw
    return [h * w] * t


def tower_flops(args: VisionArgs, frame_patches: list[int]) -> dict:
    """FLOPs of one image through the tower (2 per multiply-add): the part outside the
    blocks (patch embedding, merger), and one block's matmuls and attention."""
    n, d, i = sum(frame_patches), args.hidden_size, args.intermediate_size
    m = d * args.spatial_merge_size ** 2
    merged = n // args.spatial_merge_size ** 2
    return {"fixed": 2 * n * args.patch_dim * d + 2 * merged * (m * m + m * args.out_hidden_size),
            "block_matmuls": 2 * n * (4 * d * d + 2 * d * i),  # qkv, proj, fc1, fc2
            "block_attention": sum(4 * f * f * d for f in frame_patches)}  # QK^T and PV over all heads


def tower_bytes(args: VisionArgs, patches: int, item: int = 2) -> dict:
    """Bytes of one image through the tower in `item`-byte values: the weights read once,
    and an estimate of the activations, each op reading its inputs and writing its
    outputs once (attention fused, as mx.fast.scaled_dot_product_attention)."""
    n, d, i = patches, args.hidden_size, args.intermediate_size
    m = d * args.spatial_merge_size ** 2
    weights = {"fixed": 0, "block": 0}
    for name, shape in expected_shapes(replace(args, depth=1)).items():
        weights["block" if name.startswith("blocks.") else "fixed"] += item * math.prod(shape)
    fixed_act = n * (args.patch_dim + 3 * d) + n // args.spatial_merge_size ** 2 * (3 * m + args.out_hidden_size)
    block_act = n * (22 * d + 4 * i)  # linears in/out, 2 norms, 2 residual adds, the gelu, attention q/k/v/o
    return {"fixed": weights["fixed"] + item * fixed_act, "block": weights["block"] + item * block_act,
            "block_weights": weights["block"], "fixed_weights": weights["fixed"]}


# ------------------------------------------------------------------ the towers


def random_tower(args: VisionArgs, seed: int = 0):
    """A VisionTower of `args` with random values (norm weights 1), float32."""
    key = mx.random.key(seed)
    values = {}
    for name, shape in expected_shapes(args).items():
        key, sub = mx.random.split(key)
        values[name] = mx.ones(shape) if ".norm" in f".{name}" and name.endswith("weight") else \
            0.02 * mx.random.normal(shape, key=sub)
    values["patch_embed.proj.weight"] = values["patch_embed.proj.weight"].reshape(args.hidden_size, -1)
    mx.eval(list(values.values()))
    return tower_of(args, values)


def run_tower(tower, image) -> None:
    mx.eval(tower(image.patches, [image.grid_thw]))


def real_tower_rows(measured, screen, blocks: int, repeats: int) -> tuple[list[dict], dict]:
    """Qwen3.6's widths: `blocks` blocks and none timed on `measured`; the screenshot's
    27 blocks scaled from them by FLOPs."""
    from monolith.models.vision import VisionTower

    tower = random_tower(real_args(blocks))
    bare = VisionTower(real_args(0), tower.top, [])  # patch embedding, positions, merger
    full_s = median_seconds(lambda: run_tower(tower, measured), repeats)
    fixed_s = median_seconds(lambda: run_tower(bare, measured), repeats)
    block_s = max(full_s - fixed_s, 0.0) / blocks
    depth = real_args().depth
    at, to = tower_flops(real_args(), frames(measured)), tower_flops(real_args(), frames(screen))
    block_scale = (to["block_matmuls"] + to["block_attention"]) / (at["block_matmuls"] + at["block_attention"])
    scaled = {"fixed_ms": fixed_s * to["fixed"] / at["fixed"] * 1e3, "block_ms": block_s * block_scale * 1e3}
    scaled["screenshot_ms"] = scaled["fixed_ms"] + depth * scaled["block_ms"]
    detail = {"measured_fixed_ms": fixed_s * 1e3, "measured_block_ms": block_s * 1e3,
              "measured_block_gflop_s": (at["block_matmuls"] + at["block_attention"]) / max(block_s, 1e-9) / 1e9,
              "fixed_flops_ratio": to["fixed"] / at["fixed"], "block_flops_ratio": block_scale} | scaled
    rows = [{"tower": f"Qwen3.6 widths, {blocks} block(s), random values", "image": measured_size(measured),
             "patches": len(measured.patches), "blocks": blocks, "ms": full_s * 1e3, "how": "measured"},
            {"tower": "Qwen3.6 widths, no block", "image": measured_size(measured), "patches": len(measured.patches),
             "blocks": 0, "ms": fixed_s * 1e3, "how": "measured"},
            {"tower": f"Qwen3.6 widths, {depth} blocks", "image": measured_size(screen),
             "patches": len(screen.patches), "blocks": depth, "ms": scaled["screenshot_ms"],
             "how": "scaled: the no-block part and one block by FLOPs, the block times 27"}]
    return rows, detail


def measured_size(image) -> str:
    return f"{image.size[1]}x{image.size[0]}"


# ------------------------------------------------------------------ time to first token


class CountingVision:
    """A Vision that counts the images its tower runs on."""

    def __init__(self, vision):
        self.vision, self.runs = vision, 0

    def __getattr__(self, name):
        return getattr(self.vision, name)

    def features(self, image):
        self.runs += 1
        return self.vision.features(image)


def ttft_rows(model, tokenizer, vision, png: bytes, repeats: int) -> list[dict]:
    """Cold (a fresh Engine each time) and warm (the same request again) time to first
    token of the text alone and of the text around the screenshot."""
    from monolith.runtime.engine import Engine, Limits
    from monolith.runtime.events import GenerationRequest
    from monolith.runtime.prompt_cache import PromptCache

    image = prepare_image(png, vision.settings)
    text = corpus_prompts(tokenizer, 1, TEXT_TOKENS)[0]
    before, after = text[:TEXT_TOKENS // 2], text[TEXT_TOKENS // 2:]
    block = [vision.vision_start_id, *[vision.image_token_id] * image.tokens, vision.vision_end_id]
    other = prepare_image(screenshot(320, 200, seed=1), vision.settings)
    warmup = [vision.vision_start_id, *[vision.image_token_id] * other.tokens, vision.vision_end_id, *after]
    cases = [("warm-up", warmup, (other,)), ("text only", before + after, ()),
             ("text + screenshot", before + block + after, (image,))]
    vision.tower()  # loaded once, outside the timings (a server loads it on its first image)
    rows = []
    for label, prompt, images in cases:
        samples = []
        for _ in range(1 if label == "warm-up" else repeats):
            counting = CountingVision(vision)
            engine = Engine(model, tokenizer, Limits(max_context=len(prompt) + 64), vision=counting,
                            prompt_cache=PromptCache(1 << 30))
            try:
                request = GenerationRequest(tuple(prompt), 1, images=images)
                cold = engine.run_request(request)[1]
                runs = counting.runs
                warm = engine.run_request(request)[1]
            finally:
                engine.close()
            samples.append((cold.prefill_seconds, warm.prefill_seconds, warm.usage.cached_tokens, runs,
                            counting.runs - runs))
        if label != "warm-up":
            rows.append({"prompt": label, "prompt_tokens": len(prompt), "image_tokens": len(prompt) - len(text),
                         "cold_ms": statistics.median(s[0] for s in samples) * 1e3,
                         "warm_ms": statistics.median(s[1] for s in samples) * 1e3,
                         "warm_cached_tokens": samples[0][2], "tower_runs_cold": samples[0][3],
                         "tower_runs_warm": samples[0][4]})
    return rows


# ------------------------------------------------------------------ the Mac projection


def mac_rows(screen) -> list[dict]:
    """The screenshot through Qwen3.6's tower on an M5 Max: each piece's FLOPs and BF16
    bytes, over the bandwidth and each GPU FLOP rate; the floor is the larger."""
    args = real_args()
    f, b = tower_flops(args, frames(screen)), tower_bytes(args, len(screen.patches))
    depth = args.depth
    blocks = depth * (f["block_matmuls"] + f["block_attention"])
    pieces = [("patch embedding, positions, merger", f["fixed"], 0, b["fixed"]),
              (f"{depth} blocks", blocks, depth * f["block_attention"], depth * b["block"]),
              ("the tower", f["fixed"] + blocks, depth * f["block_attention"], b["fixed"] + depth * b["block"])]
    rows = []
    for piece, flops, attention, nbytes in pieces:
        row = {"piece": piece, "gflop": flops / 1e9, "attention_gflop": attention / 1e9, "mb": nbytes / 1e6,
               "bytes_ms": nbytes / BANDWIDTH * 1e3}
        row["flops_ms"] = {label: flops / rate * 1e3 for label, rate in GPU_FLOPS.items()}
        row["floor_ms"] = {label: max(row["bytes_ms"], ms) for label, ms in row["flops_ms"].items()}
        rows.append(row)
    return rows


# ------------------------------------------------------------------ report


def tables(report: dict) -> str:
    lines = ["## Preprocessing (decode, resize, patchify), per image\n",
             "| settings | patch | max pixels | resized | patches | tokens | decode ms | prepare_image ms |",
             "|---|---|---|---|---|---|---|---|"]
    lines += [f"| {r['settings']} | {r['patch_size']} | {r['max_pixels']} | {r['resized']} | {r['patches']} "
              f"| {r['tokens']} | {r['decode_ms']:.1f} | {r['prepare_ms']:.1f} |" for r in report["preprocessing"]]
    lines += ["\n## The vision tower, per image (this CPU, float32)\n",
              "| tower | resized image | patches | blocks | ms | how |", "|---|---|---|---|---|---|"]
    lines += [f"| {r['tower']} | {r['image']} | {r['patches']} | {r['blocks']} | {r['ms']:.1f} | {r['how']} |"
              for r in report["tower"]]
    lines += ["\n## Time to first token on the demo (Engine, prefill_seconds), medians\n",
              "| prompt | tokens (image's, with its start/end) | cold ms | warm ms | warm cached tokens "
              "| tower runs cold / warm |",
              "|---|---|---|---|---|---|"]
    lines += [f"| {r['prompt']} | {r['prompt_tokens']} ({r['image_tokens']}) | {r['cold_ms']:.1f} "
              f"| {r['warm_ms']:.1f} | {r['warm_cached_tokens']} | {r['tower_runs_cold']} / {r['tower_runs_warm']} |"
              for r in report["ttft"]]
    labels = list(report["mac"][0]["floor_ms"])
    lines += [(f"\n## Qwen3.6's tower on an M5 Max, one {report['settings']['image']} screenshot "
              f"({report['mac_patches']} patches), BF16\n"),
              "| piece | GFLOP (attention) | MB | ms at 614 GB/s | " + " | ".join(f"ms at {k}" for k in labels)
              + " | floor ms |", "|---|---|---|---|" + "---|" * len(labels) + "---|"]
    for r in report["mac"]:
        floor = " / ".join(f"{r['floor_ms'][k]:.1f}" for k in labels)
        lines.append(f"| {r['piece']} | {r['gflop']:.0f} ({r['attention_gflop']:.0f}) | {r['mb']:.0f} "
                     f"| {r['bytes_ms']:.1f} | " + " | ".join(f"{r['flops_ms'][k]:.1f}" for k in labels)
                     + f" | {floor} |")
    return "\n".join(lines)


def size(text: str) -> tuple[int, int]:
    width, height = (int(v) for v in text.lower().split("x"))
    return width, height


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--image", default="1280x800", help="the screenshot, WIDTHxHEIGHT")
    ap.add_argument("--real-image", default="640x400", help="the image the real-width tower is timed on")
    ap.add_argument("--real-blocks", type=int, default=1, help="blocks of the real-width tower timed")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out-dir", type=Path, default=RESULTS)
    args = ap.parse_args(argv)
    os.environ.setdefault("MONOLITH_CACHE", tempfile.mkdtemp(prefix="monolith-bench-"))
    from monolith.models import load_model
    from monolith.models.vision import vision_of
    from monolith.pack.cache import resolve_pack
    from monolith.pack.demo import demo_pair
    from monolith.tokenizer import load_tokenizer

    pack = resolve_pack(demo_pair()[0], role="target")
    model, tokenizer, vision = load_model(pack, dtype="float32"), load_tokenizer(pack), vision_of(pack, mx.float32)
    png = screenshot(*size(args.image))
    real = ImageSettings()
    small = size(args.real_image)  # timed as it is: a quick run's tiny image is not grown to min_pixels
    screen = prepare_image(png, real)
    measured = prepare_image(screenshot(*small), replace(real, min_pixels=min(real.min_pixels, small[0] * small[1])))
    demo_image = prepare_image(png, vision.settings)
    report = {"machine": machine(),
              "settings": {"image": args.image, "png_bytes": len(png), "real_image": args.real_image,
                           "real_blocks": args.real_blocks, "repeats": args.repeats, "text_tokens": TEXT_TOKENS,
                           "real_vision_config": vars(real_args())}}
    report["preprocessing"] = [preprocessing_row("demo", png, vision.settings, args.repeats),
                               preprocessing_row("Qwen3.6", png, real, args.repeats)]
    report["tower"] = [{"tower": "demo (1 block, hidden 32)", "image": measured_size(demo_image),
                        "patches": len(demo_image.patches),
                        "blocks": vision.args.depth, "how": "measured",
                        "ms": median_seconds(lambda: run_tower(vision.tower(), demo_image), args.repeats) * 1e3}]
    rows, report["real_tower_scaling"] = real_tower_rows(measured, screen, args.real_blocks, args.repeats)
    report["tower"] += rows
    report["ttft"] = ttft_rows(model, tokenizer, vision, png, args.repeats)
    report["mac"], report["mac_patches"] = mac_rows(screen), len(screen.patches)
    report["load_average"] = os.getloadavg()
    report["notes"] = notes(report)
    table = tables(report)
    print("\n".join(report["notes"]) + "\n\n" + table)
    write(report, "vision", table, args.out_dir)
    return 0


def notes(report: dict) -> list[str]:
    s, m = report["settings"], report["real_tower_scaling"]
    text, image = report["ttft"]
    return [machine_note(report["machine"]) + f"; load average {report['load_average'][0]:.2f}",
            (f"screenshot: synthetic {s['image']} PNG ({s['png_bytes']} bytes); medians of {s['repeats']} after a "
            "warm-up"),
            (f"real widths: measured on {s['real_image']} with {s['real_blocks']} block(s) and with none; "
            f"the screenshot's no-block part scaled by FLOPs x{m['fixed_flops_ratio']:.2f}, a block by "
            f"x{m['block_flops_ratio']:.2f}, times {report['settings']['real_vision_config']['depth']} "
            f"(a block ran at {m['measured_block_gflop_s']:.0f} GFLOP/s here)"),
            (f"TTFT: cold with the screenshot {image['cold_ms'] / text['cold_ms']:.1f}x the text alone "
            f"({image['image_tokens']} image tokens at the demo's settings; the demo's tower alone "
            f"{report['tower'][0]['ms']:.0f} ms); the warm repeat ran the tower "
            f"{image['tower_runs_warm']} time(s)"),
            ("Mac: FLOPs counted (2 per multiply-add; attention full within the image), bytes = BF16 weights once "
            "+ activations each op reads and writes once (an estimate); floor = max(bytes / bandwidth, FLOPs / "
            "rate), per FLOP rate (bench/projection.py)")]


if __name__ == "__main__":
    raise SystemExit(main())
