"""DecodeWindow: one host-built table for a lookahead window gives, step by step, what
BatchLayout.build would have built for that step alone."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from unikern.stages.execute.layouts import BatchLayout, DecodeWindow
from unikern.stages.kv.pool import KVPool


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_window_steps_match_per_step_layouts(seed):
    rng = np.random.default_rng(seed)
    pool = KVPool(num_layers=1, num_kv_heads=2, head_dim=8, dtype=mx.float32, block_size=32,
                  kernel_block_size=16, num_blocks=200, slab_blocks=200)
    num_steps = int(rng.integers(2, 9))
    free = list(rng.permutation(np.arange(2, 200)))
    rows = []
    for _ in range(int(rng.integers(2, 7))):
        start = int(rng.integers(1, 150))
        nblocks = -(-(start + num_steps) // pool.block_size)
        rows.append((tuple(int(free.pop()) for _ in range(nblocks)), start))
    window = DecodeWindow(pool, rows, num_steps)
    for i in range(num_steps):
        got = window.step(i)
        want = BatchLayout.build(pool, [(blocks, start + i, 1) for blocks, start in rows])
        assert got.write_slots.tolist() == want.write_slots.tolist()
        assert got.offsets.tolist() == want.offsets.tolist()
        # the window reads a longer table: past each row's current position it reads the
        # zero block (slot 0) and masks it, exactly as the per-step layout's padding does
        L = want.read_slots.shape[1]
        read, mask = np.array(got.read_slots), np.array(got.mask)[:, 0, 0]
        assert (read[:, :L] == np.array(want.read_slots)).all()
        assert (read[:, L:] == 0).all()
        assert (mask[:, :L] == np.array(want.mask)[:, 0, 0]).all() and not mask[:, L:].any()


@pytest.mark.parametrize("num_rows", [1, 2])
def test_a_steps_per_row_arrays_lie_outside_mlxs_small_pool(num_rows):
    """One or two rows: the offsets, lengths and write slots a step's kernels read are the
    first rows of arrays of more than 8 bytes (MLX's CUDA allocator keeps arrays of up to
    8 bytes in managed memory that kernels read across the bus), and hold the step's values."""
    from unikern.platform.kernel_cache import SMALL_POOL_BYTES

    pool = KVPool(num_layers=1, num_kv_heads=2, head_dim=8, dtype=mx.float32, block_size=4,
                  kernel_block_size=4, num_blocks=16, slab_blocks=16)
    rows = [((2, 3, 4), 5), ((6, 7), 1)][:num_rows]
    window = DecodeWindow(pool, rows, 3)
    assert window.starts.nbytes > SMALL_POOL_BYTES and window.write_slots[0].nbytes > SMALL_POOL_BYTES
    for i in range(3):
        layout = window.step(i)
        assert layout.offsets.tolist() == [start + i for _, start in rows]
        assert layout.lengths.tolist() == [start + i + 1 for _, start in rows]
        assert layout.write_slots.tolist() == [blocks[(start + i) // 4] * 4 + (start + i) % 4 for blocks, start in rows]
