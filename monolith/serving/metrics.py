"""Prometheus metrics of one server (one registry per app, so tests can run several).

Request, token and latency series are prefixed `monolith_`; the speculative counters
use vLLM's names (docs/drafts.md section 5) so existing dashboards read them, besides
ours for per-request drafting (docs/drafts.md 4.2): the fallback's plain rounds and its
switches between drafted and plain rounds, by direction and reason. With several models
(serving/models.py) the queue and prompt-cache series add up the loaded models' (a
model's counters leave the sums when it is unloaded), and `ModelCollector` gives each
configured model's loaded state, last load time and cache bytes, labelled by model.

`GaugeHistory` keeps the last few minutes of the gauges the chat page's status tab plots
(static/status.js), so that the tab has its plots the moment it opens: every
SAMPLE_SECONDS a task of the app reads the counters and gauges of `/metrics` that the
plots need and keeps the last KEEP readings; GET /metrics/history answers them as JSON,
each with how many seconds ago it was taken. The page turns consecutive readings into
points as it does its own scrapes (tok/s from the token counter's growth).
"""

from __future__ import annotations

import time
from collections import deque

import mlx.core as mx
from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    ProcessCollector,
    generate_latest,
)
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.exposition import CONTENT_TYPE_LATEST

from ..runtime.events import Finished
from ..runtime.fallback import SWITCHES

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)
TOKEN_LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64, 1.28)
CONTENT_TYPE = CONTENT_TYPE_LATEST
SAMPLE_SECONDS = 2.0  # as the page polls (status.js POLL_MS)
KEEP = 150  # 5 minutes, as a plot keeps (status.js KEEP)
PLOTTED = ("monolith_generation_tokens_total", "spec_decode_num_drafts_total", "spec_decode_num_accepted_tokens_total",
           "monolith_num_requests_waiting", "monolith_num_requests_running", "monolith_prompt_cache_bytes")


class Metrics:
    def __init__(self):
        r = self.registry = CollectorRegistry()
        self.requests = Counter("monolith_requests", "HTTP requests answered, by endpoint and status code",
                                ["endpoint", "status"], registry=r)
        self.finished = Counter("monolith_request_finished", "Generations finished, by finish reason",
                                ["finish_reason"], registry=r)
        self.prompt_tokens = Counter("monolith_prompt_tokens", "Prompt tokens of finished generations", registry=r)
        self.cached_prompt_tokens = Counter("monolith_prompt_tokens_cached",
                                            "Prompt tokens taken from the prefix cache instead of prefilled",
                                            registry=r)
        self.generation_tokens = Counter("monolith_generation_tokens", "Generated tokens", registry=r)
        self.queue_time = Histogram("monolith_request_queue_time_seconds", "Time waiting in the queue",
                                    buckets=LATENCY_BUCKETS, registry=r)
        self.ttft = Histogram("monolith_time_to_first_token_seconds", "Request arrival to the first token",
                              buckets=LATENCY_BUCKETS, registry=r)
        self.e2e = Histogram("monolith_e2e_request_latency_seconds", "Request arrival to the last token",
                             buckets=LATENCY_BUCKETS, registry=r)
        self.per_token = Histogram("monolith_time_per_output_token_seconds", "Decode time per generated token",
                                   buckets=TOKEN_LATENCY_BUCKETS, registry=r)
        self.running = Gauge("monolith_num_requests_running", "Requests generating now", registry=r)
        self.waiting = Gauge("monolith_num_requests_waiting", "Requests waiting in the queue", registry=r)
        self.spec_drafts = Counter("spec_decode_num_drafts", "Speculative rounds (drafts verified)", registry=r)
        self.spec_draft_tokens = Counter("spec_decode_num_draft_tokens", "Draft tokens proposed and verified",
                                         registry=r)
        self.spec_accepted = Counter("spec_decode_num_accepted_tokens", "Draft tokens accepted", registry=r)
        self.spec_accepted_per_pos = Counter("spec_decode_num_accepted_tokens_per_pos",
                                             "Draft tokens accepted, by position in the draft block",
                                             ["position"], registry=r)
        self.spec_plain_rounds = Counter("monolith_spec_plain_rounds",
                                         "One-row rounds a drafting server's fallback ran instead of drafting",
                                         registry=r)
        self.spec_switches = Counter("monolith_spec_switches",
                                     "Requests' switches between drafted and plain rounds, by direction and reason",
                                     ["to", "reason"], registry=r)
        for to, reason in SWITCHES:
            self.spec_switches.labels(to, reason)

    def bind(self, pool) -> None:
        """Read the queue gauges, the prompt caches' series and the models' from the
        loaded engines of `pool` (models.ModelPool) at scrape time."""
        def engines():
            return [slot.served.engine for slot in pool.loaded()]

        self.running.set_function(lambda: sum(engine.running for engine in engines()))
        self.waiting.set_function(lambda: sum(engine.waiting for engine in engines()))
        self.registry.register(PromptCacheCollector(lambda: [engine.prompt_cache for engine in engines()]))
        self.registry.register(ModelCollector(pool))
        self.registry.register(MemoryCollector())
        ProcessCollector(registry=self.registry)

    def observe(self, finished: Finished, first_token_seconds: float | None, total_seconds: float) -> None:
        usage = finished.usage
        self.finished.labels(finished.finish_reason).inc()
        self.prompt_tokens.inc(usage.prompt_tokens)
        self.cached_prompt_tokens.inc(usage.cached_tokens)
        self.generation_tokens.inc(usage.completion_tokens)
        self.queue_time.observe(finished.queued_seconds)
        if first_token_seconds is not None:
            self.ttft.observe(first_token_seconds)
        self.e2e.observe(total_seconds)
        if finished.decode_steps:
            self.per_token.observe(finished.decode_seconds / finished.decode_steps)
        spec = finished.spec
        if spec is not None:
            self.spec_drafts.inc(spec.drafts)
            self.spec_draft_tokens.inc(spec.draft_tokens)
            self.spec_accepted.inc(spec.accepted_tokens)
            for position, count in enumerate(spec.accepted_per_position):
                self.spec_accepted_per_pos.labels(str(position)).inc(count)
        stats = finished.speculative
        if stats is not None:
            self.spec_plain_rounds.inc(stats.plain_rounds)
            for switch in stats.switches:
                self.spec_switches.labels(switch.to, switch.reason).inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)


