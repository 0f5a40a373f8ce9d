"""Where a forward reads and writes in the paged pool: a batch's layout (BatchLayout),
a decode window's tables built once on the host (DecodeWindow) and each of its steps'
layout derived on the device (window_layout), and the buckets traced steps are padded to."""

from __future__ import annotations

import os
from dataclasses import dataclass

import mlx.core as mx
import numpy as np

from unikern.platform import cuda_is_default
from unikern.platform.kernel_cache import off_small_pool
from unikern.stages.execute.cuda import step_layout
from unikern.stages.kv.pool import KVPool

ZERO_BLOCK = 0  # reserved, all zeros: padded reads, and blocks a windowed table released
SCRATCH_BLOCK = 1  # reserved: padded query positions write their keys/values here
# a decode window's per-row arrays padded out of MLX's pool of small arrays (DecodeWindow);
# not yet measured in the engine on a GPU
PAD_STEP_ROWS = True
# a decode window step's layout by unikern's kernel on CUDA (window_layout; tests turn it
# off, and UNIKERN_STEP_LAYOUT=0 does for a process, to compare the two on a GPU)
STEP_LAYOUT_KERNEL = os.environ.get("UNIKERN_STEP_LAYOUT", "1") != "0"
# a traced window's write table holds at least this many steps (decode_lookahead_max's
# default): windows of 2 to 32 steps share one shape instead of one per power of two
WINDOW_TABLE_STEPS = 32


def block_slots(blocks: tuple[int, ...], block_size: int) -> np.ndarray:
    """A logical block table expanded to the pool slot of every position it covers."""
    offsets = np.arange(block_size, dtype=np.int32)
    return (np.asarray(blocks, dtype=np.int32)[:, None] * block_size + offsets).reshape(-1)


