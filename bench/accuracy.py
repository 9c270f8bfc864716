"""What NVFP4 costs in accuracy: lm-eval (its `local-completions` model, the server's
own tokenizer over /tokenize: no hub) runs two tasks from local data against a server
on a BF16 pack and on an NVFP4 pack of the same checkpoint, and the table gives both
and their difference.

- `demo_ppl` (loglikelihood_rolling): the demo corpus's held-out standard-library
  sources (packs/demo/corpus.py: never trained on), each cut to --ppl-chars at a line
  end: word and byte perplexity, bits per byte.
- `demo_next_line` (multiple_choice): --items questions written from the same files,
  deterministically: a few lines of a held-out source, then its true next line among
  three distractors, lines drawn from other held-out sources: acc and acc_norm.

The default checkpoint is the demo target, which was exported with NVFP4 experts: its
BF16 checkpoint here is that export dequantized (`bf16_checkpoint`), so the NVFP4 pack
(`--quantization nvfp4` of it) differs where the packer quantizes what the export had
kept in BF16. Give --model a BF16 checkpoint directory to measure a model of your own.
The task files (YAML and JSON lines, `write_tasks`: tests/test_lm_eval.py writes its
own with it) land in the scratch directory (--work).

    python -m bench.accuracy [--model CKPT] [--items 40] [--ppl-docs 8] [--out-dir bench/results]
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench.common import RESULTS, ROOT, machine, machine_note, package_version, write
from bench.http_replay import Server

MC_TASK, PPL_TASK = "demo_next_line", "demo_ppl"
DISTRACTORS = 3
FLOATS = ("BF16", "F16", "F32")
DEMO_NOTE = ("checkpoint: the demo target, whose export has NVFP4 experts, dequantized to BF16 (bf16_checkpoint): "
             "the NVFP4 pack quantizes its experts again (their values came from NVFP4) and newly its lm_head "
             "and attention and gated-DeltaNet projections, so the difference is mostly what NVFP4 costs on those")
CONTEXT_LINES = 6


# ------------------------------------------------------------------ the tasks


def heldout_sources() -> list[str]:
    """The demo corpus's held-out documents that are sources (not its conversations)."""
    spec = importlib.util.spec_from_file_location("demo_corpus", ROOT / "packs" / "demo" / "corpus.py")
    corpus = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(corpus)
    _, held, _ = corpus.load()
    return [doc for doc in held if not doc.startswith("<|im_start|>")]


def ppl_docs(sources: list[str], count: int, chars: int) -> list[dict]:
    """The first `count` sources, each cut at the last line end within `chars`."""
    docs = []
    for text in sources[:count]:
        cut = text[:chars]
        docs.append({"text": cut[:cut.rfind("\n") + 1] or cut})
    return docs


def _lines(text: str) -> list[str]:
    return [line for line in text.splitlines() if len(line.strip()) >= 12]


def mc_items(sources: list[str], count: int, seed: int = 0) -> list[dict]:
    """`count` next-line questions: CONTEXT_LINES lines of one source, its next line
    and DISTRACTORS lines of other sources, in a seeded order (`label`: the true one's)."""
    rng = random.Random(seed)
    pools = [_lines(text) for text in sources]
    usable = [i for i, lines in enumerate(pools) if len(lines) > CONTEXT_LINES + 1]
    items = []
    while len(items) < count:
        doc = rng.choice(usable)
        lines = pools[doc]
        at = rng.randrange(CONTEXT_LINES, len(lines))
        truth = lines[at]
        others = set()
        while len(others) < DISTRACTORS:
            other = rng.choice([i for i in usable if i != doc])
            line = rng.choice(pools[other])
            if line != truth:
                others.add(line)
        choices = [truth] + sorted(others)
        rng.shuffle(choices)
        items.append({"context": "\n".join(lines[at - CONTEXT_LINES:at]) + "\n", "choices": choices,
                      "label": choices.index(truth)})
    return items


