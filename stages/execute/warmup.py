"""The warm-up before ready (execute.warmup): the step shapes a server meets, run once
through a throwaway runner on a private pool, so that MLX builds its kernels (its fused
ones too, traced) before the engine says ready rather than inside the first requests."""

from __future__ import annotations

import time
from typing import Any

from unikern import messages as m
from unikern.platform.kernel_cache import BUILDS
from unikern.stages.execute.layouts import row_bucket
from unikern.stages.execute.model import ModelGeometry
from unikern.stages.execute.runner import ModelRunner
from unikern.stages.kv.pool import KVPool

# Row counts of the decode windows and of the one-step decodes (a step while a request
# waits to join) run at warm-up, in models whose layers are all full attention. Kernels
# are built per variant, not per shape: one row (the slice path, or a gather where its
# blocks are not consecutive), up to 4 (the fused blocks' GEMVs on CUDA), 5-64 (their ops
# path), the GEMVs' power-of-two rows per pass (3, 5, 9 rows), a paged attention of 16+
# rows (its 8-warp blocks); a traced window's shape is its row bucket's. On the CPU
# machine (llama-5m, compile_decode and warmup "always", cpu_kernels off, an empty MLX
# kernel cache under a fresh TMPDIR), 32 requests arriving at 40/s, three rounds: the
# first round's TTFT p50 / p99 1.2-1.8 s / 1.6-2.3 s while two traced kernels of a
# several-row prefill were built on the request path (the old warm-up's two prompts ran
# as two one-row forwards), later rounds 0.07-0.3 s; with this warm-up none was built
# after ready and the first round's TTFT was 85 / 206 ms, the later ones' 57-85 / 148
WINDOW_ROWS = (1, 2, 3, 8, 16, 64)
STEP_ROWS = (2, 3, 5, 9, 17)
BLOCK_SIZE = 16
RESUMED = tuple(range(30, 38))  # the tokens a prompt goes on with after its written blocks


