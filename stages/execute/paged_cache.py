"""The per-layer cache adapter that lets mlx-lm's model code run, unchanged, on the paged
pool where a forward's layout (layouts.py) says, and the reads and writes it takes there
(unikern's kernels on CUDA)."""

from __future__ import annotations

import os

import mlx.core as mx

from unikern.platform import cuda_is_default
from unikern.stages.execute import cpu_kernels
from unikern.stages.execute.cuda import paged_attention, pool_write, rows
from unikern.stages.execute.layouts import BatchLayout
from unikern.stages.execute.windows import window_mask, window_start
from unikern.stages.kv.pool import KVPool, SlotWrite, slot_rows

# decode steps' keys and values written into the pool in place by one kernel
# (cuda/pool_write.py) where the paged attention kernel reads them back, instead of two
# scatters. The attention kernel takes the write's marker (`after`), so MLX orders it after
# the write; its CUDA test and the parity run hold on an H200 (tests/test_decode_blocks.py,
# tools/check/parity_check.py): an 8B-shape 4-bit token 4.94 -> 3.47 ms in the runner, 1B 64-row
# steps 711 -> 629 primitives (tools/probe/probe_cuda.py's engine-paged-write)
WRITE_IN_PLACE = True
# the token embedding's lookup, the last positions' rows and the pool's slot reads by
# unikern's row kernel on CUDA (cuda/rows.py), where MLX's gather is a kernel its backend
# compiles at run time (UNIKERN_ROW_KERNEL=0 keeps MLX's, to compare the two on a GPU)
ROW_KERNEL = os.environ.get("UNIKERN_ROW_KERNEL", "1") != "0"
# the dtype of token ids as the model reads them, prompts and decode steps alike: the
# sampler's argmax gives uint32, and on CUDA MLX compiles a gather kernel at run time per
# (dtype, index dtype, index count): one dtype, one kernel (about 3 s each on a fresh H200)
TOKEN_DTYPE = mx.uint32


def pool_writer(paged: str | None) -> SlotWrite | None:
    """The kernel that writes keys and values into the pool in place (cuda/pool_write.py),
    where the paged attention kernel is on (`paged` "kernel": CUDA), else None (MLX's
    scatter)."""
    return pool_write.write if WRITE_IN_PLACE and paged == "kernel" else None


def uses_row_kernel() -> bool:
    """Whether gathers of rows (take_rows) and the model's embeddings go through the row
    kernel: on CUDA, unless ROW_KERNEL is off."""
    return ROW_KERNEL and cuda_is_default()


def take_rows(table: mx.array, ids: mx.array) -> mx.array:
    """table[ids] for a 2-d table: the row kernel where uses_row_kernel(), MLX's gather elsewhere."""
    return rows.take(table, ids) if uses_row_kernel() else table[ids]


def rows_at(x: mx.array, flat: mx.array) -> mx.array:
    """x [B, T, F] at one position per row, given as indices into the flattened B * T
    positions (TOKEN_DTYPE [B]: row i's position p is i * T + p): one single-index gather,
    the token embedding's own kernel (cuda/rows.py's on CUDA), where x[rows, positions]
    takes a two-index one."""
    return take_rows(x.reshape(-1, x.shape[-1]), flat)


def flat_positions(positions: list[int], T: int) -> mx.array:
    """rows_at's indices of row i's position positions[i] in rows of T positions."""
    return mx.array([i * T + p for i, p in enumerate(positions)], dtype=TOKEN_DTYPE)


def _head_major(x: mx.array) -> mx.array:
    """[B, H, T, D] -> [H, B*T, D]. One row of one token is that order already: a reshape
    alone, one view node fewer per write (each costs the host ~1 us per token and layer
    on an H200: tools/probe/probe_ops.py)."""
    B, H, T, D = x.shape
    if B * T == 1:
        return x.reshape(H, 1, D)
    return x.transpose(1, 0, 2, 3).reshape(H, B * T, D)


