"""Sliding-window attention on the paged pool: which keys a windowed layer reads and
the exact mask over them, for every layout a step can take (one-row span, gathered
rows, fresh prompts, lookahead windows)."""

from __future__ import annotations

from typing import TYPE_CHECKING

import mlx.core as mx

if TYPE_CHECKING:
    from unikern.stages.execute.layouts import BatchLayout


def window_start(start: int, window: int | None) -> int:
    """The first key position a query at `start` or later can see (mlx-lm's rule: a
    query at q attends to keys q - window < k <= q, itself included)."""
    return max(0, start - window + 1) if window else 0


def window_mask(layout: BatchLayout, window: int, read_window: int | None) -> mx.array | None:
    """[B or 1, 1, T, L] bool over the keys `update_and_fetch` returns for this layout;
    `read_window` is the window the layer's reads were cut to (None: read from 0).
    None when every key read is visible to every query (a one-row decode)."""
    T = layout.num_tokens
    if layout.span is not None:
        _, start, end = layout.span
        lo = window_start(start, read_window)
        queries = mx.arange(start, end)[:, None]
        keys = mx.arange(lo, end)[None]
        if T == 1 and end - lo <= window:
            return None
    elif layout.read_slots is None:  # fresh prompts: this forward's own keys, from 0
        queries = mx.arange(T)[:, None]
        keys = mx.arange(T)[None]
    else:
        offsets = layout.offsets
        rows = mx.array([offsets]) if isinstance(offsets, int) else offsets
        queries = rows[:, None, None] + mx.arange(T)[None, :, None]  # [B, T, 1]
        keys = mx.arange(layout.read_slots.shape[1])[None, None]
        mask = (keys <= queries) & (queries - keys < window)
        return mask[:, None]
    mask = (keys <= queries) & (queries - keys < window)
    return mask[None, None]
