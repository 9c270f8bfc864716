"""What HTTP serving costs over in-process generation, on the same prompts and weights.

A synthetic target is packed once; `python -m monolith.serve` runs it in a subprocess
while this process loads the same pack. For each prompt, HTTP (streamed
/v1/completions, greedy) and in-process `runtime.engine.run_decoder` (the same plain decoder, no HTTP) alternate; every repetition
changes the prompt's first token so the server's prefix cache never hits. Reported
per prompt length, medians: time to first token, decode tokens/s (after the first
token), and the HTTP overhead = (HTTP wall time - in-process wall time) / in-process
decode time. Prints a table and writes bench/results/serve_latency.json.

    python -m bench.serve_latency [--preset small|tiny|bench] [--dtype float32]
        [--prompt-lengths 16,128,512] [--max-tokens 128] [--repeats 5]
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

from bench.common import free_port, package_version
from monolith.models import load_model
from monolith.pack import build_pack
from monolith.runtime.decoder import Decoder
from monolith.runtime.engine import run_decoder
from monolith.sampling import SamplingParams
from monolith.synth import PRESETS, Preset, write_target
from monolith.tokenizer import load_tokenizer

RESULTS = Path(__file__).resolve().parent / "results" / "serve_latency.json"
# A target whose decode step takes a few milliseconds on this CPU backend (tiny: about 1.5 ms).
SMALL = Preset(hidden_size=256, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, head_dim=64,
               linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=64, linear_value_head_dim=64,
               num_experts=8, num_experts_per_tok=2, moe_intermediate_size=128, shared_expert_intermediate_size=128,
               vocab_size=1024)


def start_server(pack: Path, args) -> tuple[subprocess.Popen, str]:
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "monolith.serve", "--model", str(pack), "--port", str(port),
                             "--dtype", args.dtype, "--max-context", str(args.max_context), "--log-level", "warning"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit("the server exited during startup")
        try:
            if httpx.get(url + "/health", timeout=5).status_code == 200:
                return proc, url
        except httpx.TransportError:
            pass
        time.sleep(0.1)
    proc.kill()
    raise SystemExit("the server did not become ready")


def run_http(client: httpx.Client, url: str, prompt: list[int], max_tokens: int) -> dict:
    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}}
    start = time.perf_counter()
    first = last = None
    tokens = 0
    with client.stream("POST", url + "/v1/completions", json=body) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if not line.startswith("data: {"):
                continue
            chunk = json.loads(line[6:])
            if chunk.get("usage"):
                tokens = chunk["usage"]["completion_tokens"]
            if chunk["choices"] and chunk["choices"][0]["text"]:
                now = time.perf_counter()
                first = first or now
                last = now
    end = time.perf_counter()
    first = first or end  # no text at all (a stop token first)
    return {"ttft": first - start, "decode_seconds": (last or end) - first, "tokens": tokens, "wall": end - start}


def run_local(model, prompt: list[int], max_tokens: int, stops, max_context: int) -> dict:
    start = time.perf_counter()
    result = run_decoder(Decoder(model, None, max_context), prompt, max_tokens, SamplingParams(), stops)
    end = time.perf_counter()
    return {"ttft": result.prefill_seconds, "decode_seconds": result.decode_seconds,
            "tokens": len(result.token_ids) + (result.finish_reason == "stop"), "wall": end - start,
            "decode_steps": result.decode_steps}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="small", choices=["small", *PRESETS])
    ap.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    ap.add_argument("--prompt-lengths", default="16,128,512")
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--max-context", type=int, default=4096)
    ap.add_argument("--out", type=Path, default=RESULTS)
    args = ap.parse_args(argv)
    lengths = [int(x) for x in args.prompt_lengths.split(",")]

    with tempfile.TemporaryDirectory() as tmp:
        preset = SMALL if args.preset == "small" else PRESETS[args.preset]
        pack = build_pack(write_target(Path(tmp) / "ckpt", preset=preset), Path(tmp) / "pack", role="target")
        model = load_model(pack, dtype=args.dtype)
        tok = load_tokenizer(pack)
        stops = set(tok.eos_token_ids) | set(model.args.eos_token_ids)
        words = tok.encode(" ".join(["the quick brown fox jumps over the lazy dog"] * 400))
        proc, url = start_server(pack, args)
        rows = []
        try:
            with httpx.Client(timeout=600) as client:
                run_http(client, url, words[:8], 8)  # warm both sides
                run_local(model, words[:8], 8, stops, args.max_context)
                for length in lengths:
                    http, local = [], []
                    for rep in range(args.repeats):
                        prompt = [(rep * 7 + length) % 256] + words[:length - 1]  # a new first token: no cache hit
                        http.append(run_http(client, url, prompt, args.max_tokens))
                        local.append(run_local(model, prompt, args.max_tokens, stops, args.max_context))
                    rows.append(summarize(length, http, local))
        finally:
            proc.terminate()
            proc.wait(30)

    print(f"{'prompt':>7} {'tokens':>7} {'TTFT local ms':>14} {'TTFT HTTP ms':>13} {'local tok/s':>12} "
          f"{'HTTP tok/s':>11} {'overhead':>9}")
    for r in rows:
        print(f"{r['prompt_tokens']:>7} {r['completion_tokens']:>7} {r['ttft_local_ms']:>14.2f} "
              f"{r['ttft_http_ms']:>13.2f} {r['decode_tok_s_local']:>12.1f} {r['decode_tok_s_http']:>11.1f} "
              f"{r['http_overhead_ratio']:>8.1%}")
    report = {
        "benchmark": "serve_latency",
        "description": "streamed /v1/completions vs in-process runtime.engine.run_decoder, same pack, greedy; medians",
        "machine": {"platform": platform.platform(), "python": platform.python_version(),
                    "mlx": package_version("mlx"), "processor": platform.processor() or platform.machine()},
        "settings": {"preset": args.preset, "dtype": args.dtype, "max_tokens": args.max_tokens,
                     "repeats": args.repeats, "max_context": args.max_context},
        "rows": rows,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    print(f"wrote {args.out}")
    return 0


def summarize(length: int, http: list[dict], local: list[dict]) -> dict:
    med = statistics.median

    def tok_s(runs):
        return med((r["tokens"] - 1) / r["decode_seconds"] for r in runs if r["decode_seconds"] > 0)

    overhead = med((h["wall"] - lo["wall"]) / lo["decode_seconds"] for h, lo in zip(http, local)
                   if lo["decode_seconds"] > 0)
    return {
        "prompt_tokens": length,
        "completion_tokens": int(med(r["tokens"] for r in local)),
        "ttft_local_ms": 1000 * med(r["ttft"] for r in local),
        "ttft_http_ms": 1000 * med(r["ttft"] for r in http),
        "decode_tok_s_local": tok_s(local),
        "decode_tok_s_http": tok_s(http),
        "wall_local_ms": 1000 * med(r["wall"] for r in local),
        "wall_http_ms": 1000 * med(r["wall"] for r in http),
        "http_overhead_ratio": overhead,
    }


if __name__ == "__main__":
    sys.exit(main())
