"""The load check's requests (mixed prompt lengths, shared prefixes, sampling, stop strings)
and its latency percentiles; tools/check/load.py and tools/check/load_library.py use both."""

from __future__ import annotations

import random
import statistics
from typing import Any


def make_requests(n: int, vocab: int, rng: random.Random, prefix: str = "r") -> list[dict[str, Any]]:
    """Mixed prompt lengths; 40% share one of four long prefixes (past one KV block)."""
    prefixes = [[rng.randrange(10, vocab) for _ in range(rng.choice((256, 300, 512)))] for _ in range(4)]
    words = ["def", "fib", "(n):", "return", "the", "model", "cache", "block", "token", "hello", "world"]
    requests = []
    for i in range(n):
        kind = rng.choices(("shared", "short", "medium", "long", "text"), (40, 25, 20, 5, 10))[0]
        body: dict[str, Any] = {"op": "generate", "id": f"{prefix}-{i}", "max_tokens": rng.randint(4, 48)}
        if kind == "text":
            body["prompt"] = " ".join(rng.choice(words) for _ in range(rng.randint(2, 40)))
        else:
            lo, hi = {"shared": (4, 64), "short": (4, 32), "medium": (64, 300), "long": (500, 1200)}[kind]
            tokens = [rng.randrange(10, vocab) for _ in range(rng.randint(lo, hi))]
            body["prompt_tokens"] = (rng.choice(prefixes) + tokens) if kind == "shared" else tokens
        if rng.random() < 0.2:
            body.update(temperature=0.8, seed=rng.randrange(1 << 30))
        if rng.random() < 0.1:  # stop strings: output tells schedule to end the request
            body["stop"] = [rng.choice(("e", "th", "\n"))]
        requests.append(body)
    return requests


def percentiles(values: list[float]) -> dict[str, float]:
    if not values:
        return {}
    ordered = sorted(values)

    def at(q: float) -> float:
        return ordered[min(len(ordered) - 1, int(q * len(ordered)))]

    return {"p50": at(0.50), "p90": at(0.90), "p99": at(0.99), "max": ordered[-1], "mean": statistics.fmean(ordered)}
