"""Warm-up at start: the step shapes a server meets first run once through a throwaway
runner, so that MLX builds its GPU kernels (and a traced step its fused ones) before the
engine says ready, not inside the first requests (execute.warmup)."""

from __future__ import annotations

import time
from typing import Any

from unikern import messages as m
from unikern.stages.execute.model import ModelGeometry
from unikern.stages.execute.runner import ModelRunner
from unikern.stages.kv.pool import KVPool


def warm_up(model: Any, geometry: ModelGeometry, cpu_kernels: bool, compile_decode: bool,
            paged_attention: bool = False, compile_one_row: bool = False, prefill_rows: int = 0,
            compile_prefill: bool = False) -> dict[str, Any]:
    """Run the step shapes a server meets first (a two-row prefill, by rows too with
    `prefill_rows`, traced too with `compile_prefill`, a one-row decode window, a two-row
    decode window) through a throwaway runner on a private pool of a few blocks, so that MLX builds its GPU
    kernels, and the compiled step its fused ones, before the engine says ready rather
    than inside the first requests. The engine's own pool is not touched: it stays
    unallocated until a request writes it."""
    block_size = 16
    pool = KVPool(num_layers=geometry.num_layers, num_kv_heads=geometry.num_kv_heads, head_dim=geometry.head_dim,
                  dtype=geometry.dtype, block_size=block_size, kernel_block_size=block_size, num_blocks=10,
                  slab_blocks=10)
    runner = ModelRunner(model, pool, None, cpu_kernels, compile_decode, geometry,
                         paged_attention=paged_attention, compile_one_row=compile_one_row, prefill_rows=prefill_rows,
                         compile_prefill=compile_prefill)
    params = m.SamplingParams(max_tokens=16)
    tables = {"a": (2, 3, 4, 5), "b": (6, 7, 8, 9)}
    slots = {"a": 1, "b": 2}  # state slots (recurrent models), zeroed by the first step
    prompts = {"a": tuple(range(1, 25)), "b": tuple(range(1, 11))}  # ids every vocabulary has
    start = time.perf_counter()
    prefill = m.Step(0, tuple(
        m.SeqWork(r, p, 0, tables[r], True, params, state_slot=slots[r], state_from=0) for r, p in prompts.items()
    ), 1)
    by_rows, runner.prefill_rows = runner.prefill_rows, 0
    traced, runner.compiled_prefill = runner.compiled_prefill, None
    first = runner.run(prefill, {})  # the family's prefill, which longer prompts take
    runner.prefill_rows, runner.compiled_prefill = by_rows, traced
    steps = 3
    if traced is not None:
        first = runner.run(prefill, {})  # the same keys again, traced (fused kernels built)
        steps += 1
    if by_rows >= len(prompts["a"]) + len(prompts["b"]):
        first = runner.run(prefill, {})  # the same keys again, by rows
        steps += 1

    def window(rows: list[str], steps: int) -> m.Step:
        work = tuple(
            m.SeqWork(r, (first[r][0],), len(prompts[r]), tables[r], True, params, num_generated=1,
                      state_slot=slots[r])
            for r in rows
        )
        return m.Step(1, work, steps)

    runner.run(window(["a"], 4), {})
    runner.run(window(["a", "b"], 4), {})
    return {"ran": True, "steps": steps, "seconds": round(time.perf_counter() - start, 3)}
