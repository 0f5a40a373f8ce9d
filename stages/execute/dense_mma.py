"""Unquantized bfloat16 linear layers through unikern's tensor-core kernel for steps of a
few to 64 rows (execute.dense_mma).

On an H200 MLX multiplies every matmul of more than one row through cuBLASLt, and
encoding one costs the host 13-17 us, against 3-4 us for MLX's one-row GEMV and for a
custom kernel (tools/probe_ops.py, tools/results/gpu/session15/c-ops). A decode step of
the 1B shape runs 65 of them, about 1 ms of the host's time per step, where the step's
GPU time at 64 rows is 2.3 ms and at 16 rows less: the step is paced by the host
(tools/results/gpu/H200-issue17.md, session 15). The kernel here is the 4-bit
tensor-core kernel's (quantized.py: mma.sync m16n8k16, float32 sums, up to 64 rows per
pass) with its weights read as they are, two 16-byte loads per thread and tile, instead
of dequantized. Steps of up to 4 rows keep the fused blocks' GEMVs (blocks.py) or MLX's
GEMV; steps of more than MAX_ROWS rows (prefill) keep cuBLASLt, which is the faster
there."""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn

from unikern.stages.execute import quantized
from unikern.stages.execute.quantized import (
    MMA_HEADER,
    MMA_SHAPES,
    MMA_TEMPLATE,
    mma_launch,
    rows_kernel,
)

# the thread's feature g of tile nt, k 16t..16t+15 of the chunk: eight bf16 pairs, pair
# 2st+h being k 16t+4st+2h, +1, the fragment slots the template's MMAs take
_BF16_LOAD_B = """
        #pragma unroll
        for (int nt = 0; nt < NT; ++nt) {
            const T* wrow = w + ((size_t)n0 + nt * 8 + g) * K + (size_t)c * 64 + 16 * t;
            unsigned pairs[8];
            unikern_load8(wrow, pairs);
            unikern_load8(wrow + 8, pairs + 4);
            #pragma unroll
            for (int st = 0; st < 4; ++st) {
                bf[nt][st][0] = pairs[2 * st];
                bf[nt][st][1] = pairs[2 * st + 1];
            }
        }
"""
SOURCE = MMA_TEMPLATE.replace("MMA_LOAD_B\n", _BF16_LOAD_B.lstrip("\n"))
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
            and weight.shape[0] % (8 * MMA_SHAPES[quantized.MMA_SHAPE][1]) == 0)


def matmul(x: mx.array, weight: mx.array) -> mx.array:
    """x @ weight.T through the kernel: x [..., K] -> [..., N]."""
    constants, blocks = launch(x.size // x.shape[-1], weight.shape[0], x.shape[-1])
    warps = MMA_SHAPES[quantized.MMA_SHAPE][0]
    return rows_kernel("unikern_bf16_mma", SOURCE, MMA_HEADER, constants, blocks, warps, x, weight)


class MMALinear(nn.Linear):
    """An `nn.Linear` whose steps of MIN_ROWS to MAX_ROWS bfloat16 rows go through the
    kernel above; any other input, as `nn.Linear` multiplies it. Same parameters."""

    def __call__(self, x: mx.array) -> mx.array:
        if not applies(self["weight"], x):
            return super().__call__(x)
        y = matmul(x, self["weight"])
        return y + self["bias"] if "bias" in self else y


def route_dense_layers(model: nn.Module) -> int:
    """Give every plain `nn.Linear` of `model` (the fused projections' concatenated layers
    among them) the kernel's call; returns how many were routed."""
    routed = 0
    for _, module in model.named_modules():
        if type(module) is nn.Linear:
            module.__class__ = MMALinear
        routed += type(module) is MMALinear
    return routed
