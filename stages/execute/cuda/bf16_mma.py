"""Unquantized bfloat16 weights through unikern's tensor-core kernel (q4_mma's mma.cu
with its weights read as they are, bf16_mma_load_b.cu: two 16-byte loads per thread and
tile instead of dequantized) for steps of MIN_ROWS to MAX_ROWS rows (execute.dense_mma;
dense_mma.py routes plain linear layers through it)."""

from __future__ import annotations

import mlx.core as mx

from unikern.stages.execute.cuda import q4_mma, sources
from unikern.stages.execute.cuda.q4_mma import MMA_HEADER, MMA_SHAPES, MMA_TEMPLATE, mma_launch
from unikern.stages.execute.cuda.weight_kernels import rows_kernel

SOURCE = sources.fill(MMA_TEMPLATE, LOAD_B=sources.text("bf16_mma_load_b.cu"))
MIN_ROWS = 5  # below: the fused blocks' GEMVs (up to 4 rows) or MLX's one-row GEMV
MAX_ROWS = 64  # above: cuBLASLt (prefill), one pass of four 16-row tiles at most here


def launch(rows: int, n: int, k: int) -> tuple[dict[str, int], int]:
    """The kernel's template parameters and block count: the 4-bit kernel's, no groups."""
    constants, blocks = mma_launch(rows, n, k, group_size=k)
    del constants["GS"]
    return constants, blocks


def applies(weight: mx.array, x: mx.array) -> bool:
    """bfloat16 rows and weights [N, K], K a multiple of 64, N of the block's features,
    between MIN_ROWS and MAX_ROWS rows."""
    rows = x.size // x.shape[-1] if x.ndim else 0
    return (MIN_ROWS <= rows <= MAX_ROWS and x.dtype == mx.bfloat16 and weight.dtype == mx.bfloat16
            and weight.ndim == 2 and x.shape[-1] == weight.shape[1] and weight.shape[1] % 64 == 0
            and weight.shape[0] % (8 * MMA_SHAPES[q4_mma.MMA_SHAPE][1]) == 0)


def matmul(x: mx.array, weight: mx.array) -> mx.array:
    """x @ weight.T through the kernel: x [..., K] -> [..., N]."""
    constants, blocks = launch(x.size // x.shape[-1], weight.shape[0], x.shape[-1])
    warps = MMA_SHAPES[q4_mma.MMA_SHAPE][0]
    return rows_kernel("unikern_bf16_mma", SOURCE, MMA_HEADER, constants, blocks, warps, x, weight)
