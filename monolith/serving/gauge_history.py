"""The last few minutes of the gauges the chat page's status tab plots (static/status.js),
kept by the server so that the tab has its plots the moment it opens.

Every SAMPLE_SECONDS a task of the app reads the counters and gauges of `/metrics` that
the plots need and keeps the last KEEP readings; GET /metrics/history answers them as
JSON, each with how many seconds ago it was taken. The page turns consecutive readings
into points as it does its own scrapes (tok/s from the token counter's growth)."""

from __future__ import annotations

import time
from collections import deque

SAMPLE_SECONDS = 2.0  # as the page polls (status.js POLL_MS)
KEEP = 150  # 5 minutes, as a plot keeps (status.js KEEP)
PLOTTED = ("monolith_generation_tokens_total", "spec_decode_num_drafts_total", "spec_decode_num_accepted_tokens_total",
           "monolith_num_requests_waiting", "monolith_num_requests_running", "monolith_prompt_cache_bytes")


def plotted_values(text: str) -> dict[str, float]:
    """The PLOTTED series of a Prometheus text exposition (unlabelled lines only)."""
    values = {}
    for line in text.splitlines():
        name, _, value = line.partition(" ")
        if name in PLOTTED:
            values[name] = float(value)
    return values


class GaugeHistory:
    def __init__(self, keep: int = KEEP):
        self.samples: deque[tuple[float, dict[str, float]]] = deque(maxlen=keep)

    def add(self, values: dict[str, float], at: float | None = None) -> None:
        self.samples.append((time.monotonic() if at is None else at, values))

    def take(self, render) -> None:
        """One reading of `render()` (Metrics.render: the exposition's bytes)."""
        self.add(plotted_values(render().decode()))

    def as_json(self) -> dict:
        now = time.monotonic()
        return {"interval_seconds": SAMPLE_SECONDS,
                "samples": [{"seconds_ago": round(now - at, 3), "values": values} for at, values in self.samples]}
