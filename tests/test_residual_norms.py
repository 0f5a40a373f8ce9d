"""A residual add and the RMS norm after it as one kernel (stages/execute/residual.py,
stages/execute/cuda/residual_norm.py):
the kernel's CUDA source in the thread-per-lane emulation against the two ops written
out, add_rms_norm's launch against MLX's own ops, and mlx-lm's block code still the four
lines the fused block repeats. Greedy parity through the engine: tests/test_families.py
(variant "norms")."""

import importlib
import inspect

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest

from tests import cuda_emulation
from unikern.platform.kernel_cache import float_bits
from unikern.stages.execute import residual
from unikern.stages.execute.cuda import residual_norm

emulation = pytest.mark.skipif(not cuda_emulation.available(), reason="the emulation needs g++ (C++20)")


def rms_norm(h, w, eps):
    return w * (h / np.sqrt((h * h).mean(axis=-1, keepdims=True) + eps))


@emulation
@pytest.mark.parametrize("D", [64, 256, 2048])
def test_the_kernel_source_adds_and_normalizes_in_an_emulation(D):
    rng = np.random.default_rng(D)
    rows, eps = 3, 1e-5
    x, r = (rng.standard_normal((rows, D)).astype(np.float32) for _ in range(2))
    w = rng.standard_normal(D).astype(np.float32)
    threads = residual_norm.threads_for(D)
    constants = {"D": D, "THREADS": threads, "PER": D // threads, "EPS": float_bits(eps)}
    inputs = {"x": x, "r": r, "weight": w}
    out = cuda_emulation.run_kernel(residual_norm.SOURCE, inputs, constants, rows, threads, (rows, D), "",
                                    {"out": (rows, D), "normed": (rows, D)})
    np.testing.assert_allclose(out["out"], x + r, rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(out["normed"], rms_norm(x + r, w, eps), rtol=1e-4, atol=1e-5)


def test_threads_per_row():
    assert residual_norm.threads_for(2048) == 256 and residual_norm.threads_for(4096) == 256
    assert residual_norm.threads_for(16384) == 512 and residual_norm.threads_for(64) == 64
    assert residual_norm.threads_for(100) is None


@emulation
def test_the_launch_gives_mlxs_add_and_norm(monkeypatch):
    """add_rms_norm as a CUDA machine runs it, the launch run in the emulation: the
    rows of a [B, T, D] input flattened, the sum and the norm read back as two views."""
    monkeypatch.setattr(residual_norm, "cuda_kernel", cuda_emulation.emulated_cuda_kernels())
    norm = nn.RMSNorm(128, eps=1e-6)
    norm.weight = mx.random.normal((128,), key=mx.random.key(1))
    x, r = mx.random.normal((2, 3, 128), key=mx.random.key(2)), mx.random.normal((2, 3, 128), key=mx.random.key(3))
    h, n = residual_norm.add_rms_norm(x, r, norm, use_kernel=True)
    want_h, want_n = residual_norm.add_rms_norm(x, r, norm, use_kernel=False)
    assert h.shape == n.shape == x.shape
    np.testing.assert_allclose(np.array(h), np.array(want_h), rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(np.array(n), np.array(want_n), rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("module, name", sorted(residual.BLOCKS))
def test_mlx_lms_blocks_are_still_the_four_lines_fused(module, name):
    """The fused block repeats these families' __call__ with the adds fused: if mlx-lm
    changes one, it must leave BLOCKS until the fused block follows."""
    source = inspect.getsource(getattr(importlib.import_module(module), name).__call__)
    body = [line.strip() for line in source.split(") -> mx.array:", 1)[1].splitlines() if line.strip()]
    assert body == ["r = self.self_attn(self.input_layernorm(x), mask, cache)", "h = x + r",
                    "r = self.mlp(self.post_attention_layernorm(h))", "out = h + r", "return out"]


def test_a_handed_norm_normalizes_any_other_input_itself():
    norm = nn.RMSNorm(8)
    norm.__class__ = residual.HandedRMSNorm  # as fuse_residual_norms makes the norms after the adds
    x, other = mx.ones((1, 8)), mx.full((1, 8), 2.0)
    norm.hand(x, mx.zeros((1, 8)))
    assert np.array(norm(x)).sum() == 0  # the handed output, for the input it was handed with
    norm.hand(x, mx.zeros((1, 8)))
    np.testing.assert_allclose(np.array(norm(other)), np.ones((1, 8)), rtol=1e-5)  # not x: its own
    assert residual.handed_counts(norm) == {"handed": 1, "misses": 1}
