"""A tensor-core kernel for 4-bit affine weights and bfloat16 rows, for steps of more
rows than the GEMV's (execute.quantized_mma; mma.cu with q4_mma_load_b.cu): mma.sync
m16n8k16 (bf16 in, float32 sums) on weights dequantized in registers, up to 64 rows per
pass. On an H200 a 64-row decode step of the 8B 4-bit shape took 14.7 ms through it,
55.1 through the GEMV and 196.5 through MLX's quantized matmul (tools/probe/probe_cuda.py's
engine-paged-qmma). quantized.py routes a quantized layer's rows through it; bf16_mma.py
runs the same kernel on bfloat16 weights."""

from __future__ import annotations

import functools

import mlx.core as mx
import mlx.nn as nn

from unikern.stages.execute.cuda import sources
from unikern.stages.execute.cuda.q4_gemv import affine_4bit
from unikern.stages.execute.cuda.weight_kernels import run_4bit

# the kernel's helpers (mma.cuh; for the tests' emulation, mma_emulation.h) and its text
# with the B fragments' loads left out (mma.cu's LOAD_B: this kernel's, bf16_mma's)
MMA_HEADER = sources.text("mma.cuh")
EMULATED_HEADER = sources.text("mma_emulation.h")
MMA_TEMPLATE = sources.text("mma.cu")
SOURCE = sources.fill(MMA_TEMPLATE, LOAD_B=sources.text("q4_mma_load_b.cu"))
MMA_PASS_TILES = 4  # 16-row tiles per pass at most (64 rows), sharing each B fragment
# the block's shape, (warps splitting K, tiles of 8 output features per warp). "narrow"
# (4, 1): a 64-row step's 4096-wide calls took 65 us each, every block reading all of x
# from L2 (512 KB at 64 rows; 512 blocks), ~270 MB per call. "wide" (8, 2) reads x once
# per 16 features, with as many warps in flight: on an H200, a 64-row step of the 8B
# shape 14.6 -> 11.3 ms, its 4096-wide calls 12.6 -> 8.1 ms (CUPTI, tools/probe/probe_cuda.py's
# engine-paged-qmma against engine-paged-qmma-wide)
MMA_SHAPES = {"narrow": (4, 1), "wide": (8, 2)}
MMA_SHAPE = "wide"


def mma_launch(rows: int, n: int, k: int, group_size: int, split: bool = False) -> tuple[dict[str, int], int]:
    """The tensor-core kernel's template parameters and block count for x [rows, k]
    against n output features: 16-row tiles per pass 1, 2 or 4, the block's shape
    (MMA_SHAPE); `split`: the weights in two bf16 halves."""
    tiles = 1 << (min(-(-rows // 16), MMA_PASS_TILES) - 1).bit_length()
    warps, n_tiles = MMA_SHAPES[MMA_SHAPE]
    constants = {"K": k, "GS": group_size, "RT": tiles, "NT": n_tiles, "MMA_W": warps, "SPLIT": int(split)}
    return constants, -(-rows // (16 * tiles)) * (n // (8 * n_tiles))


def mma_applies(layer: nn.Module, x: mx.array) -> bool:
    """What the tensor-core kernel takes: those of q4_gemv.affine_4bit, output features a
    multiple of the block's (8 per tile), k a multiple of 64, bfloat16 rows."""
    return (affine_4bit(layer, x, 8 * MMA_SHAPES[MMA_SHAPE][1]) and x.shape[-1] % 64 == 0
            and x.dtype == mx.bfloat16)


def mma(x: mx.array, w: mx.array, scales: mx.array, biases: mx.array, group_size: int,
        split: bool = False) -> mx.array:
    """x @ dequantize(w)^T through the tensor-core kernel: x [..., K] -> [..., N]; `split`:
    float32-exact weights through two MMAs."""
    launch = functools.partial(mma_launch, split=split)
    return run_4bit("unikern_q4_mma", SOURCE, MMA_HEADER, launch, MMA_SHAPES[MMA_SHAPE][0], x, w, scales,
                    biases, group_size)