@dataclass
class BatchLayout:
    """Where a forward of B rows x T tokens reads and writes in the pool. Rows feeding
    fewer than T tokens are right-padded: their padded positions write to the scratch
    block and attend only to zeros, and their outputs are never read."""

    batch_size: int
    num_tokens: int  # T: the longest row
    offsets: mx.array | int  # per-row start position (an int when B == 1)
    write_slots: mx.array  # [B*T] pool slot of each fed position
    read_slots: mx.array | None  # [B, L] pool slot of every position attended (0: the zero
    # block); None when every row starts a prompt and attends only to this forward's keys
    mask: mx.array | str | None  # [B, 1, T, L] bool, "causal", or None
    last_index: list[int]  # per row: index of its last real token
    # one row whose blocks are consecutive ids: (first slot, start, end) so the pool is
    # written and read through slices, as a dense cache would be, with no gather at all
    span: tuple[int, int, int] | None = None
    span_from: int = 0  # the span's first position: a windowed row released the blocks before
    lengths: mx.array | None = None  # [B] offsets + 1 where the layout made them (window_layout)

    @classmethod
    def build(cls, pool: KVPool, rows: list[tuple[tuple[int, ...], int, int]]) -> BatchLayout:
        """rows: (logical block table, start position, number of new tokens)."""
        if len(rows) == 1:
            span = _span(rows[0], pool.block_size)
            if span is not None:
                return span
        bs, kb = pool.block_size, pool.kernel_block_size
        B, T = len(rows), max(n for _, _, n in rows)
        starts = np.asarray([start for _, start, _ in rows], dtype=np.int32)
        # a lone row ends exactly at L, so a causal mask aligned to its last query holds;
        # several rows pad L to the kernel block and need a mask per row
        L = int(starts[0]) + T if B == 1 else -(-int((starts + T).max()) // kb) * kb
        read = np.zeros((B, L), dtype=np.int32)
        write = np.full((B, T), SCRATCH_BLOCK * bs, dtype=np.int32)
        for i, (blocks, start, n) in enumerate(rows):
            slots = block_slots(blocks, bs)
            read[i, : start + n] = slots[: start + n]
            write[i, :n] = slots[start : start + n]
        last = [n - 1 for _, _, n in rows]
        write_slots = mx.array(write.reshape(-1))
        offsets: mx.array | int = int(starts[0]) if B == 1 else mx.array(starts)
        if T > 1 and not starts.any():
            # every row starts a prompt: attention needs only this forward's own keys
            # (padded keys sit after each row's real ones, so plain causal masking holds),
            # not the pool read back: for one 64-token row of the 1B shape on an H200 that
            # read was 32 gathers and their index kernels, 390 kernels a step against 262
            # through slices, 6.5 ms against 5.1 (tools/probe/probe_prefill.py)
            return cls(B, T, offsets, write_slots, None, "causal", last)
        if B == 1:
            return cls(1, T, offsets, write_slots, mx.array(read), "causal" if T > 1 else None, last)
        query_pos = starts[:, None] + np.arange(T, dtype=np.int32)[None]  # [B, T]
        mask = np.arange(L, dtype=np.int32)[None, None, :] <= query_pos[:, :, None]
        return cls(B, T, offsets, write_slots, mx.array(read), mx.array(mask[:, None]), last)


def _span(row: tuple[tuple[int, ...], int, int], block_size: int) -> BatchLayout | None:
    """One row whose blocks are consecutive ids reads and writes the pool through
    slices, as a dense cache would, with no gather at all; None otherwise."""
    blocks, start, n = row
    used = blocks[: -(-(start + n) // block_size)]
    # a windowed row's released blocks lead its table as the zero block: the span starts
    # after them (base may then be below 0: only positions from span_from are touched)
    live = next((i for i, b in enumerate(used) if b != ZERO_BLOCK), len(used))
    if live == len(used) or any(b != used[live] + i for i, b in enumerate(used[live:])):
        return None
    base = (used[live] - live) * block_size
    causal = "causal" if n > 1 else None
    return BatchLayout(1, n, start, None, None, causal, [n - 1], (base, start, start + n), live * block_size)


def length_bucket(n: int, unit: int) -> int:
    """n rounded up to a multiple of `unit`, and past 4 units to a quarter octave: at
    most 25% more attention work, and 4 distinct lengths per doubling of the context."""
    n = -(-n // unit) * unit
    if n <= 4 * unit:
        return n
    step = -(-(1 << (n.bit_length() - 3)) // unit) * unit
    return -(-n // step) * step


def row_bucket(n: int) -> int:
    """The rows a traced decode step runs `n` rows at (the rest padding): 1, 2, 4, 8, then
    multiples of 8 to 32 and four counts per doubling past it (length_bucket's). A server's
    batch changes with every arrival and exit, and each row count was a trace of its own
    per length bucket, traced on the request path: this keeps 11 of them up to 64 rows, at
    most 7 rows of padding up to 32 and a quarter more past it."""
    if n <= 2:
        return n
    return 4 if n <= 4 else length_bucket(n, 8)


class DecodeWindow:
    """The layouts of `num_steps` back-to-back decode steps of the same rows, built on
    the host once: every step reads the same slot table (long enough for the last
    step), writes one column of a precomputed table, and derives its mask and offsets
    on the device. Rebuilding the tables per step cost 1.1-1.25 ms at batch 64 on the
    H200, as much as a quarter of the step."""

    def __init__(
        self, pool: KVPool, rows: list[tuple[tuple[int, ...], int]], num_steps: int, bucketed: bool = False
    ) -> None:
        bs, kb = pool.block_size, pool.kernel_block_size
        B = rows_run = len(rows)
        L = -(-max(start + num_steps for _, start in rows) // kb) * kb
        table_steps = num_steps
        if bucketed:  # few distinct shapes, so a compiled step is traced once per bucket
            L = length_bucket(L, kb)
            table_steps = max(WINDOW_TABLE_STEPS, 1 << (num_steps - 1).bit_length())
            # padded rows start at 0, read the zero block and write the scratch block
            rows_run = row_bucket(B)
        # the per-row arrays a step derives its offsets, lengths and write slots from hold
        # at least 3 rows (the rows past B unused), so those are views of arrays of more
        # than 8 bytes (window_layout): MLX's CUDA allocator keeps arrays of up to 8 bytes
        # in a pool of managed memory that kernels read across the bus (on an H200 a
        # kernel reading such an array took 12 us a launch against 2.5 from device memory,
        # tools/probe/probe_memory.py); a one-row step's q/k/v
        # and attention kernels read them in every layer
        padded = off_small_pool(rows_run, 4) if PAD_STEP_ROWS else rows_run
        read = np.zeros((rows_run, L), dtype=np.int32)
        write = np.full((table_steps, padded), SCRATCH_BLOCK * bs, dtype=np.int32)
        starts = np.zeros(padded, dtype=np.int32)
        for i, (blocks, start) in enumerate(rows):
            slots = block_slots(blocks, bs)
            read[i, : start + num_steps] = slots[: start + num_steps]
            write[:num_steps, i] = slots[start : start + num_steps]
            starts[i] = start
        self.batch_size = B
        self.rows_run = rows_run  # B and the padding rows (bucketed)
        self.read_slots = mx.array(read)
        self.write_slots = mx.array(write)
        self.starts = mx.array(starts)
        self.positions = mx.arange(L, dtype=mx.int32)[None]

    def step(self, i: int) -> BatchLayout:
        return window_layout(self.starts, i, self.write_slots, self.read_slots, self.positions)


def window_layout(
    starts: mx.array, step: int | mx.array, write_table: mx.array, read_slots: mx.array, positions: mx.array
) -> BatchLayout:
    """Step `step` of a decode window, from the window's tables (`step` may be an array:
    the compiled decode step takes it as an input, so one trace serves every step).
    `starts` and the write table's rows may hold more entries than the B rows (see
    DecodeWindow): the layout's offsets, lengths and write slots are views of their first B."""
    B = read_slots.shape[0]
    if STEP_LAYOUT_KERNEL and cuda_is_default():
        # one kernel of unikern's own, built once and kept on disk, where MLX would fuse
        # the ops below into kernels of its own compiled at run time (step_layout.py)
        index = step if isinstance(step, mx.array) else mx.array(step, dtype=mx.int32)
        offsets, lengths, write, read, seen = step_layout.step_layout(starts, index, write_table, read_slots)
        return BatchLayout(B, 1, offsets, write, read, seen[:, None, None, :], [0] * B, lengths=lengths)

    def first(a: mx.array) -> mx.array:  # (no slice node where there is nothing to cut)
        return a if a.shape[0] == B else a[:B]

    padded = starts + step
    offsets = first(padded)
    seen = positions <= offsets[:, None]  # [B, L]
    # positions later steps will write read the zero block now, as padding does:
    # their slots hold stale or never-written bytes, which masking alone cannot keep
    # out of probs @ values (0 * NaN)
    read = mx.where(seen, read_slots, 0)
    return BatchLayout(B, 1, offsets, first(write_table[step]), read, seen[:, None, None, :], [0] * B,
                       lengths=first(padded + 1))
