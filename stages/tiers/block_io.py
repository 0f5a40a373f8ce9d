"""Whole logical blocks of the KV pool read and written through zero-copy numpy views, so
that offload moves a block between the pool and a contiguous buffer (the disk payload)
without an extra copy. A mixed model's layer groups (`GroupedPools`) make one payload of
both pools' blocks, in the model's layer order: the same file as one shared pool's."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass

import mlx.core as mx
import numpy as np

from unikern.platform.bridge import Bridge, BridgeCopyError, mlx_buffer
from unikern.stages.kv.pool import KVPool

LAYOUT = "head-major-v1"  # names the payload layout in the disk namespace
_BITS = {1: mx.uint8, 2: mx.uint16, 4: mx.uint32}


@dataclass(frozen=True)
class BlockLayout:
    """The shape of one logical block as a contiguous payload: [2, L, H, bs, D].

    In the head-major pool a logical block b is, per layer and for keys and values, the
    slots [b*bs, (b+1)*bs) of every head: H strided pieces, not one contiguous range. So a
    block moves between the pool and this payload by one strided numpy copy per layer and
    kind, through a view of the pool's own memory.
    """

    num_layers: int
    num_kv_heads: int
    block_size: int
    head_dim: int
    dtype: str  # e.g. "bfloat16"
    itemsize: int

    @classmethod
    def of(cls, pool: KVPool | GroupedPools) -> BlockLayout:
        return cls(
            pool.num_layers,
            pool.num_kv_heads,
            pool.block_size,
            pool.head_dim,
            str(pool.dtype).rsplit(".", 1)[-1],
            pool.dtype.size,
        )

    @property
    def shape(self) -> tuple[int, int, int, int, int]:
        return (2, self.num_layers, self.num_kv_heads, self.block_size, self.head_dim)

    @property
    def nbytes(self) -> int:
        return 2 * self.num_layers * self.num_kv_heads * self.block_size * self.head_dim * self.itemsize

    def new_buffer(self) -> np.ndarray:
        return np.empty(self.nbytes, np.uint8)

    def as_elements(self, buffer: np.ndarray) -> np.ndarray:
        """A [2, L, H, bs, D] unsigned-int view of a flat byte buffer (same bits)."""
        if buffer.nbytes != self.nbytes:
            raise ValueError(f"buffer is {buffer.nbytes} bytes, a block is {self.nbytes}")
        return buffer.view(np.dtype(f"u{self.itemsize}")).reshape(self.shape)


@contextmanager
def pool_views(pool: KVPool, bridge: Bridge) -> Iterator[tuple[list[np.ndarray], list[np.ndarray]]]:
    """(keys, values): per layer a writable [H, slots, D] view of the pool's own memory,
    as unsigned ints of the same width (numpy has no bfloat16). Dropped on exit.

    Checked: a view that is not the pool's memory raises. Model thread only: the pool
    arrays are replaced by steps and by growth, and a live view stops MLX from updating
    the pool in place (every step would copy the whole pool), so views are taken and
    dropped within one call."""
    bits = _BITS[pool.dtype.size]
    keys, values = [], []
    try:
        for source, views in ((pool.keys, keys), (pool.values, values)):
            for array in source:
                mx.eval(array)
                as_bits = array.view(bits)
                view = bridge.to_numpy(as_bits)
                if view.__array_interface__["data"][0] != mlx_buffer(array)[0]:
                    raise BridgeCopyError("a pool view is not the pool's memory")
                views.append(view)
                del as_bits
        yield keys, values
    finally:
        keys.clear()
        values.clear()


@dataclass(frozen=True)
class GroupedPools:
    """The full layers' pool and the windowed layers' pool of a mixed model as one
    payload: `order` names, per attention layer of the model, (0: full pool, 1: window
    pool) and its index there. Blocks are (full block id, window block id) pairs."""

    pool: KVPool
    window_pool: KVPool
    order: tuple[tuple[int, int], ...]

    @classmethod
    def of(cls, pool: KVPool, window_pool: KVPool, kinds: Sequence[str]) -> GroupedPools:
        """`kinds`: "full" or "window" per attention layer, in the model's order."""
        order = tuple((int(k == "window"), list(kinds[:i]).count(k)) for i, k in enumerate(kinds))
        return cls(pool, window_pool, order)

    @property
    def num_layers(self) -> int:
        return len(self.order)

    # heads, head width, dtype and block size are the same in both pools
    @property
    def num_kv_heads(self) -> int:
        return self.pool.num_kv_heads

    @property
    def block_size(self) -> int:
        return self.pool.block_size

    @property
    def head_dim(self) -> int:
        return self.pool.head_dim

    @property
    def dtype(self) -> mx.Dtype:
        return self.pool.dtype


