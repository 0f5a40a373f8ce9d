"""A lookahead window's decode step, and a forward of fresh prompts, each as one
`mx.compile`d function over the pool arrays."""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Callable
from typing import Any

import mlx.core as mx
import numpy as np

from unikern.stages.execute.layouts import (
    SCRATCH_BLOCK,
    BatchLayout,
    DecodeWindow,
    block_slots,
    length_bucket,
    window_layout,
)
from unikern.stages.execute.paged_cache import PagedLayerCache, flat_positions, rows_at
from unikern.stages.kv.pool import KVPool


class PoolArrays:
    """The pool's per-layer arrays as a compiled decode step sees them: its inputs,
    written in place by the layer caches (as they write the pool), then its outputs."""

    def __init__(self, keys: list[mx.array], values: list[mx.array]) -> None:
        self.keys = keys
        self.values = values


class CompiledDecode:
    """One decode step of a lookahead window as a single `mx.compile`d function: the
    model's forward over the window's tables with the pool arrays as state in and out.
    The graph is traced once per shape (rows, window length bucket, pool size) and
    replayed with its elementwise chains fused, instead of being built op by op in
    Python for every token. The pool writes are still in place: once the caller holds
    the returned arrays, the old ones are referenced by the graph alone and donated.
    Used for windows of several rows; one row keeps the unmasked slice path, whose SDPA
    stays on MLX's fused decode kernel (tools/results/H200.md, round R7), unless the
    decode attention reads the pool itself (cuda/paged_attention.py: no mask) and
    execute.compile_one_row says so."""

    # MLX keeps every traced shape until the compiled function is dropped: the cache starts
    # over after this many (the shapes in use are traced again). The shapes are bounded:
    # 11 row buckets to 64 rows (layouts.row_bucket), 4 length buckets per doubling,
    # one write table, one per pool capacity; 128 was below what one round of 64 staggered
    # requests could meet before the rows and write tables were bucketed
    max_traces = 256

    def __init__(self, model: Any, num_layers: int, paged: str | None = None) -> None:
        self.model = model
        self.num_layers = num_layers
        self.paged = paged  # PagedLayerCache's: decode attention straight from the pool
        self.traces = 0  # how many times a new shape was traced (tests, stats)
        self.resets = 0
        self.trace_s = 0.0  # seconds the calls that traced took (the trace itself: the step runs later)
        self.shapes: Counter[str] = Counter()  # traces per "rows x length x steps / pool slots" (stats)
        self._traces_kept = 0
        self._step = mx.compile(self._forward)

    def _forward(self, tokens, starts, step, write_table, read_slots, keys, values):
        self.traces += 1  # runs only while tracing
        self._traces_kept += 1
        layout = window_layout(starts, step, write_table, read_slots, mx.arange(read_slots.shape[1])[None])
        arrays = PoolArrays(list(keys), list(values))
        # no write markers out: every row samples, and each layer's read of the pool takes
        # its write's marker, so the sampled tokens run every write (CompiledPrefill's differ)
        caches = [PagedLayerCache(arrays, i, layout, paged=self.paged) for i in range(self.num_layers)]
        logits = self.model(tokens[:, None], cache=caches)[:, -1, :]
        return logits, arrays.keys, arrays.values

    def __call__(self, pool: KVPool, window: DecodeWindow, tokens: mx.array, i: int) -> mx.array:
        if self._traces_kept >= self.max_traces:  # dropping the function frees its traces
            self._step = mx.compile(self._forward)
            self._traces_kept = 0
            self.resets += 1
        step = mx.array(i, dtype=mx.int32)
        traced, started = self.traces, time.perf_counter()
        logits, pool.keys, pool.values = self._step(
            tokens, window.starts, step, window.write_slots, window.read_slots, pool.keys, pool.values
        )
        if self.traces != traced:
            self.trace_s += time.perf_counter() - started
            B, L = window.read_slots.shape
            self.shapes[f"{B}x{L}x{window.write_slots.shape[0]}/{pool.keys[0].shape[1]}"] += 1
        return logits