class PagedLayerCache:
    """What one attention layer sees as its cache during one forward. A windowed layer
    (`window` tokens) reads from the first key its earliest query can see where the
    layout allows it, and masks exactly at the window's edge.

    mlx-lm attention layers call `rope(x, offset=cache.offset)`, then
    `cache.update_and_fetch(keys, values)`, then SDPA with the mask the model built through
    `cache.make_mask(...)`. `update_and_fetch` writes the new keys/values into the pool at
    the batch's slots (an in-place scatter: the pool array is donated) and returns the
    keys/values its block tables name, gathered per token slot (the length padded to the kernel block)."""

    def __init__(
        self, pool: KVPool, layer: int, layout: BatchLayout, kernels: bool = False, window: int | None = None,
        paged: str | None = None, writes: list | None = None,
    ) -> None:
        self.pool = pool
        self.layer = layer
        self.layout = layout
        self.window = window
        # the write kernel's markers (pool_write.write), for whoever ends the step to evaluate
        # with the pool: MLX sees no write to the pool arrays, so a forward whose outputs
        # nobody evaluates (a chunk that samples nothing) would never run its writes
        self.writes = writes
        self.head_major = False  # update_and_fetch returned [H, B, L, D] gathers, transposed
        # decode steps read straight from the pool (cuda/paged_attention.py): "kernel" (CUDA)
        # or "reference" (MLX ops); None: the gathered SDPA
        self.paged = paged
        self._paged_inputs: tuple | None = None
        if kernels:  # the routed SDPA of cpu_kernels calls this instead of mx.fast's
            self.cpu_attention = self.attention

    @property
    def offset(self) -> mx.array | int:
        return self.layout.offsets

    def make_mask(self, N: int, return_array: bool = False, window_size: int | None = None):
        lay = self.layout
        window = window_size or self.window
        if window is not None:
            return window_mask(lay, window, self.window)
        if lay.span is not None:
            L = lay.span[2]
        elif lay.read_slots is not None:
            L = lay.read_slots.shape[1]
        else:
            L = lay.num_tokens
        if return_array and isinstance(lay.mask, str):
            q = mx.arange(L - N, L)
            return q[:, None] >= mx.arange(L)[None]
        return lay.mask

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
        pool, lay = self.pool, self.layout
        B, H, T, D = keys.shape
        pool_k = pool.keys[self.layer]
        pool_v = pool.values[self.layer]
        if lay.span is not None:
            base, start, end = lay.span
            # a reshape of the (contiguous) RoPE output is a view; keys[0] would add a
            # slice node to each of the 2 x layers writes of every token
            pool_k[:, base + start : base + end] = keys.reshape(H, T, D)
            pool_v[:, base + start : base + end] = values.reshape(H, T, D)
            lo = window_start(start, self.window)
            if lo < lay.span_from:  # the scheduler releases only blocks past every window
                raise RuntimeError(f"layer {self.layer} would read position {lo}, before the row's first "
                                   f"held block (position {lay.span_from})")
            return pool_k[None, :, base + lo : base + end], pool_v[None, :, base + lo : base + end]
        read = lay.read_slots
        # a decode step the routed SDPA reads from the pool itself (paged_decode), and of
        # those the ones its kernel reads (the kernel takes the write's marker, `after`)
        paged_read = self.paged is not None and T == 1 and self.window is None
        kernel_read = T == 1 and self._kernel_reads(D, keys.dtype)
        write = self._kernel_writer(keys)
        if write is not None and (kernel_read or not paged_read):
            # one kernel writes both in place (pool_write.write), where MLX's scatter would
            # be a kernel its CUDA backend compiles at run time (prompt chunks) or two
            # launches a layer (decode steps); the gathers below take its marker through
            # their slots (for a decode step: a call that falls back to them, attention
            # sinks, a layer whose SDPA is not routed), a fresh prompt's own keys take it
            # so that the write is evaluated with them
            done = write(keys, values, pool_k, pool_v, lay.write_slots)
            if self.writes is not None:
                self.writes.append(done)
            if read is None:
                return tuple(mx.depends([keys, values], [done]))
            if kernel_read:
                self.written_in_place(after=done)
            read = read + (done[:1] * 0).astype(read.dtype)
        else:
            pool_k, pool_v = self._scatter(keys, values)
            if lay.read_slots is None:  # fresh prompts: nothing earlier to read back
                return keys, values
            if paged_read:
                # the routed SDPA reads the pool itself (paged_decode); the gathers below
                # stay lazy and unused, so MLX never computes them, unless a call falls
                # back to them (attention sinks, a layer whose SDPA is not routed)
                self.written_in_place()
        # [H, B, L, D] -> [B, H, L, D]: each (row, head) stays one contiguous L x D matrix
        k = slot_rows(pool_k, read, take_rows)
        v = slot_rows(pool_v, read, take_rows)
        self.head_major = True
        return k.transpose(1, 0, 2, 3), v.transpose(1, 0, 2, 3)

    def _scatter(self, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
        """The step's keys and values [B, H, T, D] into the pool at the layout's slots;
        the layer's new pool arrays."""
        pool, lay = self.pool, self.layout
        # [B, H, T, D] -> [H, B*T, D], scattered into the slot axis in place (the pool
        # array is donated). One ScatterAxis with the slots broadcast over heads and
        # features: `pool_k[:, slots] = ...` builds an arange over the heads and two index
        # casts, four kernels per write instead of one (the H200 profile showed them)
        new_k, new_v = _head_major(keys), _head_major(values)
        index = mx.broadcast_to(lay.write_slots[None, :, None], new_k.shape)
        pool.keys[self.layer] = mx.put_along_axis(pool.keys[self.layer], index, new_k, axis=1)
        pool.values[self.layer] = mx.put_along_axis(pool.values[self.layer], index, new_v, axis=1)
        return pool.keys[self.layer], pool.values[self.layer]

    def pool_target(self, heads: int, head_dim: int, dtype: mx.Dtype) -> tuple[mx.array, mx.array, mx.array] | None:
        """Where a decode step's one new key and value per row go, for a kernel that
        writes them into the pool itself (blocks.py's q/k/v kernel): this layer's pool
        arrays and the rows' slots, or None where the step is not one the paged kernel
        reads back (prefill, one row through slices, a windowed layer, MLX's ops for the
        attention: only the kernel takes q as an input, which orders it after the write,
        since MLX sees no write to the pool arrays)."""
        if not self._kernel_reads(head_dim, dtype, heads) or self.layout.write_slots is None:
            return None
        return self.pool.keys[self.layer], self.pool.values[self.layer], self.layout.write_slots

    def _kernel_writer(self, keys: mx.array) -> SlotWrite | None:
        """The write kernel (pool_writer: cuda/pool_write.py) if this step's keys and values
        go into the pool by it: where the paged attention kernel is on (CUDA), in the
        pool's dtype, with a slot per token; else None."""
        if self.layout.write_slots is None or self.pool.keys[self.layer].dtype != keys.dtype:
            return None
        return pool_writer(self.paged)

    def _kernel_reads(self, head_dim: int, dtype: mx.Dtype, heads: int | None = None) -> bool:
        """Whether a decode step of this layer is one the paged attention kernel reads back
        from the pool: a table read, a full-attention layer, a head size and dtype the
        kernel takes (`heads`: the query heads where known; paged_decode checks them
        otherwise)."""
        lay, pool_k = self.layout, self.pool.keys[self.layer]
        if self.paged != "kernel" or lay.span is not None or lay.read_slots is None or self.window is not None:
            return False
        kv_heads = pool_k.shape[0]
        return pool_k.dtype == dtype and paged_attention.supports(head_dim, heads or kv_heads, kv_heads)

    def written_in_place(self, after: mx.array | None = None) -> None:
        """This decode step's keys and values are in the pool: the routed SDPA reads them
        from there (paged_decode), its kernel after `after` (pool_write.write's
        marker) where given."""
        offsets, lengths = self.layout.offsets, self.layout.lengths
        if lengths is None:
            lengths = offsets + 1 if isinstance(offsets, mx.array) else mx.array([offsets + 1], dtype=mx.int32)
        self._paged_inputs = (self.pool.keys[self.layer], self.pool.values[self.layer], self.layout.read_slots,
                              lengths, after)

    def paged_table(self) -> tuple[mx.array, mx.array]:
        """The rows' slot tables [B, L] and lengths [B] of this decode step, once its keys
        and values are in the pool (`written_in_place`), for a kernel that reads them back
        itself (cuda/block_kernel.py)."""
        if self._paged_inputs is None:
            raise RuntimeError("the slot table is known once the step's keys and values are in the pool "
                               "(written_in_place)")
        return self._paged_inputs[2], self._paged_inputs[3]

    def paged_decode(self, q: mx.array, scale: float) -> mx.array | None:
        """This layer's decode attention straight from the pool, or None when this step
        is not one it takes (prefill, a windowed layer, one row through slices)."""
        if self._paged_inputs is None or q.shape[2] != 1:
            return None
        pool_k, pool_v, slots, lengths, after = self._paged_inputs
        return paged_attention.decode(q, pool_k, pool_v, slots, lengths, scale, self.paged == "kernel", after)

    def attention(self, q: mx.array, k: mx.array, v: mx.array, scale: float, mask) -> mx.array:
        """SDPA for MLX's CPU backend (see cpu_kernels): grouped query heads share their
        KV head's matrices instead of repeating them, the batched matmuls run over
        (KV head, row) in the order the pool gathered them, and the softmax runs in
        PyTorch on the scores' own buffer. q [B, H, T, D]; k, v as update_and_fetch
        returned them; mask as make_mask gave it."""
        B, H, T, D = q.shape
        Hk, L = k.shape[1], k.shape[2]
        if B * H * T * L < cpu_kernels.MIN_ELEMENTS:  # small: MLX's own, lazily
            return mx.fast.scaled_dot_product_attention(q, k, v, scale=scale, mask=mask)
        r = H // Hk
        q = (q * scale).reshape(B, Hk, r * T, D)
        if self.head_major:  # back to the gather's own [Hk, B, L, D] order: no copy
            q = q.transpose(1, 0, 2, 3)
            k = k.transpose(1, 0, 2, 3)
            v = v.transpose(1, 0, 2, 3)
        scores = q @ k.swapaxes(-1, -2)  # [B, Hk, r*T, L] or [Hk, B, r*T, L]
        if isinstance(mask, str):  # causal, aligned to the last query
            mask = (mx.arange(L - T, L)[:, None] >= mx.arange(L)[None])[None, None]
        if mask is not None:  # [B or 1, 1, T, L] -> broadcast over the grouped heads
            mask = mask.reshape(mask.shape[0], 1, 1, T, L)
            if self.head_major:
                mask = mask.transpose(1, 0, 2, 3, 4)
            shape = scores.shape
            scores = mx.where(mask, scores.reshape(*shape[:2], r, T, L), -mx.inf).reshape(shape)
        out = cpu_kernels.softmax_(scores) @ v  # [.., r*T, D]
        if self.head_major:
            out = out.transpose(1, 0, 2, 3)
        return out.reshape(B, H, T, D)

    @property
    def state(self):  # mlx-lm reads cache.state in a few utilities; the pool is the state
        return ()