def warm_up(model: Any, geometry: ModelGeometry, cpu_kernels: bool, compile_decode: bool,
            paged_attention: bool = False, compile_one_row: bool = False, prefill_rows: int = 0,
            compile_prefill: bool = False) -> dict[str, Any]:
    """Run prefills of one and two rows (by rows too with `prefill_rows`, traced too with
    `compile_prefill`), the prompts going on after their written blocks (one and two rows),
    decode windows and one-step decodes of WINDOW_ROWS and STEP_ROWS
    rows (one and two rows where some layers are windowed or recurrent) and a sampled
    window. The engine's own pool is not touched: it stays unallocated until a request
    writes it. Rows beyond two share the two prompts' blocks (their writes collide: what
    they compute is never read)."""
    pool = KVPool(num_layers=geometry.num_layers, num_kv_heads=geometry.num_kv_heads, head_dim=geometry.head_dim,
                  dtype=geometry.dtype, block_size=BLOCK_SIZE, kernel_block_size=BLOCK_SIZE, num_blocks=14,
                  slab_blocks=14)
    runner = ModelRunner(model, pool, None, cpu_kernels, compile_decode, geometry,
                         paged_attention=paged_attention, compile_one_row=compile_one_row, prefill_rows=prefill_rows,
                         compile_prefill=compile_prefill)
    plain = geometry.is_plain
    greedy = m.SamplingParams(max_tokens=16)
    tables = {"a": (2, 3, 4, 5), "b": (6, 7, 8, 9), "c": (10, 12, 11, 13)}  # c: not consecutive (no slices)
    slots = {"a": 1, "b": 2, "c": 3}  # state slots (recurrent models), zeroed by the first step
    # ids every vocabulary has; a and b near enough in length to share a padded forward
    # (runner.PREFILL_PADDING_LIMIT: 24 and 10 tokens ran as two one-row forwards, which
    # left a two-row prefill's kernels to the first requests)
    prompts = {"a": tuple(range(1, 25)), "b": tuple(range(1, 21)), "c": tuple(range(3, 20))}
    start = time.perf_counter()
    timed: list[tuple[str, float]] = []  # (the step's rows and kind, its seconds)

    def run(step: m.Step, seeds: dict[str, int] | None = None) -> dict[str, list[int]]:
        t = time.perf_counter()
        out = runner.run(step, seeds or {})
        first_row = step.work[0]
        kind = "decode" if len(first_row.token_ids) == 1 else "prefill" if first_row.start_pos == 0 else "resume"
        timed.append((f"{kind} x{len(step.work)}" + (f" {step.num_steps} steps" if kind == "decode" else ""),
                      round(time.perf_counter() - t, 3)))
        return out

    def prefill(rows: list[str]) -> m.Step:
        return m.Step(0, tuple(m.SeqWork(r, prompts[r], 0, tables[r], True, greedy, state_slot=slots[r], state_from=0)
                               for r in rows), 1)

    two = prefill(["a", "b"])
    by_rows, runner.prefill_rows = runner.prefill_rows, 0
    traced, runner.compiled_prefill = runner.compiled_prefill, None
    first = run(two)  # the family's prefill, which longer prompts take
    if plain:
        first.update(run(prefill(["c"])))  # one row: its own kernels
    runner.prefill_rows, runner.compiled_prefill = by_rows, traced
    if traced is not None:
        run(two)  # the same keys again, traced (fused kernels built)
        if plain:
            run(prefill(["c"]))
    if by_rows >= len(prompts["a"]) + len(prompts["b"]):
        run(two)  # the same keys again, by rows

    def resume(rows: list[str], copies: tuple[tuple[int, int, int], ...] = ()) -> m.Step:
        # prompts going on after blocks already written, as a prefix-cache hit or a long
        # prompt's later chunk does: the pool read back (gathers, a mask per row where
        # several rows run, slices for one row on consecutive blocks), never traced
        return m.Step(0, tuple(m.SeqWork(r, RESUMED, len(prompts[r]), tables[r], True, greedy, state_slot=slots[r])
                               for r in rows), 1, copies)

    runner.prefill_rows = 0  # (by rows these would take the decode paths below)
    # with a partial prefix hit's copy (plain models take them): into c's last block, which
    # nothing reads
    run(resume(["a", "b"], ((2, 13, 8),) if plain else ()))
    run(resume(["a"]))  # consecutive blocks: slices
    if plain:
        run(resume(["c"]))  # scattered blocks: gathers
    runner.prefill_rows = by_rows

    def decode(count: int, num_steps: int, params: m.SamplingParams = greedy,
               names: tuple[str, ...] = ("a", "b")) -> m.Step:
        # rows past the names reuse their blocks and state slots under ids of their own
        rows = [names[i % len(names)] for i in range(count)]
        work = tuple(
            m.SeqWork(f"{r}{i}", (first[r][0],), len(prompts[r]), tables[r], True, params, num_generated=1,
                      state_slot=slots[r])
            for i, r in enumerate(rows)
        )
        return m.Step(1, work, num_steps)

    window_rows = WINDOW_ROWS if plain else (1, 2)
    for count in window_rows:
        run(decode(count, 4))
    if plain:
        run(decode(1, 4, names=("c",)))  # one row whose blocks are not consecutive: gathered
        for count in STEP_ROWS:
            run(decode(count, 1))
    sampled = m.SamplingParams(max_tokens=16, temperature=0.8, top_p=0.95)
    run(decode(2, 4, sampled), {"a0": 1, "b1": 2})
    return {"ran": True, "steps": len(timed), "seconds": round(time.perf_counter() - start, 3),
            "kernels": dict(BUILDS),  # unikern's kernels built in this process: compiled, read from disk
            "step_seconds": [f"{label}: {sec}" for label, sec in timed],
            "window_rows": sorted({row_bucket(n) for n in window_rows}) if compile_decode else list(window_rows),
            # the shapes traced (on the private pool: the engine's traces its own again)
            "traced_decode": sorted(runner.compiled.shapes) if runner.compiled is not None else [],
            "traced_prefill": sorted(traced.shapes) if traced is not None else []}
