"""Prometheus metrics of one server (one registry per app, so tests can run several).

Request, token and latency series are prefixed `monolith_`; the speculative counters
use vLLM's names (docs/drafts.md section 5) so existing dashboards read them, besides
ours for per-request drafting (docs/drafts.md 4.2): the fallback's plain rounds and its
switches between drafted and plain rounds, by direction and reason.
"""

from __future__ import annotations

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

    def bind(self, engine) -> None:
        """Read the queue gauges and the prompt cache's series from the engine at scrape time."""
        self.running.set_function(lambda: engine.running)
        self.waiting.set_function(lambda: engine.waiting)
        self.registry.register(PromptCacheCollector(engine.prompt_cache))
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
    """The prompt cache's counters and sizes (all zero when the cache is off)."""

    def __init__(self, cache):
        self.cache = cache

    def collect(self):
        cache = self.cache
        stats = None if cache is None else cache.stats
        store = None if cache is None else cache.store
        series = (
            (CounterMetricFamily, "hits", "Requests that resumed from a cached prefix", stats and stats.hits),
            (CounterMetricFamily, "misses", "Requests that prefilled from the first token", stats and stats.misses),
            (CounterMetricFamily, "evictions", "Saved states dropped to stay within the memory budget",
             stats and stats.evictions),
            (CounterMetricFamily, "disk_hits", "Saved states loaded from --prompt-cache-dir", stats and stats.disk_hits),
            (GaugeMetricFamily, "saved_states", "Saved states held in memory", cache and cache.saved_states),
            (GaugeMetricFamily, "bytes", "Bytes of KV rows and recurrent states the prompt cache holds",
             cache and cache.nbytes),
            (GaugeMetricFamily, "budget_bytes", "The prompt cache's memory budget (--prompt-cache-size)",
             cache and cache.budget),
            (GaugeMetricFamily, "disk_files", "State files in --prompt-cache-dir", store and store.files),
            (GaugeMetricFamily, "disk_bytes", "Bytes of the state files in --prompt-cache-dir", store and store.nbytes))
        for family, name, doc, value in series:
            metric = family(f"monolith_prompt_cache_{name}", doc)
            metric.add_metric([], value or 0)
            yield metric


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
