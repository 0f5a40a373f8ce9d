"""The paged KV pool: per layer, one MLX array [kv_heads, slots, head_dim], where every
sequence's keys and values live, addressed by block tables instead of per-sequence caches."""

from __future__ import annotations

from collections.abc import Callable, Collection

import mlx.core as mx
import numpy as np
import structlog

from unikern.platform.bridge import mlx_buffer
from unikern.stages.kv import pages
from unikern.stages.kv.cache_kinds import new_state

log = structlog.get_logger()

# the index dtype of the pool's gathers: the token ids' (paged_cache.TOKEN_DTYPE). On CUDA
# MLX compiles a gather kernel at run time per (dtype, index dtype, index count), about 2-4 s
# each on a fresh H100: the pool's reads share the token embedding's
SLOT_INDEX_DTYPE = mx.uint32
# (keys, values [B, H, T, D], pool keys, pool values [H, S, D], slots [B * T]) -> a marker
SlotWrite = Callable[[mx.array, mx.array, mx.array, mx.array, mx.array], mx.array]
# (table [N, W], indices) -> table[indices]
RowTake = Callable[[mx.array, mx.array], mx.array]


def slot_rows(pool: mx.array, slots: mx.array, take: RowTake | None = None) -> mx.array:
    """A layer's pool array [H, S, D] at slots [B, L]: [H, B, L, D], by one single-index
    gather of the pool viewed as [H * S, D] rows (the token embedding's own kernel), where
    pool[:, slots] takes a two-index gather with an arange over the heads. `take`: what
    gathers the rows (table, indices) in place of MLX's indexing (the execute stage's
    kernel on CUDA, cuda/rows.py)."""
    H, S, D = pool.shape
    flat = mx.arange(H, dtype=SLOT_INDEX_DTYPE)[:, None, None] * S + slots.astype(SLOT_INDEX_DTYPE)[None]
    table = pool.reshape(H * S, D)
    return table[flat] if take is None else take(table, flat)


