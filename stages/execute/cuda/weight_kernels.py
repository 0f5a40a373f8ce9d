"""The launch that unikern's weight kernels share (q4_gemv, q4_mma, bf16_mma): a kernel
over the rows of x [..., K] against a weight matrix, x's dtype as its T."""

from __future__ import annotations

from typing import Any

import mlx.core as mx

from unikern.platform.kernel_cache import cuda_kernel


def rows_kernel(name: str, source: str, header: str, constants: dict[str, int], blocks: int, warps: int,
                x: mx.array, w: mx.array, out_shape: tuple[int, ...] | None = None, **extra: mx.array) -> mx.array:
    """A kernel over the rows of x [..., K] and weights w [N, ...] (and the `extra` inputs,
    by name, after them): `blocks` blocks of `warps` warps, x's dtype as T and `constants`
    as its template; returns [..., N], or the output as `out_shape` gives it."""
    k, n = x.shape[-1], w.shape[0]
    rows = x.size // k
    (out,) = cuda_kernel(name, ("x", "w", *extra), source, header)(
        inputs=[x.reshape(rows, k), w, *extra.values()],
        template=[("T", x.dtype), *constants.items()],
        grid=(blocks * warps * 32, 1, 1),
        threadgroup=(warps * 32, 1, 1),
        output_shapes=[out_shape or (rows, n)],
        output_dtypes=[x.dtype],
    )
    return out if out_shape else out.reshape(*x.shape[:-1], n)


def run_4bit(name: str, source: str, header: str, launch: Any, warps: int, x: mx.array, w: mx.array,
             scales: mx.array, biases: mx.array, group_size: int, **extra: mx.array) -> mx.array:
    """One of the 4-bit kernels over x [..., K] -> [..., N]: `launch` gives its template
    constants and block count, blocks of `warps` warps; `extra` inputs after the biases."""
    constants, blocks = launch(x.size // x.shape[-1], w.shape[0], x.shape[-1], group_size)
    return rows_kernel(name, source, header, constants, blocks, warps, x, w, scales=scales, biases=biases, **extra)