class PromptCacheCollector:
    """The prompt caches' counters and sizes, summed over `caches()` (all zero when the
    cache is off)."""

    def __init__(self, caches):
        self.caches = caches

    def collect(self):
        caches = [cache for cache in self.caches() if cache is not None]
        stores = [cache.store for cache in caches if cache.store is not None]
        series = (
            (CounterMetricFamily, "hits", "Requests that resumed from a cached prefix", [c.stats.hits for c in caches]),
            (CounterMetricFamily, "misses", "Requests that prefilled from the first token",
             [c.stats.misses for c in caches]),
            (CounterMetricFamily, "evictions", "Saved states dropped to stay within the memory budget",
             [c.stats.evictions for c in caches]),
            (CounterMetricFamily, "disk_hits", "Saved states loaded from --prompt-cache-dir",
             [c.stats.disk_hits for c in caches]),
            (GaugeMetricFamily, "saved_states", "Saved states held in memory", [c.saved_states for c in caches]),
            (GaugeMetricFamily, "bytes", "Bytes of KV rows and recurrent states the prompt cache holds",
             [c.nbytes for c in caches]),
            (GaugeMetricFamily, "budget_bytes", "The prompt cache's memory budget (--prompt-cache-size)",
             [c.budget for c in caches]),
            (GaugeMetricFamily, "disk_files", "State files in --prompt-cache-dir", [s.files for s in stores]),
            (GaugeMetricFamily, "disk_bytes", "Bytes of the state files in --prompt-cache-dir",
             [s.nbytes for s in stores]))
        for family, name, doc, values in series:
            metric = family(f"monolith_prompt_cache_{name}", doc)
            metric.add_metric([], sum(value or 0 for value in values))
            yield metric


class ModelCollector:
    """Each configured model's state (serving/models.py), labelled by its name: loaded or
    not, its last load's seconds, the bytes of its sessions' caches (KV rows and
    recurrent states of the running and kept sequences; the prompt cache's are
    monolith_prompt_cache_bytes)."""

    def __init__(self, pool):
        self.pool = pool

    def collect(self):
        loaded = GaugeMetricFamily("monolith_model_loaded", "1 while the model is loaded, else 0", labels=["model"])
        seconds = GaugeMetricFamily("monolith_model_load_seconds", "How long the model's last load took",
                                    labels=["model"])
        kv = GaugeMetricFamily("monolith_kv_cache_bytes", "Bytes of the model's sequence caches (KV rows and "
                                                          "recurrent states) in memory", labels=["model"])
        for slot in self.pool.slots:
            served = slot.served
            loaded.add_metric([slot.name], 0 if served is None else 1)
            seconds.add_metric([slot.name], slot.load_seconds)
            kv.add_metric([slot.name], 0 if served is None else served.engine.cache_bytes)
        yield from (loaded, seconds, kv)


class MemoryCollector:
    """MLX's allocator: bytes held by live arrays, bytes kept in its buffer cache for reuse,
    and the peak of the first since start. With `process_resident_memory_bytes` (the
    process collector's) and the prompt cache's bytes, these account for the RSS."""

    def collect(self):
        for name, doc, value in (
                ("active_bytes", "Bytes of MLX arrays alive now (weights, caches, the prompt cache)",
                 mx.get_active_memory()),
                ("cache_bytes", "Bytes MLX keeps in its buffer cache for reuse", mx.get_cache_memory()),
                ("peak_bytes", "The most bytes of MLX arrays alive at once since start", mx.get_peak_memory())):
            metric = GaugeMetricFamily(f"monolith_mlx_{name}", doc)
            metric.add_metric([], value)
            yield metric


# ------------------------------------------------------------------ the status tab's last minutes


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
