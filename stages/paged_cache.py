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

from .kv_pool import KVPool


@dataclass
class BatchLayout:
    """Where a forward of B rows x T tokens reads and writes in the pool."""

    batch_size: int
    num_tokens: int  # T, the same for every row
    offsets: mx.array | int  # per-row start position (an int when B == 1)
    slot_mapping: mx.array  # [B*T] pool slot of each new token
    kernel_table: mx.array  # [B, nkb] kernel blocks to gather
    kv_len: int  # B == 1: exact length to attend; else the padded length
    mask: mx.array | str | None  # [B, 1, T, L] bool, "causal", or None
    valid: mx.array | None  # [B, L] bool, B > 1 only: slots holding real keys

    @classmethod
    def build(cls, pool: KVPool, rows: list[tuple[tuple[int, ...], int, int]]) -> BatchLayout:
        """rows: (logical block table, start position, number of new tokens T)."""
        kb = pool.kernel_block_size
        bs = pool.block_size
        T = rows[0][2]
        tables = []
        slots = []
        for blocks, start, n in rows:
            if n != T:
                raise ValueError("every row of one forward feeds the same number of tokens")
            tables.append(pool.kernel_table(blocks, start + n))
            for pos in range(start, start + n):
                slots.append(blocks[pos // bs] * bs + pos % bs)
        nkb = max(len(t) for t in tables)
        table = mx.array([t + [0] * (nkb - len(t)) for t in tables], dtype=mx.int32)
        slot_mapping = mx.array(slots, dtype=mx.int32)
        if len(rows) == 1:
            start = rows[0][1]
            return cls(1, T, start, slot_mapping, table, start + T, "causal" if T > 1 else None, None)
        starts = mx.array([r[1] for r in rows], dtype=mx.int32)
        L = nkb * kb
        key_pos = mx.arange(L, dtype=mx.int32)
        query_pos = starts[:, None] + mx.arange(T, dtype=mx.int32)[None]  # [B, T]
        mask = key_pos[None, None, :] <= query_pos[:, :, None]  # [B, T, L]
        lengths = starts + T
        valid = key_pos[None, :] < lengths[:, None]
        return cls(len(rows), T, starts, slot_mapping, table, L, mask[:, None], valid)


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
        if window_size is not None and lay.kv_len > window_size:
            raise NotImplementedError("sliding-window attention is not supported on the paged pool yet")
        if return_array and isinstance(lay.mask, str):
            q = mx.arange(lay.kv_len - N, lay.kv_len)
            return q[:, None] >= mx.arange(lay.kv_len)[None]
        return lay.mask

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
        pool, lay = self.pool, self.layout
        B, H, T, D = keys.shape
        pool_k = pool.keys[self.layer]
        pool_v = pool.values[self.layer]
        pool_k[lay.slot_mapping] = keys.transpose(0, 2, 1, 3).reshape(B * T, H, D)
        pool_v[lay.slot_mapping] = values.transpose(0, 2, 1, 3).reshape(B * T, H, D)
        k = self._gather(pool_k, B, H, D)
        v = self._gather(pool_v, B, H, D)
        if B == 1:
            k = k[:, :, : lay.kv_len]
            v = v[:, :, : lay.kv_len]
        else:
            # masked slots get zero weight, but 0 * NaN is NaN: unwritten values must not
            # reach the weighted sum
            v = mx.where(lay.valid[:, None, :, None], v, mx.zeros((), dtype=v.dtype))
        return k, v

    def _gather(self, pool_array: mx.array, B: int, H: int, D: int) -> mx.array:
        kb = self.pool.kernel_block_size
        blocks = pool_array.reshape(-1, kb, H, D)[self.layout.kernel_table]  # [B, nkb, kb, H, D]
        return blocks.reshape(B, -1, H, D).transpose(0, 2, 1, 3)

    @property
    def state(self):  # mlx-lm reads cache.state in a few utilities; the pool is the state
        return ()
