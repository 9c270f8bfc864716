"""`python -m monolith.generate --draft` with an oracle drafter, and the real
DSpark/DFlash drafts end to end (monolith.models.dspark through the decoders)."""

# ruff: noqa: F811 - the fixtures imported below are test parameters
from __future__ import annotations

import json
import subprocess
import sys

import pytest
from decoding import plain, speculate
from oracles import CHUNK, GREEDY, PROMPT, GreedyOracle, assert_same_greedy, plain_greedy

from monolith.generate import main
from monolith.models import load_model
from monolith.pack import build_pack
from monolith.runtime.scheduler import (
    FixedScheduler,
    ThresholdScheduler,
)
from monolith.sampling import SamplingParams

# ------------------------------------------------------------------ the CLI with an oracle drafter


def run_cli(capsys, argv, model, drafter):
    loaded = []

    def load_draft(source, target, dtype, quantization, local_files_only, revision=None, verify=None):
        assert target is model and local_files_only is False
        loaded.append((source, dtype, quantization))
        return drafter

    code = main(argv, load=lambda pack, dtype, verify: model, load_draft=load_draft)
    out, err = capsys.readouterr()
    return code, out, err, loaded


def test_cli_draft_json_and_stats_line(capsys, model, pack):
    reference = plain_greedy(model, PROMPT, 20)
    base = ["--model", str(pack), "--prompt-ids", ",".join(map(str, PROMPT)), "--max-tokens", "20",
            "--dtype", "float32"]
    oracle = GreedyOracle(PROMPT, reference, model.args.vocab_size, error_at=3)
    code, out, err, loaded = run_cli(capsys, [*base, "--json", "--draft", "D", "--draft-quantization", "none",
                                              "--draft-block-size", "5"], model, oracle)
    assert code == 0, err
    assert loaded == [("D", "float32", "none")]
    doc = json.loads(out)
    assert doc["token_ids"] == reference[:len(doc["token_ids"])] and doc["finish_reason"] in ("length", "stop")
    s = doc["stats"]
    assert s["rounds"] == len(s["accepted_per_round"]) and s["block_size"] == 5
    assert s["accepted_per_round"][0] == 3 and s["acceptance_length"] == pytest.approx(s["mean_accepted"] + 1)
    assert s["per_position_acceptance"][:4] == [1.0, 1.0, 1.0, 0.0]
    assert min(s["draft_seconds"], s["verify_seconds"], s["commit_seconds"]) > 0
    assert s["counters"]["spec_decode_num_draft_tokens_total"] == sum(s["proposed_per_round"])

    oracle = GreedyOracle(PROMPT, reference, model.args.vocab_size, error_at=None)
    code, out, err, loaded = run_cli(capsys, [*base, "--draft", "D", "--spec-sched", "threshold",
                                              "--spec-threshold", "0.2"], model, oracle)
    assert code == 0, err
    assert loaded == [("D", "float32", "auto")]
    stats, *rest = err.splitlines()  # the stats line, then the BLAS line where the CPU has one (monolith.blas)
    assert "rounds: " in stats and "acceptance length" in stats
    assert len(rest) <= 1 and all("BLAS" in line for line in rest)


@pytest.mark.parametrize("argv, message", [
    (["--draft", "D", "--draft-block-size", "9"], "--draft-block-size must be at most 8"),
    (["--draft", "D", "--draft-block-size", "0"], "--draft-block-size must be at least 1"),
    (["--draft", "D", "--spec-threshold", "0.2"], "--spec-threshold only applies with --spec-sched threshold"),
    (["--draft", "D", "--spec-sched", "threshold", "--spec-threshold", "2"], "--spec-threshold must be in [0, 1]"),
    (["--spec-threshold", "0.2"], "--spec-threshold only applies with a draft (--draft)"),
])
def test_cli_draft_argument_errors(capsys, model, pack, argv, message):
    oracle = GreedyOracle(PROMPT, [1], model.args.vocab_size)
    code, out, err, _ = run_cli(capsys, ["--model", str(pack), "--prompt-ids", "1,2", *argv], model, oracle)
    assert code == 1 and out == "" and message in err and err.startswith("error: "), err


# ------------------------------------------------------------------ with the real draft (monolith.models.dspark)

DRAFT_FORMATS = ("deepspec", "deepspec-nvfp4", "speculators", "dflash")


@pytest.fixture(scope="module")
def real_pair(tmp_path_factory):
    from monolith.synth import write_draft, write_target

    root = tmp_path_factory.mktemp("pair")
    target = write_target(root / "target")
    drafts = {fmt: write_draft(root / f"draft-{fmt}", target, format=fmt) for fmt in DRAFT_FORMATS}
    return build_pack(target, root / "target.pack", role="target"), drafts


@pytest.mark.parametrize("fmt", DRAFT_FORMATS)
def test_real_draft_greedy_speculative_equals_plain(real_pair, fmt, monkeypatch, tmp_path):
    from monolith.engine_setup import load_drafter

    monkeypatch.setenv("MONOLITH_CACHE", str(tmp_path / "cache"))
    target_pack, drafts = real_pair
    model = load_model(target_pack, dtype="float32")
    drafter = load_drafter(drafts[fmt], model, dtype="float32")
    assert drafter.taps and drafter.max_proposals >= 1
    plain_out = plain(model, PROMPT, 24, GREEDY, [], 128)
    for scheduler in (FixedScheduler(), ThresholdScheduler(0.3)):
        spec = speculate(model, drafter, PROMPT, 24, GREEDY, [], 128, prefill_chunk_size=CHUNK,
                                    scheduler=scheduler)
        assert_same_greedy(model, PROMPT, spec.token_ids, plain_out.token_ids)
        assert spec.speculative.rounds >= 1
    # sampling runs through the draft's q and is reproducible with a seed
    params = SamplingParams(temperature=0.9, top_k=20, seed=7)
    runs = [speculate(model, drafter, PROMPT, 12, params, [], 128).token_ids for _ in range(2)]
    assert runs[0] == runs[1] and len(runs[0]) == 12


def test_real_draft_cli_json(real_pair, tmp_path):
    from monolith.models import load_draft  # noqa: F401 - the draft model must exist

    target_pack, drafts = real_pair
    ids = ",".join(map(str, PROMPT))
    env = {"MONOLITH_CACHE": str(tmp_path / "cache"), "HF_HUB_OFFLINE": "1"}

    def cli(*extra):
        import os

        proc = subprocess.run([sys.executable, "-m", "monolith.generate", "--model", str(target_pack),
                               "--prompt-ids", ids, "--max-tokens", "16", "--dtype", "float32", "--json", *extra],
                              capture_output=True, text=True, env={**os.environ, **env}, timeout=300, check=False)
        assert proc.returncode == 0, proc.stderr
        return json.loads(proc.stdout)

    plain = cli()
    spec = cli("--draft", str(drafts["deepspec"]), "--spec-sched", "cost")
    assert spec["token_ids"] == plain["token_ids"]
    assert spec["stats"]["rounds"] >= 1 and spec["stats"]["acceptance_length"] >= 1
