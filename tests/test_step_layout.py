"""A decode window step's layout by unikern's kernel (stages/execute/cuda/step_layout.cu):
its source run in the CPU emulation (tests/cuda_emulation.py), and on a CUDA machine the
kernel itself, against layouts.window_layout's MLX ops, which the kernel replaces there."""

import mlx.core as mx
import numpy as np
import pytest

from tests import cuda_emulation
from unikern.platform import cuda_is_default
from unikern.stages.execute import layouts
from unikern.stages.execute.cuda import sources, step_layout


def tables(B=3, padded=5, steps=4, L=40, seed=0):
    """A window's tables as DecodeWindow makes them: more starts and write-table columns
    than rows (the padding), slots scattered over a pool."""
    rng = np.random.default_rng(seed)
    starts = rng.integers(0, L - steps, size=padded).astype(np.int32)
    write = rng.integers(0, 1000, size=(steps, padded)).astype(np.int32)
    read = rng.integers(1, 1000, size=(B, L)).astype(np.int32)
    return starts, write, read


def by_ops(starts, step, write, read):
    """window_layout through MLX's ops (the CPU's path; on CUDA with the kernel off)."""
    was, layouts.STEP_LAYOUT_KERNEL = layouts.STEP_LAYOUT_KERNEL, False
    try:
        lay = layouts.window_layout(mx.array(starts), step, mx.array(write), mx.array(read),
                                        mx.arange(read.shape[1], dtype=mx.int32)[None])
    finally:
        layouts.STEP_LAYOUT_KERNEL = was
    return {"offsets": np.array(lay.offsets), "lengths": np.array(lay.lengths), "write": np.array(lay.write_slots),
            "read": np.array(lay.read_slots), "seen": np.array(lay.mask).reshape(read.shape)}


@pytest.mark.skipif(not cuda_emulation.available(), reason="the emulation needs g++ (C++20)")
@pytest.mark.parametrize("step", [0, 2, 3])
def test_the_kernels_source_lays_out_a_step_as_the_ops_do(step):
    starts, write, read = tables()
    B, L = read.shape
    rows = max(B, 3)
    got = cuda_emulation.run_kernel(
        sources.text("step_layout.cu"),
        {"starts": starts, "step": np.array([step], dtype=np.int32), "write_table": write, "read_slots": read},
        {}, blocks=-(-B * L // 64), threads=64, output_shape=(),
        outputs={"offsets": (rows,), "lengths": (rows,), "write": (rows,), "read": (B, L), "seen": (B, L)})
    want = by_ops(starts, step, write, read)
    for name in ("offsets", "lengths", "write"):
        np.testing.assert_array_equal(got[name][:B].astype(np.int64), want[name], err_msg=name)
    np.testing.assert_array_equal(got["read"].astype(np.int64), want["read"])
    np.testing.assert_array_equal(got["seen"].astype(bool), want["seen"])
    assert (want["read"] == 0).any() and (want["read"] != 0).any()  # the case masks some positions, not all


@pytest.mark.skipif(not cuda_is_default(), reason="needs MLX's CUDA backend")
@pytest.mark.parametrize("B", [1, 3, 64])
def test_the_kernel_matches_the_ops_on_cuda(B):
    starts, write, read = tables(B=B, padded=max(B, 5), L=96, seed=B)
    for step in (0, 3):
        want = by_ops(starts, step, write, read)
        got = step_layout.step_layout(mx.array(starts), mx.array(step, dtype=mx.int32), mx.array(write),
                                      mx.array(read))
        for name, array in zip(("offsets", "lengths", "write", "read", "seen"), got, strict=True):
            np.testing.assert_array_equal(np.array(array), want[name], err_msg=name)
