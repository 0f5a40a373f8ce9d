"""The paged KV pool end to end: prefix caching, preemption, lazy allocation."""

from __future__ import annotations

import json
import subprocess
import sys

import anyio
import pytest

import unikern
from tests.conftest import compare_greedy, complete_all, reference_greedy

pytestmark = pytest.mark.anyio


async def test_shared_600_token_prefix_is_served_from_cache(tiny_llama):
    prefix = [(11 * j) % 1000 + 7 for j in range(600)]
    prompts = [prefix + [20 + i, 30 + i] for i in range(16)]
    overrides = {"kv": {"kv_budget_bytes": 64 << 20, "block_size": 256}, "schedule": {"max_num_batched_tokens": 512}}
    async with unikern.Engine.from_pipeline("generate", model=tiny_llama, overrides=overrides) as engine:
        results = await complete_all(engine, prompts, 8)
        stats = engine.stats()
    cached = sum(r.usage.cached_tokens for r in results)
    assert cached >= 15 * 512, [r.usage.cached_tokens for r in results]
    assert stats["kv"]["blocks_used"] == 0 and stats["kv"]["blocks_cached"] >= 2
    for prompt, result in zip(prompts, results, strict=True):
        ok, note = compare_greedy(result.token_ids, reference_greedy(tiny_llama, prompt, 8))
        assert ok, note


async def test_preemption_keeps_parity_with_a_two_sequence_budget(tiny_llama):
    """16 requests on a pool that holds about two of them: preempt and recompute,
    never fail or deadlock, same tokens as mlx-lm, every block back at the end."""
    bytes_per_block = 2 * 4 * 32 * 2 * 32 * 4  # layers x block x kv heads x head dim x f32
    prompts = [[(5 * i + 3 * j) % 900 + 9 for j in range(30 + 3 * i)] for i in range(16)]
    overrides = {
        "kv": {"kv_budget_bytes": 6 * bytes_per_block, "block_size": 32},
        "schedule": {"max_num_batched_tokens": 64, "decode_lookahead": 4},
    }
    async with unikern.Engine.from_pipeline("generate", model=tiny_llama, overrides=overrides) as engine:
        assert engine.stats()["kv"]["blocks_total"] == 6
        with anyio.fail_after(120):
            results = await complete_all(engine, prompts, 24)
        stats = engine.stats()
    assert stats["schedule"]["preemptions"] > 0
    assert stats["kv"]["blocks_used"] == 0
    for prompt, result in zip(prompts, results, strict=True):
        ok, note = compare_greedy(result.token_ids, reference_greedy(tiny_llama, prompt, 24))
        assert ok, note


def worker_rss_after_one_request(model: str, allocation: str) -> dict:
    lines = (
        json.dumps({"op": "generate", "id": "one", "prompt_tokens": list(range(5, 105)), "max_tokens": 8})
        + "\n"
    )
    proc = subprocess.Popen(
        [sys.executable, "-m", "unikern", "worker", "--model", model,
         "--set", f"kv.kv_budget_bytes={3 << 30}", "--set", f"kv.allocation={allocation}"],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
    )
    assert proc.stdout.readline()  # ready
    proc.stdin.write(lines)
    proc.stdin.flush()
    while json.loads(proc.stdout.readline())["event"] != "done":
        pass
    proc.stdin.write(json.dumps({"op": "stats"}) + "\n")
    proc.stdin.flush()
    stats = json.loads(proc.stdout.readline())
    proc.stdin.close()
    assert proc.wait(60) == 0
    proc.stdout.close()
    return stats


def test_lazy_pool_commits_what_is_written_not_the_budget(tiny_llama):
    lazy = worker_rss_after_one_request(tiny_llama, "lazy")
    eager = worker_rss_after_one_request(tiny_llama, "eager")
    assert lazy["memory"]["kv_budget_bytes"] == eager["memory"]["kv_budget_bytes"] >= (3 << 30) - (1 << 20)
    gap = eager["memory"]["rss_bytes"] - lazy["memory"]["rss_bytes"]
    assert gap >= 2.5 * (1 << 30), f"eager - lazy RSS = {gap / 2**30:.2f} GiB"
    assert lazy["memory"]["kv_resident_bytes"] < 256 << 20