def write_tasks(folder: Path, items: list[dict], docs: list[dict]) -> list[str]:
    """lm-eval task files for `items` (multiple choice) and `docs` (perplexity), the data
    as JSON lines beside them: the task names. Choices follow the context with no
    delimiter (each is a whole line)."""
    folder.mkdir(parents=True, exist_ok=True)
    tasks = {
        MC_TASK: (items, {"output_type": "multiple_choice", "doc_to_text": "{{context}}",
                          "doc_to_choice": "{{choices}}", "doc_to_target": "{{label}}", "target_delimiter": "",
                          "metric_list": [{"metric": "acc"}, {"metric": "acc_norm"}]}),
        PPL_TASK: (docs, {"output_type": "loglikelihood_rolling", "doc_to_text": "", "doc_to_target": "{{text}}",
                          "metric_list": [{"metric": "word_perplexity"}, {"metric": "byte_perplexity"},
                                          {"metric": "bits_per_byte"}]}),
    }
    for name, (rows, config) in tasks.items():
        data = folder / f"{name}.jsonl"
        data.write_text("".join(json.dumps(row) + "\n" for row in rows))
        task = {"task": name, "dataset_path": "json", "dataset_kwargs": {"data_files": {"test": str(data)}},
                "test_split": "test", **config, "metadata": {"version": 1}}
        (folder / f"{name}.yaml").write_text(json.dumps(task, indent=1) + "\n")  # JSON is YAML
    return list(tasks)


# ------------------------------------------------------------------ running lm-eval


def run_lm_eval(url: str, model: str, tasks_dir: Path, tasks: list[str], out: Path, batch_size: int = 4,
                log_samples: bool = False) -> dict:
    """`python -m lm_eval` with `local-completions` against the server at `url`, the
    server's tokenizer (tokenizer_backend=remote), offline (HF_HOME under `out`): its
    results JSON as a dict."""
    out.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1", "HF_HOME": str(out / "hf"),
           "TOKENIZERS_PARALLELISM": "false"}
    args = [sys.executable, "-m", "lm_eval", "--model", "local-completions", "--model_args",
            f"model={model},base_url={url}/v1/completions,tokenizer_backend=remote,num_concurrent=1,max_retries=1",
            "--tasks", ",".join(tasks), "--include_path", str(tasks_dir), "--batch_size", str(batch_size),
            "--output_path", str(out / "results")]
    if log_samples:
        args.append("--log_samples")
    done = subprocess.run(args, env=env, cwd=out, capture_output=True, text=True, check=False)
    if done.returncode:
        raise RuntimeError(f"lm_eval exited with {done.returncode}:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}")
    found = sorted((out / "results").rglob("results_*.json"))
    return json.loads(found[-1].read_text())


def metrics(results: dict) -> dict:
    """The tasks' metrics as {task: {metric: value}} (lm-eval's "acc,none" keys without the filter)."""
    return {task: {key.split(",")[0]: value for key, value in row.items()
                   if "," in key and isinstance(value, (int, float))}
            for task, row in results["results"].items()}


# ------------------------------------------------------------------ the checkpoints


def bf16_checkpoint(source: Path, out: Path) -> Path:
    """`source` (any format monolith reads) as a BF16 checkpoint directory: every
    quantized linear dequantized, the quantization config and activation scales
    dropped, the MTP head left out."""
    import mlx.core as mx

    from monolith.checkpoint import open_checkpoint

    ckpt = open_checkpoint(source)
    out.mkdir(parents=True, exist_ok=True)
    tensors, done = {}, set()
    for name, spec in ckpt.modules().items():
        if not name.startswith("mtp."):
            tensors[name + ".weight"] = ckpt.dequantize(name)
            done.update(t for role, t in spec.tensors.items() if role != "bias")
    for name in ckpt.tensor_names():
        scale = name.rsplit(".", 1)[-1] in ("input_scale", "k_scale", "v_scale", "output_scale")
        if name not in done and not scale and not name.startswith("mtp.") and ckpt.dtype(name) in FLOATS:
            tensors[name] = ckpt.read_float(name)
    bf16 = {name: mx.array(value).astype(mx.bfloat16) for name, value in tensors.items()}
    mx.save_safetensors(str(out / "model.safetensors"), bf16, metadata={"format": "pt"})
    config = json.loads((source / "config.json").read_text())
    config.pop("quantization_config", None)
    config.get("text_config", {}).pop("quantization_config", None)
    config.get("text_config", {})["mtp_num_hidden_layers"] = 0
    (out / "config.json").write_text(json.dumps(config, indent=2))
    for path in source.iterdir():
        if path.name.startswith(("tokenizer", "chat_template", "generation_config", "preprocessor")):
            (out / path.name).write_bytes(path.read_bytes())
    return out