class KVPool:
    """Per layer, one keys and one values array [kv_heads, slots, head_dim].

    A logical block (prefix hashing, offload, disk files) is `block_size` consecutive slots;
    a kernel block is `kernel_block_size` slots, the unit sequence lengths are padded to in
    a batch. Both are ranges of the same slot axis, never copies: a block table expands to
    slots as b * block_size + arange(block_size) (see execute/layouts.BatchLayout).

    Head-major, because gathering slots into [B, H, L, D] for
    mx.fast.scaled_dot_product_attention is fast, while a slot-major pool's transposed
    gather sends SDPA down a slow strided path.

    Blocks 0 and 1 are reserved: block 0 stays zero and padded positions of a batch read
    it, so unwritten memory is never even gathered; padded positions write into block 1.

    Memory, by backend (chosen explicitly from the platform):
    - cpu: every layer's arrays span the whole budget from the start, but as reserved zero
      pages (pages.reserve_zeros): a page commits when a block on it is first written, and
      `release` gives the pages of any blocks back (madvise), whatever their ids. Nothing is
      ever copied to grow or shrink; `resident_bytes` counts the committed pages (mincore).
    - metal, cuda: madvise does not reach MLX's GPU buffers, so the pool grows in slabs by
      concatenation (a copy, peaking at old + new size), to power-of-two counts of slabs
      (`_capacity_class`), and shrinks its idle tail the same way.
    `eager` commits the whole budget at start, for comparison; a NaN fill (tests that prove
    masking) is written, so committed, everywhere and never released.
    """

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
        backend: str | None = None,
    ) -> None:
        if block_size % kernel_block_size:
            raise ValueError(
                f"block_size {block_size} must be a whole multiple of kernel_block_size {kernel_block_size}"
            )
        if backend is None:
            from unikern.platform import current_platform

            backend = current_platform().backend
        self.num_layers = num_layers
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.dtype = dtype
        self.block_size = block_size
        self.kernel_block_size = kernel_block_size
        self.num_blocks = num_blocks  # the budget: a ceiling
        self.slab_blocks = max(1, min(slab_blocks, num_blocks))
        self.fill_value = fill_value  # tests fill unwritten slots with NaN
        self.eager = eager
        # whole-budget arrays of reserved pages: only where madvise reaches the buffers
        self.reserved = backend == "cpu"
        # pages that may be given back: zeros that nobody asked to be committed
        self.releases_pages = self.reserved and not eager and fill_value == 0.0
        self.capacity_blocks = 0  # blocks addressable now
        self.keys: list[mx.array] = []
        self.values: list[mx.array] = []
        self.grow_events = 0
        self.shrink_events = 0  # times memory was given back
        self.released_bytes = 0  # page bytes handed back by `release`, in all
        self.relocations = 0  # arrays found at a new address: MLX copied instead of writing in place
        self.uses = 0  # ensure_capacity calls: one per step that writes, watched for idleness
        self._addresses: list[int] = []  # each array's buffer (cpu), read on the model thread
        # several ranks: called with `keep` before a release, so every rank's pool gives back the same blocks
        self.on_release: Callable[[list[int]], None] | None = None
        self._array_bytes = 0
        if self.reserved:
            self._reserve()
        elif eager:
            self.ensure_capacity(num_blocks)

    # ---- geometry -----------------------------------------------------------------------

    @property
    def bytes_per_block(self) -> int:
        return 2 * self.num_layers * self.block_size * self.num_kv_heads * self.head_dim * self.dtype.size

    @property
    def _chunk_bytes(self) -> int:
        """One block of one head of one array: the contiguous unit of the layout."""
        return self.block_size * self.head_dim * self.dtype.size

    def _head_ranges(self, address: int, first: int, end: int) -> list[tuple[int, int]]:
        """Byte ranges of blocks [first, end) in one array, per head, adjacent ones merged."""
        chunk, head_bytes = self._chunk_bytes, self.num_blocks * self._chunk_bytes
        ranges: list[tuple[int, int]] = []
        for h in range(self.num_kv_heads):
            lo, hi = address + h * head_bytes + first * chunk, address + h * head_bytes + end * chunk
            if ranges and ranges[-1][1] == lo:
                ranges[-1] = (ranges[-1][0], hi)
            else:
                ranges.append((lo, hi))
        return ranges

    # ---- memory in use --------------------------------------------------------------------

    @property
    def resident_bytes(self) -> int:
        """Bytes of the pool that are committed: pages written since their release (cpu),
        or the slabs allocated (metal, cuda)."""
        if not self.reserved:
            return self.capacity_blocks * self.bytes_per_block
        total = 0
        for address in self._addresses:
            vec = self._resident(address, self._array_bytes)
            first_page = pages.interior(address, self._array_bytes)[0]
            for lo, hi in self._head_ranges(address, 0, 1):  # block 0: read, so mapped, never written
                lo, hi = pages.interior(lo, hi - lo)
                vec[(lo - first_page) // pages.PAGE_BYTES : (hi - first_page) // pages.PAGE_BYTES] = 0
            total += int(vec.sum())
        return total * pages.PAGE_BYTES

    def committed_blocks(self) -> int:
        """Blocks with memory committed (cpu: any page of the block in the first layer's
        keys, as every layer is written alike; block 0 is only ever read)."""
        if not self.reserved:
            return self.capacity_blocks
        if not self._addresses:
            return 0
        address, nbytes = self._addresses[0], self._array_bytes
        page = pages.PAGE_BYTES
        counts = np.concatenate([[0], np.cumsum(self._resident(address, nbytes), dtype=np.int64)])
        first_page = pages.interior(address, nbytes)[0]
        starts = np.arange(self.num_blocks, dtype=np.int64) * self._chunk_bytes
        head_bytes = self.num_blocks * self._chunk_bytes
        committed = np.zeros(self.num_blocks, bool)
        for h in range(self.num_kv_heads):
            lo = (address + h * head_bytes + starts - first_page) // page
            hi = -(-(address + h * head_bytes + starts + self._chunk_bytes - first_page) // page)
            lo, hi = np.clip(lo, 0, len(counts) - 1), np.clip(hi, 0, len(counts) - 1)
            committed |= counts[hi] > counts[lo]
        return int(committed[1:].sum())

    def _resident(self, address: int, nbytes: int) -> np.ndarray:
        try:
            return pages.resident_pages(address, nbytes)
        except OSError:  # unmapped: the array moved (a copy), which committed all of it
            first, end = pages.interior(address, nbytes)
            return np.ones((end - first) // pages.PAGE_BYTES, np.uint8)

    # ---- cpu: one reservation --------------------------------------------------------------

    def _reserve(self) -> None:
        """Arrays for the whole budget, one at a time: reserved zeros commit nothing;
        eager zeros and a NaN fill commit one array more at each step, as asked."""
        shape = (self.num_kv_heads, self.num_blocks * self.block_size, self.head_dim)
        for arrays in (self.keys, self.values):
            for _ in range(self.num_layers):
                if self.releases_pages:
                    array = pages.reserve_zeros(shape, self.dtype)
                else:
                    array = new_state(shape, self.dtype, "KVCache", self.fill_value)
                    array[:, : self.block_size, :] = 0  # the reserved zero block
                    mx.eval(array)
                arrays.append(array)
        self._addresses = [mlx_buffer(a)[0] for a in self.keys + self.values]
        self._array_bytes = self.keys[0].nbytes
        self.capacity_blocks = self.num_blocks
        self.grow_events += 1

    def release(self, keep: Collection[int] = ()) -> int:
        """Give back the memory of every block not in `keep`; those blocks read as zeros
        afterwards. Only while nothing writes them: the caller holds the books idle and
        runs this on the model thread. Returns the committed bytes given back."""
        if self.on_release is not None:
            self.on_release(sorted(set(keep)))
        if not self.reserved:
            return self._shrink_to(max(keep, default=-1) + 1)
        if not self.releases_pages:
            return 0
        arrays = self.keys + self.values
        addresses = [mlx_buffer(a)[0] for a in arrays]
        moved = sum(a != b for a, b in zip(addresses, self._addresses, strict=True))
        if moved:  # MLX copied a whole array instead of writing in place: every page committed
            log.warning("kv_pool_arrays_moved", arrays=moved)
        self.relocations += moved
        self._addresses = addresses
        kept = sorted(b for b in set(keep) if 0 <= b < self.num_blocks)
        bounds = zip([0] + [b + 1 for b in kept], kept + [self.num_blocks], strict=True)
        runs = [(lo, hi) for lo, hi in bounds if hi > lo]
        before = self.resident_bytes
        for address in addresses:
            for first, end in runs:
                for lo, hi in self._head_ranges(address, first, end):
                    pages.release(lo, hi - lo)
        released = before - self.resident_bytes
        mx.clear_cache()  # the step temporaries MLX keeps for reuse go back too
        self.shrink_events += 1
        self.released_bytes += released
        return released

    # ---- copies between blocks ---------------------------------------------------------------

    def copy_prefixes(self, copies: Collection[tuple[int, int, int]], write: SlotWrite | None = None,
                      take: RowTake | None = None) -> None:
        """For each (source, dest, n): the first n slots of logical block source into the
        same slots of block dest, in every layer's keys and values (a partial prefix hit).
        The reads are evaluated before the writes, so each write is in place: a write into
        an array with a read of it pending makes MLX copy the whole array (the budget).
        `write`: a kernel that writes a layer's keys and values [1, H, n, D] into its pool
        arrays at the given slots itself (cuda/pool_write.write, on CUDA) instead of MLX's
        scatter, returning a marker to evaluate. `take`: the reads' gather, as slot_rows's."""
        if not copies:
            return
        bs = self.block_size
        src = np.concatenate([np.arange(s * bs, s * bs + n, dtype=np.int32) for s, _, n in copies])
        dst = np.concatenate([np.arange(d * bs, d * bs + n, dtype=np.int32) for _, d, n in copies])
        src_slots, dst_slots = mx.array(src), mx.array(dst)
        parts = [[slot_rows(a, src_slots[None], take)[:, 0] for a in arrays] for arrays in (self.keys, self.values)]
        mx.eval(parts)
        if write is not None:
            done = [write(k[None], v[None], self.keys[layer], self.values[layer], dst_slots)
                    for layer, (k, v) in enumerate(zip(*parts, strict=True))]
            del parts
            mx.eval(done)
            return
        index = mx.broadcast_to(dst_slots[None, :, None], parts[0][0].shape)
        for arrays, read in zip((self.keys, self.values), parts, strict=True):
            for layer, part in enumerate(read):  # into the pool's own lists, as the forward's writes go
                arrays[layer] = mx.put_along_axis(arrays[layer], index, part, axis=1)
        del parts, read, part
        mx.eval(self.keys, self.values)

    # ---- metal, cuda: slabs -----------------------------------------------------------------

    def ensure_capacity(self, num_blocks: int) -> None:
        """Make blocks [0, num_blocks) addressable (growing in whole slabs where the backend
        needs it); called before every step that writes the pool."""
        self.uses += 1
        if num_blocks <= self.capacity_blocks:
            return
        if num_blocks > self.num_blocks:
            raise ValueError(f"block {num_blocks - 1} is beyond the pool's {self.num_blocks} blocks")
        # at least double (amortized copies), to a capacity class
        target = min(self.num_blocks, self._capacity_class(max(num_blocks, 2 * self.capacity_blocks)))
        extra = target - self.capacity_blocks
        if self.capacity_blocks == 0:
            self.keys = [self._new_slab(extra, first=True) for _ in range(self.num_layers)]
            self.values = [self._new_slab(extra, first=True) for _ in range(self.num_layers)]
        else:
            self.keys = [mx.concatenate([k, self._new_slab(extra)], axis=1) for k in self.keys]
            self.values = [mx.concatenate([v, self._new_slab(extra)], axis=1) for v in self.values]
        mx.eval(self.keys, self.values)
        self.capacity_blocks = target
        self.grow_events += 1

    def _capacity_class(self, num_blocks: int) -> int:
        """The capacity that holds `num_blocks`: a power-of-two count of slabs. The compiled
        steps take the pool's arrays as inputs, so every capacity is a shape traced anew
        (each row and length bucket again): a pool grown in classes, and shrunk to one,
        meets log2(budget / slab) of them, the same ones each time it grows back."""
        if num_blocks <= 0:
            return 0
        slabs = -(-num_blocks // self.slab_blocks)
        return self.slab_blocks << (slabs - 1).bit_length()

    def _new_slab(self, num_blocks: int, first: bool = False) -> mx.array:
        shape = (self.num_kv_heads, num_blocks * self.block_size, self.head_dim)
        array = new_state(shape, self.dtype, "KVCache", self.fill_value)
        if first:  # the reserved zero block
            array[:, : self.block_size, :] = 0
        return array

    def _shrink_to(self, num_blocks: int) -> int:
        """Give back the slabs above `num_blocks`' capacity class (blocks there must be unused)."""
        target = min(self.num_blocks, self._capacity_class(num_blocks))
        if target >= self.capacity_blocks:
            return 0
        released = (self.capacity_blocks - target) * self.bytes_per_block
        if target == 0:
            self.keys, self.values = [], []
        else:
            end = target * self.block_size
            self.keys = [mx.contiguous(k[:, :end]) for k in self.keys]
            self.values = [mx.contiguous(v[:, :end]) for v in self.values]
            mx.eval(self.keys, self.values)
        self.capacity_blocks = target
        self.shrink_events += 1
        self.released_bytes += released
        mx.clear_cache()
        return released
