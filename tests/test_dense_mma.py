"""Plain bfloat16 linear layers' steps of 5-64 rows through unikern's tensor-core kernel
(stages/execute/dense_mma.py, cuda/bf16_mma.py; execute.dense_mma): the kernel's CUDA source in the
thread-per-lane emulation against numpy, the routing by rows and dtype, and the kernel
against MLX's matmul on a CUDA machine."""

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest

from tests import cuda_emulation
from unikern.platform import cuda_is_default
from unikern.stages.execute import dense_mma
from unikern.stages.execute.cuda import bf16_mma, q4_mma, weight_kernels
from unikern.stages.execute.dense_mma import MMALinear, route_dense_layers

emulation = pytest.mark.skipif(not cuda_emulation.available(), reason="the emulation needs g++ (C++20)")


def as_bf16(a: mx.array) -> np.ndarray:
    return np.array(a.astype(mx.bfloat16).astype(mx.float32))


@emulation
@pytest.mark.parametrize("shape", list(q4_mma.MMA_SHAPES))
@pytest.mark.parametrize("rows,n,k", [(5, 32, 256), (21, 16, 512), (64, 32, 128), (70, 16, 128)])
def test_the_source_computes_the_matmul_in_an_emulation(rows, n, k, shape, monkeypatch):
    """The kernel's CUDA source on the CPU, mma.sync emulated from its fragment layouts:
    one partial row tile (5), two tiles (21), four (64), and two passes with warps left
    without a k-chunk (70 rows, k 128), in both block shapes."""
    monkeypatch.setattr(q4_mma, "MMA_SHAPE", shape)
    mx.random.seed(rows)
    w, x = mx.random.normal((n, k)), mx.random.normal((rows, k))
    constants, blocks = bf16_mma.launch(rows, n, k)
    assert "GS" not in constants and constants["SPLIT"] == 0
    got = cuda_emulation.run_kernel(bf16_mma.SOURCE, {"x": np.array(x), "w": np.array(w)}, constants, blocks,
                                    constants["MMA_W"] * 32, (rows, n), header=q4_mma.EMULATED_HEADER)
    want = as_bf16(x) @ as_bf16(w).T
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4 * np.abs(want).max())


@emulation
def test_matmul_launches_the_kernel_over_the_rows_of_any_leading_shape(monkeypatch):
    """`matmul` as a layer calls it, bfloat16 in and out: the emulated kernel (its inputs
    handed over as float32) gives x @ W.T for rows spread over two leading axes."""
    launched = []
    emulated = cuda_emulation.emulated_cuda_kernels(launched, header=q4_mma.EMULATED_HEADER)

    def build(*args, **kwargs):
        launch = emulated(*args, **kwargs)
        return lambda inputs, **kw: launch([a.astype(mx.float32) for a in inputs], **kw)

    monkeypatch.setattr(weight_kernels, "cuda_kernel", build)
    mx.random.seed(3)
    w = mx.random.normal((48, 128)).astype(mx.bfloat16)
    x = mx.random.normal((3, 4, 128)).astype(mx.bfloat16)
    got = bf16_mma.matmul(x, w)
    assert got.shape == (3, 4, 48) and got.dtype == mx.bfloat16 and launched == ["unikern_bf16_mma"]
    want = as_bf16(x) @ as_bf16(w).T
    np.testing.assert_allclose(np.array(got.astype(mx.float32)), want, rtol=1e-2, atol=1e-2 * np.abs(want).max())


def test_steps_of_5_to_64_bf16_rows_take_the_kernel(monkeypatch):
    """Routed layers (biased or not) give nn.Linear's results; the kernel takes bfloat16
    steps of MIN_ROWS to MAX_ROWS rows only: not 4 or 65 rows, not float32 rows, not a
    width the kernel's k-chunks do not divide."""
    mx.random.seed(0)
    model = nn.Sequential(nn.Linear(128, 256), nn.Linear(256, 64, bias=False), nn.Linear(96, 32))
    model.set_dtype(mx.bfloat16)
    calls = []
    monkeypatch.setattr(dense_mma, "matmul", lambda x, w: calls.append((x.size // x.shape[-1], w.shape)) or x @ w.T)
    inputs = {rows: mx.random.normal((rows, 128)).astype(mx.bfloat16) for rows in (4, 5, 64, 65)}
    odd = mx.random.normal((16, 96)).astype(mx.bfloat16)
    expected = {rows: model.layers[1](model.layers[0](x)) for rows, x in inputs.items()}
    expected_odd = model.layers[2](odd)
    assert route_dense_layers(model) == 3
    assert all(type(layer) is MMALinear for layer in model.layers)
    for rows, x in inputs.items():  # the bias added after the kernel, not fused as addmm's
        got = model.layers[1](model.layers[0](x))
        if rows in (4, 65):
            assert mx.array_equal(got, expected[rows])
        else:
            assert mx.allclose(got, expected[rows], rtol=2e-2, atol=2e-2)
    assert mx.array_equal(model.layers[2](odd), expected_odd)  # k 96: not a multiple of 64
    model.layers[0](mx.random.normal((16, 128)))  # float32 rows
    assert calls == [(5, (256, 128)), (5, (64, 256)), (64, (256, 128)), (64, (64, 256))]
    assert route_dense_layers(model) == 3  # routed once: the count of those routed


@pytest.mark.skipif(not cuda_is_default(), reason="the kernel runs on a CUDA GPU")
@pytest.mark.parametrize("shape", list(q4_mma.MMA_SHAPES))
@pytest.mark.parametrize("rows", [5, 16, 33, 64])
@pytest.mark.parametrize("n,k", [(3072, 2048), (16384, 2048), (2048, 8192)])
def test_the_kernel_gives_mlxs_matmul(rows, n, k, shape, monkeypatch):
    monkeypatch.setattr(q4_mma, "MMA_SHAPE", shape)
    mx.random.seed(rows)
    w = (mx.random.normal((n, k)) * 0.02).astype(mx.bfloat16)
    x = mx.random.normal((rows, k)).astype(mx.bfloat16)
    got = bf16_mma.matmul(x, w).astype(mx.float32)
    want = (x @ w.T).astype(mx.float32)
    np.testing.assert_allclose(np.array(got), np.array(want), rtol=2e-2, atol=2e-2 * float(mx.abs(want).max()))
