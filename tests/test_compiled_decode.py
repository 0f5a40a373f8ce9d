"""The compiled decode step (execute.compile_decode): the same tokens as mlx-lm, through
a graph traced once per shape. On the CPU backend it runs only when asked ("always"),
with the CPU kernels off, which is how these tests reach it."""

from __future__ import annotations

import pytest

import unikern
from tests.conftest import SMALL_KV, compare_greedy, complete_all, reference_greedy
from unikern import messages as m
from unikern.stages.execute.layouts import length_bucket, row_bucket
from unikern.stages.execute.model import ModelGeometry
from unikern.stages.execute.runner import ModelRunner
from unikern.stages.kv.pool import KVPool


@pytest.mark.parametrize("unit", [1, 16, 32])
def test_length_buckets_are_few_and_tight(unit):
    buckets = {length_bucket(n, unit) for n in range(1, 4097)}
    for n in range(1, 4097):
        b = length_bucket(n, unit)
        assert b >= n and b % unit == 0
        assert b <= max(-(-n // unit) * unit, 1.25 * n)  # at most a quarter more past 4 units
    for lo in (128, 256, 512, 1024, 2048):  # 4 per doubling once past 4 units
        if lo > 4 * unit:
            assert len({b for b in buckets if lo < b <= 2 * lo}) == 4


@pytest.mark.anyio
@pytest.mark.parametrize("family", ["tiny-llama", "tiny-qwen2"])  # float32 untied; bfloat16 tied
@pytest.mark.parametrize("prefill", ["never", "always"])  # execute.compile_prefill (test_compiled_prefill.py)
async def test_engine_with_compiled_decode_matches_mlx_lm(family, prefill, model_dir):
    path = model_dir(family)
    # 10 rows in flight decode in lookahead windows; unwritten slots hold NaN, so a
    # window reading a slot it should not would show in the tokens
    batch = [[(11 * i + 3 * j) % 1000 + 5 for j in range(5 + 23 * i)] for i in range(10)]
    overrides = {
        "kv": {**SMALL_KV["kv"], "block_size": 32, "unwritten_fill": "nan"},
        "execute": {"compile_decode": "always", "compile_prefill": prefill, "cpu_kernels": False},
    }
    async with unikern.Engine.from_pipeline("generate", model=path, overrides=overrides) as engine:
        results = await complete_all(engine, batch, max_tokens=20)
        stats = engine.stats()
    assert stats["compiled_decode"]["enabled"] and stats["compiled_decode"]["traces"] > 0
    # with it, the prompts' forwards ran traced (those of up to 512 tokens in all)
    assert (stats["compiled_prefill"]["forwards"] > 0) == (prefill == "always")
    for prompt, result in zip(batch, results, strict=True):
        ok, note = compare_greedy(result.token_ids, reference_greedy(path, prompt, 20))
        assert ok, f"{family}, prompt of {len(prompt)} tokens: {note}"


@pytest.mark.anyio
async def test_padded_windows_fed_the_tokens_left_on_the_device_match_mlx_lm(tiny_llama):
    """Windows planned while the one before runs (schedule.overlap_windows) take its
    sampled tokens from the device; the traced step pads those rows to its bucket too."""
    batch = [[(7 * i + 5 * j) % 900 + 5 for j in range(4 + 9 * i)] for i in range(6)]  # 6 rows: a bucket of 8
    overrides = {
        "kv": {**SMALL_KV["kv"], "block_size": 32, "unwritten_fill": "nan"},
        "schedule": {"overlap_windows": True},
        "execute": {"compile_decode": "always", "cpu_kernels": False},
    }
    async with unikern.Engine.from_pipeline("generate", model=tiny_llama, overrides=overrides) as engine:
        results = await complete_all(engine, batch, max_tokens=24)
        shapes = engine.stats()["compiled_decode"]["shapes"]
    assert any(shape.startswith("8x") for shape in shapes), shapes
    for prompt, result in zip(batch, results, strict=True):
        ok, note = compare_greedy(result.token_ids, reference_greedy(tiny_llama, prompt, 24))
        assert ok, f"prompt of {len(prompt)} tokens: {note}"


def compiled_runner(path: str) -> ModelRunner:
    """A runner with the compiled step on, over a 64-block pool of 16-token blocks."""
    from mlx_lm import load

    model, _ = load(path)
    geo = ModelGeometry(model)
    pool = KVPool(num_layers=geo.num_layers, num_kv_heads=geo.num_kv_heads, head_dim=geo.head_dim,
                  dtype=geo.dtype, block_size=16, kernel_block_size=16, num_blocks=64, slab_blocks=64)
    return ModelRunner(model, pool, compile_decode=True)


def test_compiled_step_is_traced_once_per_shape_and_not_for_one_row(tiny_llama):
    runner = compiled_runner(tiny_llama)
    params = m.SamplingParams(max_tokens=64)
    tables = {"a": tuple(range(2, 8)), "b": tuple(range(8, 14))}

    def window(rows, start, steps):
        work = tuple(m.SeqWork(r, (5,), start, tables[r], True, params, num_generated=1) for r in rows)
        return runner.run(m.Step(1, work, steps), {})

    window(["a"], 20, 8)
    assert runner.compiled.traces == 0  # one row: the unmasked slice path
    window(["a", "b"], 20, 8)
    traced = runner.compiled.traces
    assert traced == 1
    first = window(["a", "b"], 20, 8)
    again = window(["a", "b"], 24, 8)  # same row count and length bucket: replayed
    assert runner.compiled.traces == traced and first == window(["a", "b"], 20, 8)
    window(["a", "b"], 60, 8)  # a longer window: a new length bucket, traced once more
    assert runner.compiled.traces == traced + 1
    runner.compiled = None  # the same windows, op by op, give the same tokens
    assert window(["a", "b"], 20, 8) == first and window(["a", "b"], 24, 8) == again


@pytest.mark.anyio
async def test_warmup_runs_before_ready_and_leaves_the_pool_unallocated(tiny_llama):
    overrides = {**SMALL_KV, "execute": {"warmup": "always"}}
    async with unikern.Engine.from_pipeline("generate", model=tiny_llama, overrides=overrides) as engine:
        before = engine.stats()
        results = await complete_all(engine, [[5, 6, 7, 8]], max_tokens=6)
        after = engine.stats()
    # prefills of 2 and 1 rows, then 2 and 1 and 1 going on after written blocks, windows of
    # 1-64 rows (and one of a row's scattered blocks),
    # one-step decodes of 2-17 rows, a sampled window
    assert before["warmup"]["ran"] and before["warmup"]["steps"] == 18
    assert before["warmup"]["window_rows"] == [1, 2, 3, 8, 16, 64]
    # the warm-up ran on its own pool: the engine's still holds nothing (lazy growth)
    assert before["memory"]["kv_resident_bytes"] == 0
    # the CPU kernels were installed by the warm-up's runner and again by the engine's: once
    assert after["kernels"]["enabled"] and after["kernels"]["swiglu_layers"] == 4
    ok, note = compare_greedy(results[0].token_ids, reference_greedy(tiny_llama, [5, 6, 7, 8], 6))
    assert ok, note


def test_the_trace_cache_starts_over_past_its_bound(tiny_llama, monkeypatch):
    from unikern.stages.execute.compiled import CompiledDecode

    monkeypatch.setattr(CompiledDecode, "max_traces", 3)
    runner = compiled_runner(tiny_llama)
    params = m.SamplingParams(max_tokens=64)

    def window(rows: int, runner=runner):
        work = tuple(m.SeqWork(f"r{j}", (5,), 20, tuple(range(2 + 4 * j, 6 + 4 * j)), True, params, num_generated=1)
                     for j in range(rows))
        return runner.run(m.Step(1, work, 4), {})

    # three shapes (row buckets) fill the cache; the 8-row window's next step starts it
    # over and traces its own shape again
    first = [window(rows) for rows in (2, 4, 8)]
    assert runner.compiled.traces == 4 and runner.compiled.resets == 1
    assert window(2) == first[0] and runner.compiled.traces == 5  # dropped with the reset: traced again
    runner.compiled = None
    assert [window(rows) for rows in (2, 4, 8)] == first  # the uncompiled path agrees


def test_row_buckets_are_few_and_tight():
    buckets = [row_bucket(n) for n in range(1, 65)]
    assert sorted(set(buckets)) == [1, 2, 4, 8, 16, 24, 32, 40, 48, 56, 64]
    assert all(n <= b and (b - n <= 7 if n <= 32 else b <= 1.25 * n) for n, b in zip(range(1, 65), buckets, strict=True))


def test_row_counts_of_one_bucket_share_a_trace_and_keep_their_tokens(tiny_llama):
    runner = compiled_runner(tiny_llama)
    params = m.SamplingParams(max_tokens=64)

    def window(rows: int, steps: int, runner=runner):
        work = tuple(m.SeqWork(f"r{j}", (5 + j,), 50 + j, tuple(range(2 + 4 * j, 6 + 4 * j)), True, params,
                               num_generated=1) for j in range(rows))
        return runner.run(m.Step(1, work, steps), {})

    # 5 to 8 rows run as 8, windows of 3 to 7 steps through one write table, all within
    # the 64-position length bucket: one trace
    shapes = ((5, 4), (6, 6), (7, 3), (8, 7))
    traced = {rows: window(rows, steps) for rows, steps in shapes}
    assert runner.compiled.traces == 1
    assert set(runner.compiled.shapes) == {"8x64x32/1024"}
    runner.compiled = None  # op by op, unpadded: the same tokens
    assert {rows: window(rows, steps) for rows, steps in shapes} == traced