def tier_pools(kv) -> KVPool | GroupedPools:
    """What the tiers copy blocks of: the `kv` resource's pool, or both of its layer
    groups' pools as one payload."""
    if kv.window_pool is None:
        return kv.pool
    return GroupedPools.of(kv.pool, kv.window_pool, kv.attention_kinds)


def copy_out(pool: KVPool | GroupedPools, bridge: Bridge, block_ids: Sequence, buffers: Sequence[np.ndarray]) -> None:
    """Copy each block's bytes into its contiguous buffer (layout `BlockLayout.of(pool)`)."""
    if isinstance(pool, GroupedPools):
        return _grouped(pool, bridge, block_ids, buffers, out=True)
    layout = BlockLayout.of(pool)
    bs = pool.block_size
    with pool_views(pool, bridge) as (keys, values):
        for block_id, buffer in zip(block_ids, buffers, strict=True):
            out = layout.as_elements(buffer)
            slots = slice(block_id * bs, (block_id + 1) * bs)
            for layer in range(pool.num_layers):
                out[0, layer] = keys[layer][:, slots]
                out[1, layer] = values[layer][:, slots]


def copy_in(pool: KVPool | GroupedPools, bridge: Bridge, block_ids: Sequence, buffers: Sequence[np.ndarray]) -> None:
    """Write each contiguous buffer into its block of the pool, growing the pool first."""
    if not block_ids:
        return
    if isinstance(pool, GroupedPools):
        return _grouped(pool, bridge, block_ids, buffers, out=False)
    pool.ensure_capacity(max(block_ids) + 1)
    layout = BlockLayout.of(pool)
    bs = pool.block_size
    with pool_views(pool, bridge) as (keys, values):
        for block_id, buffer in zip(block_ids, buffers, strict=True):
            data = layout.as_elements(buffer)
            slots = slice(block_id * bs, (block_id + 1) * bs)
            for layer in range(pool.num_layers):
                keys[layer][:, slots] = data[0, layer]
                values[layer][:, slots] = data[1, layer]


def _grouped(pools: GroupedPools, bridge: Bridge, block_ids: Sequence[tuple[int, int]],
             buffers: Sequence[np.ndarray], out: bool) -> None:
    """copy_out / copy_in over both groups' pools, one pool's views at a time."""
    layout = BlockLayout.of(pools)
    bs = pools.block_size
    for group, pool in enumerate((pools.pool, pools.window_pool)):
        if not out:
            pool.ensure_capacity(max(ids[group] for ids in block_ids) + 1)
        layers = [(i, j) for i, (g, j) in enumerate(pools.order) if g == group]
        with pool_views(pool, bridge) as (keys, values):
            for ids, buffer in zip(block_ids, buffers, strict=True):
                data = layout.as_elements(buffer)
                slots = slice(ids[group] * bs, (ids[group] + 1) * bs)
                for i, j in layers:
                    if out:
                        data[0, i] = keys[j][:, slots]
                        data[1, i] = values[j][:, slots]
                    else:
                        keys[j][:, slots] = data[0, i]
                        values[j][:, slots] = data[1, i]
