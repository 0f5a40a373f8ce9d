"""The requests and runs the benchmarks share: seeded prompts, the engine settings a batch
needs, one batch through mlx-lm and one through a unikern Engine."""

from __future__ import annotations

import random
import statistics
import time


def make_prompts(n: int, vocab: int, lo: int, hi: int, seed: int) -> list[list[int]]:
    """`n` prompts of `lo`-`hi` random token ids (ids 10 to vocab-10), the same for a seed."""
    rng = random.Random(seed)
    return [[rng.randrange(10, vocab - 10) for _ in range(rng.randint(lo, hi))] for _ in range(n)]


def batch_room(levels: list[int], token_budget: int) -> dict[str, dict]:
    """The schedule settings a benchmark's largest batch needs: every request of the
    highest level in one step, and `token_budget` tokens per step for their prefills."""
    return {"schedule": {"max_num_seqs": max(levels), "max_num_batched_tokens": token_budget}}


def engine_overrides(base: dict[str, dict], assignments: list[str]) -> dict[str, dict]:
    """A benchmark's engine settings: `base` (what the benchmark needs, e.g. room for its
    batch), then the user's STAGE.KEY=VALUE assignments over it, key by key."""
    from unikern.spec import parse_overrides

    merged = {stage: dict(values) for stage, values in base.items()}
    for stage, values in parse_overrides(list(assignments)).items():
        merged.setdefault(stage, {}).update(values)
    return merged


def run_mlx_lm(model, tokenizer, prompts, max_tokens) -> dict:
    """One batch through mlx-lm: {"wall", "tokens", "ttft"} (ttft: None for batch_generate,
    which reports no first token)."""
    import mlx.core as mx
    from mlx_lm import batch_generate, stream_generate

    start = time.perf_counter()
    if len(prompts) == 1:
        n, first = 0, None
        for _ in stream_generate(model, tokenizer, mx.array(prompts[0]), max_tokens=max_tokens):
            first = first or time.perf_counter() - start
            n += 1
        return {"wall": time.perf_counter() - start, "tokens": n, "ttft": first}
    response = batch_generate(model, tokenizer, prompts, max_tokens=max_tokens, return_token_ids=True)
    return {"wall": time.perf_counter() - start, "tokens": sum(len(t) for t in response.token_ids), "ttft": None}


async def run_unikern(engine, prompts, max_tokens) -> dict:
    """One batch through a unikern Engine, every prompt a concurrent request:
    {"wall", "tokens", "ttft"} (ttft: the median request's first token, from the start)."""
    import anyio

    from unikern import TokenEvent

    counts, firsts = [0] * len(prompts), [0.0] * len(prompts)
    start = time.perf_counter()

    async def one(i):
        async for event in engine.generate(prompt_tokens=prompts[i], max_tokens=max_tokens):
            if isinstance(event, TokenEvent):
                if counts[i] == 0:
                    firsts[i] = time.perf_counter() - start
                counts[i] += 1

    async with anyio.create_task_group() as tg:
        for i in range(len(prompts)):
            tg.start_soon(one, i)
    return {"wall": time.perf_counter() - start, "tokens": sum(counts), "ttft": statistics.median(firsts)}
