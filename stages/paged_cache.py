"""The per-layer cache adapter that lets mlx-lm's model code run on the paged pool.

mlx-lm attention layers call `rope(x, offset=cache.offset)`, then
`cache.update_and_fetch(keys, values)`, then SDPA with the mask the model built through
`cache.make_mask(...)`. This adapter writes the new keys/values into the pool at the
batch's slots (an in-place scatter: the pool array is donated) and returns the
keys/values its block tables name, gathered by kernel block.
"""

from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx
import numpy as np

from .kv_pool import KVPool


@dataclass
class BatchLayout:
    """Where a forward of B rows x T tokens reads and writes in the pool."""

    batch_size: int
    num_tokens: int  # T, the same for every row
    offsets: mx.array | int  # per-row start position (an int when B == 1)
    write_slots: mx.array  # [B*T] pool slot of each new token
    read_slots: mx.array  # [B, L] pool slot of every position attended (0: the zero block)
    mask: mx.array | str | None  # [B, 1, T, L] bool, "causal", or None

    @classmethod
    def build(cls, pool: KVPool, rows: list[tuple[tuple[int, ...], int, int]]) -> BatchLayout:
        """rows: (logical block table, start position, number of new tokens T)."""
        bs = pool.block_size
        kb = pool.kernel_block_size
        T = rows[0][2]
        lengths = [start + n for _, start, n in rows]
        if any(n != T for _, _, n in rows):
            raise ValueError("every row of one forward feeds the same number of tokens")
        L = -(-max(lengths) // kb) * kb if len(rows) > 1 else lengths[0]
        read = np.zeros((len(rows), L), dtype=np.int32)
        offsets = np.arange(bs, dtype=np.int32)
        for i, (blocks, start, n) in enumerate(rows):
            slots = (np.asarray(blocks, dtype=np.int32)[:, None] * bs + offsets).reshape(-1)
            read[i, : start + n] = slots[: start + n]
        write = np.concatenate([read[i, start : start + n] for i, (_, start, n) in enumerate(rows)])
        read_slots = mx.array(read)
        write_slots = mx.array(write)
        if len(rows) == 1:
            start = rows[0][1]
            return cls(1, T, start, write_slots, read_slots, "causal" if T > 1 else None)
        starts = np.asarray([r[1] for r in rows], dtype=np.int32)
        query_pos = starts[:, None] + np.arange(T, dtype=np.int32)[None]  # [B, T]
        mask = np.arange(L, dtype=np.int32)[None, None, :] <= query_pos[:, :, None]
        return cls(len(rows), T, mx.array(starts), write_slots, read_slots, mx.array(mask[:, None]))


class PagedLayerCache:
    """What one attention layer sees as its cache during one forward."""

    def __init__(self, pool: KVPool, layer: int, layout: BatchLayout) -> None:
        self.pool = pool
        self.layer = layer
        self.layout = layout

    @property
    def offset(self) -> mx.array | int:
        return self.layout.offsets

    def make_mask(self, N: int, return_array: bool = False, window_size: int | None = None):
        lay = self.layout
        L = lay.read_slots.shape[1]
        if window_size is not None and L > window_size:
            raise NotImplementedError("sliding-window attention is not supported on the paged pool yet")
        if return_array and isinstance(lay.mask, str):
            q = mx.arange(L - N, L)
            return q[:, None] >= mx.arange(L)[None]
        return lay.mask

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
        pool, lay = self.pool, self.layout
        B, H, T, D = keys.shape
        pool_k = pool.keys[self.layer]
        pool_v = pool.values[self.layer]
        # [B, H, T, D] -> [H, B*T, D], scattered into the slot axis in place
        pool_k[:, lay.write_slots] = keys.transpose(1, 0, 2, 3).reshape(H, B * T, D)
        pool_v[:, lay.write_slots] = values.transpose(1, 0, 2, 3).reshape(H, B * T, D)
        # [H, B, L, D] -> [B, H, L, D]: each (row, head) stays one contiguous L x D matrix
        k = pool_k[:, lay.read_slots].transpose(1, 0, 2, 3)
        v = pool_v[:, lay.read_slots].transpose(1, 0, 2, 3)
        return k, v

    @property
    def state(self):  # mlx-lm reads cache.state in a few utilities; the pool is the state
        return ()
