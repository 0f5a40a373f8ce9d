"""A residual add and the RMS norm that reads its sum as one kernel (residual_norm.cu;
residual.py fuses it into the decoder blocks: execute.fuse_norms). Elsewhere than CUDA,
and for shapes the kernel does not take, MLX's own add and rms_norm."""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn

from unikern.platform.kernel_cache import cuda_kernel, float_bits
from unikern.stages.execute.cuda import sources

# two outputs, the sum and its norm: one output of [2, ...] read back as out[0] and out[1]
# cost a gather kernel each in a traced step, 65 per 1B token on an H200 (CUPTI,
# tools/probe/probe_cuda.py's engine variants)
SOURCE = sources.text("residual_norm.cu")


def threads_for(D: int) -> int | None:
    """Threads per row for a row of D elements (256 where they divide it, at most 32
    elements each), or None where the kernel does not take D."""
    for threads in (256, 512, 1024, 128, 64, 32):
        if D % threads == 0 and D // threads <= 32:
            return threads
    return None


def add_rms_norm(x: mx.array, r: mx.array, norm: nn.RMSNorm, use_kernel: bool) -> tuple[mx.array, mx.array]:
    """(x + r, norm(x + r)), through one kernel where `use_kernel` and the shapes allow."""
    D = x.shape[-1]
    threads = threads_for(D)
    weight = norm["weight"]
    if not use_kernel or threads is None or r.shape != x.shape or r.dtype != x.dtype or weight.dtype != x.dtype:
        h = x + r
        return h, mx.fast.rms_norm(h, weight, norm.eps)
    rows = x.size // D
    kernel = cuda_kernel("unikern_add_rms_norm", ("x", "r", "weight"), SOURCE, "", ("out", "normed"))
    out, normed = kernel(
        inputs=[x.reshape(rows, D), r.reshape(rows, D), weight],
        template=[("T", x.dtype), ("D", D), ("THREADS", threads), ("PER", D // threads),
                  ("EPS", float_bits(norm.eps))],
        grid=(rows * threads, 1, 1),
        threadgroup=(threads, 1, 1),
        output_shapes=[x.shape, x.shape],
        output_dtypes=[x.dtype, x.dtype],
    )
    return out, normed
