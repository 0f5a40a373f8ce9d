"""Prometheus metrics of one server (`unikern_*`), in a registry of its own."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
)

TTFT_BUCKETS_S = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0,
                  2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0)
ITL_BUCKETS_S = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4,
                 0.5, 0.75, 1.0, 2.5, 5.0, 10.0, 20.0)
CONTENT_TYPE = CONTENT_TYPE_LATEST


class ServerMetrics:
    """Request counts are kept here as requests move; KV figures are read from the
    engine's stats at each scrape."""

    def __init__(self) -> None:
        self.registry = r = CollectorRegistry()
        self.running = Gauge("unikern_num_requests_running", "Requests producing tokens", registry=r)
        self.waiting = Gauge(
            "unikern_num_requests_waiting", "Requests submitted but not yet producing tokens", registry=r
        )
        self.kv_usage = Gauge(
            "unikern_kv_cache_usage_perc", "Fraction of the KV cache's blocks in use (0-1)", registry=r
        )
        self.kv_blocks_used = Gauge("unikern_kv_blocks_used", "KV blocks referenced by requests", registry=r)
        self.kv_blocks_total = Gauge("unikern_kv_blocks_total", "KV blocks in the budget", registry=r)
        self.prompt_tokens = Counter("unikern_prompt_tokens", "Prompt tokens of finished requests", registry=r)
        self.generation_tokens = Counter("unikern_generation_tokens", "Tokens generated", registry=r)
        self.prefix_hits = Counter(
            "unikern_prefix_cache_hit_tokens", "Prompt tokens served from the KV cache", registry=r
        )
        self.success = Counter(
            "unikern_request_success", "Requests that ended, by finish reason", ["finish_reason"], registry=r
        )
        self.rejected = Counter(
            "unikern_request_rejected", "Requests refused with an HTTP error, by status", ["status"], registry=r
        )
        self.ttft = Histogram(
            "unikern_time_to_first_token_seconds", "From the request's arrival to its first token",
            buckets=TTFT_BUCKETS_S, registry=r,
        )
        self.itl = Histogram(
            "unikern_inter_token_latency_seconds", "Between consecutive tokens of a request",
            buckets=ITL_BUCKETS_S, registry=r,
        )

    def render(self, stats: Callable[[], dict[str, Any]] | None) -> bytes:
        """The text exposition, KV gauges refreshed from `stats()` (None: not ready)."""
        if stats is not None:
            kv = stats().get("kv", {})
            used, total = kv.get("blocks_used", 0), kv.get("blocks_total", 0)
            self.kv_blocks_used.set(used)
            self.kv_blocks_total.set(total)
            self.kv_usage.set(used / total if total else 0.0)
        return generate_latest(self.registry)