class CompiledPrefill:
    """A forward of fresh prompts (every row starts at position 0, so attention reads only
    the forward's own keys) as one `mx.compile`d function: the rows right-padded to a
    length bucket (layouts.length_bucket: 16, 32, 48, 64, then four lengths per
    doubling), traced once per (rows, bucket, pool size) and replayed, instead of the
    model's graph built op by op in Python for every prompt. On an H200 the 64-token 1B
    prefill's build was 1.5-2.4 ms of a 5-8 ms step in the engine (tools/probe/step_gaps.py).
    The padded positions write the scratch block and the
    causal mask keeps them out of every real position; logits come from each row's last
    real token."""

    max_traces = 64  # kept shapes before the traces start over (CompiledDecode's reason)
    max_tokens = 512  # rows x bucket; longer forwards are the GPU's, not the host's, to pace
    unit = 16  # the length buckets' unit

    def __init__(self, model: Any, num_layers: int, head: Callable[[mx.array], mx.array] | None = None,
                 paged: str | None = None) -> None:
        self.model = model
        self.num_layers = num_layers
        self.head = head  # the LM head alone (runner.split_head): logits of the last tokens only
        self.paged = paged
        self.traces = 0  # shapes traced (tests, stats)
        self.forwards = 0  # forwards run through it (stats)
        self.trace_s = 0.0  # seconds the calls that traced took
        self.shapes: Counter[str] = Counter()  # traces per "rows x bucket / pool slots" (stats)
        self._traces_kept = 0
        self._forward_fn = mx.compile(self._forward)

    def bucket(self, rows: list[tuple[tuple[int, ...], int, int]]) -> int | None:
        """The padded length these rows would run at, or None where they do not take the
        traced forward: a row that does not start a prompt, one token, or too many tokens."""
        if any(start != 0 for _, start, _ in rows):
            return None
        T = max(n for _, _, n in rows)
        bucket = length_bucket(T, self.unit)
        return bucket if T > 1 and len(rows) * bucket <= self.max_tokens else None

    def _forward(self, tokens, write_slots, last, keys, values):
        self.traces += 1  # runs only while tracing
        self._traces_kept += 1
        B, T = tokens.shape
        layout = BatchLayout(B, T, 0, write_slots, None, "causal", [])
        arrays, writes = PoolArrays(list(keys), list(values)), []
        caches = [PagedLayerCache(arrays, i, layout, paged=self.paged, writes=writes) for i in range(self.num_layers)]
        if self.head is not None:
            logits = self.head(rows_at(self.model.model(tokens, cache=caches), last))
        else:
            logits = rows_at(self.model(tokens, cache=caches), last)
        # the write kernel's markers are outputs: the pool arrays come back as the very
        # inputs (written in place), so evaluating them alone would not run the forward
        return logits, arrays.keys, arrays.values, writes

    def __call__(self, pool: KVPool, rows: list[tuple[tuple[int, ...], int, int]], tokens: list[list[int]],
                 bucket: int, writes: list[mx.array]) -> mx.array:
        """Logits [B, vocab] at each row's last token; the pool's arrays are the forward's,
        the write kernel's markers go into `writes` (runner._written)."""
        if self._traces_kept >= self.max_traces:
            self._forward_fn = mx.compile(self._forward)
            self._traces_kept = 0
        bs = pool.block_size
        write = np.full((len(rows), bucket), SCRATCH_BLOCK * bs, dtype=np.int32)
        padded = np.zeros((len(rows), bucket), dtype=np.uint32)  # (TOKEN_DTYPE)
        for i, ((blocks, _, n), row) in enumerate(zip(rows, tokens, strict=True)):
            write[i, :n] = block_slots(blocks, bs)[:n]
            padded[i, :n] = row
        self.forwards += 1
        last = flat_positions([n - 1 for _, _, n in rows], bucket)
        traced, started = self.traces, time.perf_counter()
        logits, pool.keys, pool.values, markers = self._forward_fn(
            mx.array(padded), mx.array(write.reshape(-1)), last, pool.keys, pool.values)
        writes.extend(markers)
        if self.traces != traced:
            self.trace_s += time.perf_counter() - started
            self.shapes[f"{len(rows)}x{bucket}/{pool.keys[0].shape[1]}"] += 1
        return logits
