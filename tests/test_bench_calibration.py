"""bench/calibration.py's arithmetic (docs/mac.md section 5): a decode step projects to
its bytes over the bandwidth plus its primitives at the constant, a prefill's attention
pairs add up to the whole causal triangle whatever the chunks, the fit is the minimax
constant, and the committed calibration reproduces every point it uses within the bound
with its one constant, which is projection.CALIBRATED_DISPATCH_US. Nothing here times
anything; the script's own run is tests/test_bench_scripts.py's."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from bench.calibration import BOUND, PREFILL_STEP, decode_ms, fit, monolith_rows, prefill_flops, projected
from bench.projection import BANDWIDTH, CALIBRATED_DISPATCH_US

RESULTS = Path(__file__).resolve().parents[1] / "bench" / "results"


def test_a_decode_step_is_its_bytes_over_the_bandwidth_plus_its_dispatches():
    assert decode_ms(BANDWIDTH / 1e3, 1000, 2.0) == pytest.approx(1.0 + 2.0)  # 1 ms of bytes, 1000 x 2 us
    row = {"kind": "decode", "bytes_per_token": BANDWIDTH * 4e-3, "primitives": 2000}
    assert projected(row, 0.5) == pytest.approx(1e3 / (4.0 + 1.0))


def test_prefill_attention_covers_the_causal_triangle_whatever_the_chunks():
    m = {"matmul_params_per_row": 10, "gdn_flops_per_row": 3, "attention_flops_per_pair": 1}
    for prompt in (3, PREFILL_STEP, PREFILL_STEP + 1, 3 * PREFILL_STEP + 5):
        assert prefill_flops(m, prompt) == prompt * 23 + prompt * (prompt + 1) / 2


def decode_row(bytes_ms: float, primitives: int, us: float) -> dict:
    """A decode point whose constant is exactly `us`."""
    return {"kind": "decode", "bytes_per_token": BANDWIDTH * bytes_ms / 1e3, "primitives": primitives,
            "published": 1e3 / (bytes_ms + primitives * us / 1e3)}


def test_the_fit_is_the_constant_every_point_agrees_on_or_else_the_minimax_one():
    assert fit([decode_row(3.0, 4000, 1.5), decode_row(25.0, 3000, 1.5)]) == 1.5
    rows = [decode_row(3.0, 4000, 1.0), decode_row(3.0, 4000, 2.0)]  # 7 ms and 11 ms at the same count
    # the minimax step time is their geometric mean: one too slow by the factor the other is too fast
    assert fit(rows) == round((math.sqrt(7.0 * 11.0) - 3.0) / 4000 * 1e3, 2)


def test_the_committed_calibration_reproduces_its_points_with_one_constant():
    report = json.loads((RESULTS / "calibration.json").read_text())
    c = report["dispatch_us"]
    assert c == CALIBRATED_DISPATCH_US
    used = [r for r in report["points"] if r["used"]]
    assert len(used) >= 3 and fit(used) == c
    for r in report["points"]:
        assert r["source"] and r["chip"] and r["published"] > 0
        assert r["projected"] == pytest.approx(projected(r, c), abs=0.005)  # to 2 decimals
        assert r["error"] == pytest.approx(r["projected"] / r["published"] - 1, abs=1e-4)
        assert r["used"] == (r["why_not_used"] is None)
    assert all(abs(r["error"]) <= BOUND for r in used)
    assert report["fit"]["largest_error"] == max(abs(r["error"]) for r in used)


def test_monolith_is_quoted_at_the_calibrated_constant():
    report = json.loads((RESULTS / "calibration.json").read_text())
    real_widths = json.loads((RESULTS / "real_widths.json").read_text())
    assert report["monolith"] == monolith_rows(real_widths, report["dispatch_us"], report["fit"]["largest_error"])
    steps = real_widths["dispatch_40_layers"]["decode_step"]
    for row, pair in zip(report["monolith"], real_widths["pairs"]):
        floor = pair["projection"]["decode_step"]["floor_ms"]
        assert row["plain_tok_s"] == pytest.approx(1e3 / (floor + steps * CALIBRATED_DISPATCH_US / 1e3), abs=0.05)
