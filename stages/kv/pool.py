"""The paged KV pool: per layer, one MLX array [kv_heads, slots, head_dim].

A logical block (prefix hashing, offload, disk files) is `block_size` consecutive slots;
a kernel block is `kernel_block_size` slots, the unit sequence lengths are padded to in
a batch. Both are ranges of the same slot axis, never copies: a block table expands to
slots as b * block_size + arange(block_size) (see paged_cache.BatchLayout).

Head-major layout, measured on the CPU backend (B=32, L=160, 2 KV heads, dim 64):
gathering slots into [B, H, L, D] and running mx.fast.scaled_dot_product_attention took
~2 ms per layer, against ~7 ms for a slot-major pool gathered by kernel block (its
transposed result sends SDPA down a slow strided path).

Blocks 0 and 1 are reserved: block 0 stays zero and padded positions of a batch read
it, so unwritten memory is never even gathered; padded positions write into block 1.

Lazy allocation: MLX commits every page it creates (mx.zeros writes them), so the pool
starts empty and grows in slabs as blocks are first used; idle tail slabs are given
back. `eager` commits the whole budget at start, for comparison.
"""

from __future__ import annotations

import math

import mlx.core as mx

from unikern.stages.kv.cache_kinds import new_state


class KVPool:
    def __init__(
        self,
        *,
        num_layers: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: mx.Dtype,
        block_size: int,
        kernel_block_size: int,
        num_blocks: int,
        slab_blocks: int,
        eager: bool = False,
        fill_value: float = 0.0,
    ) -> None:
        if block_size % kernel_block_size:
            raise ValueError(
                f"block_size {block_size} must be a whole multiple of kernel_block_size {kernel_block_size}"
            )
        self.num_layers = num_layers
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.dtype = dtype
        self.block_size = block_size
        self.kernel_block_size = kernel_block_size
        self.num_blocks = num_blocks  # the budget: a ceiling
        self.slab_blocks = max(1, min(slab_blocks, num_blocks))
        self.fill_value = fill_value  # tests fill unwritten slots with NaN
        self.capacity_blocks = 0  # blocks actually allocated
        self.keys: list[mx.array] = []
        self.values: list[mx.array] = []
        self.grow_events = 0
        self.shrink_events = 0
        if eager:
            self.ensure_capacity(num_blocks)

    @property
    def bytes_per_block(self) -> int:
        return 2 * self.num_layers * self.block_size * self.num_kv_heads * self.head_dim * self.dtype.size

    @property
    def resident_bytes(self) -> int:
        return self.capacity_blocks * self.bytes_per_block

    def _new(self, num_blocks: int, first: bool = False) -> mx.array:
        shape = (self.num_kv_heads, num_blocks * self.block_size, self.head_dim)
        array = new_state(shape, self.dtype, "KVCache", self.fill_value)
        if first:  # the reserved zero block
            array[:, : self.block_size, :] = 0
        return array

    def ensure_capacity(self, num_blocks: int) -> None:
        """Make blocks [0, num_blocks) addressable, growing in whole slabs."""
        if num_blocks <= self.capacity_blocks:
            return
        if num_blocks > self.num_blocks:
            raise ValueError(f"block {num_blocks - 1} is beyond the pool's {self.num_blocks} blocks")
        # grow by at least a slab and at least half the current size (amortized copies)
        target = max(num_blocks, self.capacity_blocks + self.slab_blocks, math.ceil(self.capacity_blocks * 1.5))
        target = min(self.num_blocks, math.ceil(target / self.slab_blocks) * self.slab_blocks)
        extra = target - self.capacity_blocks
        if self.capacity_blocks == 0:
            self.keys = [self._new(extra, first=True) for _ in range(self.num_layers)]
            self.values = [self._new(extra, first=True) for _ in range(self.num_layers)]
        else:
            self.keys = [mx.concatenate([k, self._new(extra)], axis=1) for k in self.keys]
            self.values = [mx.concatenate([v, self._new(extra)], axis=1) for v in self.values]
        mx.eval(self.keys, self.values)
        self.capacity_blocks = target
        self.grow_events += 1

    def shrink_to(self, num_blocks: int) -> None:
        """Give back whole slabs above `num_blocks` (blocks there must be unused)."""
        target = math.ceil(num_blocks / self.slab_blocks) * self.slab_blocks
        if target >= self.capacity_blocks:
            return
        if target == 0:
            self.keys, self.values = [], []
        else:
            end = target * self.block_size
            self.keys = [mx.contiguous(k[:, :end]) for k in self.keys]
            self.values = [mx.contiguous(v[:, :end]) for v in self.values]
            mx.eval(self.keys, self.values)
        self.capacity_blocks = target
        self.shrink_events += 1
        mx.clear_cache()