def build(checkpoint: Path, pack: Path, quantization: str) -> Path:
    """The text-only pack of `checkpoint` at `pack`, built --quantization `quantization`."""
    subprocess.run([sys.executable, "-m", "monolith.pack", "build", str(checkpoint), "--out", str(pack),
                    "--quantization", quantization, "--no-vision", "--force"], cwd=ROOT, check=True,
                   capture_output=True)
    return pack


# ------------------------------------------------------------------ the bench


def evaluate(pack: Path, args, tasks_dir: Path, tasks: list[str], work: Path, label: str) -> dict:
    command = [sys.executable, "-m", "monolith.serve", "--model", str(pack), "--no-draft", "--max-context",
               str(args.max_context), "--served-model-name", "model", "--no-warmup"]
    began = time.perf_counter()
    with Server(command, work / f"{label}.log", metrics=False) as server:
        results = run_lm_eval(server.url, "model", tasks_dir, tasks, work / label, args.batch_size)
    return {"pack": label, "seconds": round(time.perf_counter() - began, 1), **metrics(results)}


def table(rows: list[dict], difference: dict) -> str:
    keys = [(PPL_TASK, "word_perplexity"), (PPL_TASK, "byte_perplexity"), (PPL_TASK, "bits_per_byte"),
            (MC_TASK, "acc"), (MC_TASK, "acc_norm")]
    head = "| pack | " + " | ".join(f"{task} {metric}" for task, metric in keys) + " |\n"
    head += "|---" * (len(keys) + 1) + "|\n"
    lines = [f"| {row['pack']} | " + " | ".join(f"{row[t][m]:.4f}" for t, m in keys) + " |" for row in rows]
    lines.append("| NVFP4 - BF16 | " + " | ".join(f"{difference[t][m]:+.4f}" for t, m in keys) + " |")
    return head + "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", type=Path, default=ROOT / "packs" / "demo" / "target",
                        help="a checkpoint directory (default: the demo target, dequantized to BF16 first)")
    parser.add_argument("--items", type=int, default=40, help="multiple-choice questions")
    parser.add_argument("--ppl-docs", type=int, default=8, help="held-out sources in the perplexity task")
    parser.add_argument("--ppl-chars", type=int, default=3000, help="characters of each of them")
    parser.add_argument("--batch-size", type=int, default=4)
    parser.add_argument("--max-context", type=int, default=4096)
    parser.add_argument("--work", type=Path, default=None, help="scratch directory (default: a temporary one)")
    parser.add_argument("--out-dir", type=Path, default=RESULTS)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="monolith-accuracy-") as scratch:
        work = args.work or Path(scratch)
        work.mkdir(parents=True, exist_ok=True)
        sources = heldout_sources()
        tasks_dir = work / "tasks"
        tasks = write_tasks(tasks_dir, mc_items(sources, args.items), ppl_docs(sources, args.ppl_docs, args.ppl_chars))
        demo = args.model == ROOT / "packs" / "demo" / "target"
        checkpoint = bf16_checkpoint(args.model, work / "bf16-ckpt") if demo else args.model
        rows = [evaluate(build(checkpoint, work / f"{q}.pack", q), args, tasks_dir, tasks, work, label)
                for q, label in (("none", "BF16"), ("nvfp4", "NVFP4"))]
    difference = {task: {m: rows[1][task][m] - rows[0][task][m] for m in rows[0][task]} for task in tasks}
    m = machine()
    source = (DEMO_NOTE if demo else f"checkpoint: {args.model}") + "; packs built --quantization none and nvfp4"
    tools = f"lm-eval {package_version('lm-eval')}, local-completions, tokenizer_backend=remote, --batch_size "
    tools += str(args.batch_size)
    data = f"{PPL_TASK}: {args.ppl_docs} held-out demo-corpus sources, {args.ppl_chars} chars each; {MC_TASK}: "
    data += f"{args.items} questions, the true next line among {DISTRACTORS} lines of other sources"
    notes = [machine_note(m), tools, source, data]
    report = {"machine": m, "notes": notes, "tasks": tasks, "rows": rows, "difference": difference}
    write(report, "accuracy", table(rows, difference), args.out_dir)


if __name__ == "__main__":
    main()
