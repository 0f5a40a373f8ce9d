"""A lookahead window's decode step as one `mx.compile`d function over the pool arrays."""

from __future__ import annotations

from typing import Any

import mlx.core as mx

from unikern.stages.execute.paged_cache import DecodeWindow, PagedLayerCache, window_layout
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
    decode attention reads the pool itself (paged_attention.py: no mask) and
    execute.compile_one_row says so."""

    # MLX keeps every traced shape until the compiled function is dropped, and a server
    # whose batch size keeps changing meets new shapes for as long as it runs: the cache
    # starts over after this many (the shapes in use are traced again)
    max_traces = 128

    def __init__(self, model: Any, num_layers: int, paged: str | None = None) -> None:
        self.model = model
        self.num_layers = num_layers
        self.paged = paged  # PagedLayerCache's: decode attention straight from the pool
        self.traces = 0  # how many times a new shape was traced (tests, stats)
        self.resets = 0
        self._traces_kept = 0
        self._step = mx.compile(self._forward)

    def _forward(self, tokens, starts, step, write_table, read_slots, keys, values):
        self.traces += 1  # runs only while tracing
        self._traces_kept += 1
        layout = window_layout(starts, step, write_table, read_slots, mx.arange(read_slots.shape[1])[None])
        arrays = PoolArrays(list(keys), list(values))
        caches = [PagedLayerCache(arrays, i, layout, paged=self.paged) for i in range(self.num_layers)]
        logits = self.model(tokens[:, None], cache=caches)[:, -1, :]
        return logits, arrays.keys, arrays.values

    def __call__(self, pool: KVPool, window: DecodeWindow, tokens: mx.array, i: int) -> mx.array:
        if self._traces_kept >= self.max_traces:  # dropping the function frees its traces
            self._step = mx.compile(self._forward)
            self._traces_kept = 0
            self.resets += 1
        step = mx.array(i, dtype=mx.int32)
        logits, pool.keys, pool.values = self._step(
            tokens, window.starts, step, window.write_slots, window.read_slots, pool.keys, pool.values
        )
        return logits
