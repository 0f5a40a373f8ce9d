"""Quantized linear layers that multiply many rows by dequantizing their weights first."""

from __future__ import annotations

from typing import Any

import mlx.core as mx
import mlx.nn as nn
from mlx.nn.layers.distributed import (
    QuantizedAllToShardedLinear,
    QuantizedShardedToAllLinear,
    sum_gradients,
)

# Rows from which a step multiplies dequantized weights (None: never), by backend. MLX's
# CPU and CUDA quantized matmuls cost about one row's time per row (CPU, 4096x4096 4-bit:
# 15.8 ms per row against 120 ms for 64 rows dequantized first; an H200 at the 8B shape
# ran 64 rows in ~210 ms against 7.6 ms for one), while dequantizing costs one pass over
# the weights whatever the rows. Metal's quantized kernels tile rows well: left alone.
AUTO_ROWS = {"cpu": 8, "cuda": 8, "metal": None}


# A GEMV for 4-bit affine weights, for steps of few rows (execute.quantized_gemv). A block
# of GEMV_WARPS warps computes GEMV_FEATURES consecutive output features for up to MT rows
# (a pass; more rows take more passes, whose blocks sit next to each other so the later
# ones find the weights in L2). Its threads stride together over the weights' 32-bit words
# (8 nibbles, inside one scale group): each dequantizes its word of every feature once
# into registers, then multiplies every row of x against them, so a row costs only its own
# FMAs; per-thread sums meet by warp shuffles, then across the warps in shared memory.
# MLX's affine layout: weight [N, K/8] uint32 (nibble i of a word is bits 4i..4i+3),
# scales and biases [N, K/GS]; rows come from x's shape at run time, so the kernel is
# built once per (K, GS, MT, dtype).
_GEMV_SOURCE = """
    constexpr int F = GEMV_F;
    constexpr int WORDS = K / 8;
    constexpr int PACK = 16 / sizeof(T);  // x elements per 16-byte load
    const int N = w_shape[0];
    const int M = x_shape[0];
    const int passes = (M + MT - 1) / MT;
    const int r0 = (blockIdx.x % passes) * MT;
    const int n0 = (blockIdx.x / passes) * F;
    if (n0 >= N) return;  // the whole block
    float acc[MT][F];
    for (int r = 0; r < MT; ++r)
        for (int j = 0; j < F; ++j) acc[r][j] = 0.f;
    for (int c = threadIdx.x; c < WORDS; c += blockDim.x) {
        const int g = (c * 8) / GS;
        float wf[F][8];
        #pragma unroll
        for (int j = 0; j < F; ++j) {
            const unsigned word = w[(size_t)(n0 + j) * WORDS + c];
            const float s = static_cast<float>(scales[(size_t)(n0 + j) * (K / GS) + g]);
            const float b = static_cast<float>(biases[(size_t)(n0 + j) * (K / GS) + g]);
            for (int i = 0; i < 8; ++i) wf[j][i] = s * static_cast<float>((word >> (4 * i)) & 15u) + b;
        }
        #pragma unroll
        for (int r = 0; r < MT; ++r) {
            if (r0 + r >= M) break;
            const uint4* xr = reinterpret_cast<const uint4*>(x + (size_t)(r0 + r) * K + (size_t)c * 8);
            #pragma unroll
            for (int v = 0; v < 8 / PACK; ++v) {
                const uint4 raw = xr[v];
                const T* xs = reinterpret_cast<const T*>(&raw);
                for (int i = 0; i < PACK; ++i) {
                    const float xv = static_cast<float>(xs[i]);
                    for (int j = 0; j < F; ++j) acc[r][j] += xv * wf[j][v * PACK + i];
                }
            }
        }
    }
    __shared__ float partial[GEMV_W][MT * F];
    const int warp = threadIdx.x / 32;
    const int lane = threadIdx.x % 32;
    #pragma unroll
    for (int r = 0; r < MT; ++r) {
        #pragma unroll
        for (int j = 0; j < F; ++j) {
            float v = acc[r][j];
            for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffff, v, o);
            if (lane == 0) partial[warp][r * F + j] = v;
        }
    }
    __syncthreads();
    for (int t = threadIdx.x; t < MT * F; t += blockDim.x) {
        const int r = t / F;
        if (r0 + r >= M) continue;
        float sum = 0.f;
        for (int q = 0; q < GEMV_W; ++q) sum += partial[q][t];
        out[(size_t)(r0 + r) * N + n0 + t % F] = static_cast<T>(sum);
    }
"""
GEMV_WARPS = 4  # warps per block, splitting K between them
GEMV_FEATURES = 4  # output features per block, each weight word read once for all rows
GEMV_PASS_ROWS = 16  # rows per pass at most (registers: a thread keeps rows x features sums)
_gemv_kernel = None


def gemv_launch(rows: int, n: int, k: int, group_size: int) -> tuple[dict[str, int], int]:
    """The GEMV kernel's integer template parameters and block count for x [rows, k]
    against n output features: rows per pass rounded up to a power of two (few builds)."""
    per_pass = 1 << (min(rows, GEMV_PASS_ROWS) - 1).bit_length()
    constants = {"K": k, "GS": group_size, "MT": per_pass, "GEMV_W": GEMV_WARPS, "GEMV_F": GEMV_FEATURES}
    return constants, -(-rows // per_pass) * -(-n // GEMV_FEATURES)


def gemv_applies(layer: nn.Module, x: mx.array) -> bool:
    """Shapes and formats the GEMV kernel takes: 4-bit affine weights with scale groups of
    a multiple of 32, output features a multiple of GEMV_FEATURES, x in the scales' dtype."""
    k = x.shape[-1]
    return (layer.bits == 4 and layer.mode == "affine" and layer.group_size % 32 == 0 and k % layer.group_size == 0
            and layer["weight"].shape[0] % GEMV_FEATURES == 0 and x.size > 0 and x.dtype == layer["scales"].dtype
            and "biases" in layer)


def gemv(x: mx.array, w: mx.array, scales: mx.array, biases: mx.array, group_size: int) -> mx.array:
    """x @ dequantize(w)^T through the GEMV kernel: x [..., K] -> [..., N]."""
    global _gemv_kernel
    if _gemv_kernel is None:
        _gemv_kernel = mx.fast.cuda_kernel(
            name="unikern_q4_gemv",
            input_names=["x", "w", "scales", "biases"],
            output_names=["out"],
            source=_GEMV_SOURCE,
        )
    k, n = x.shape[-1], w.shape[0]
    rows = x.size // k
    constants, blocks = gemv_launch(rows, n, k, group_size)
    (out,) = _gemv_kernel(
        inputs=[x.reshape(rows, k), w, scales, biases],
        template=[("T", x.dtype), *constants.items()],
        grid=(blocks * GEMV_WARPS * 32, 1, 1),
        threadgroup=(GEMV_WARPS * 32, 1, 1),
        output_shapes=[(rows, n)],
        output_dtypes=[x.dtype],
    )
    return out.reshape(*x.shape[:-1], n)


def _matmul(layer: nn.Module, x: mx.array) -> mx.array:
    """x @ layer's weights^T, without its bias: MLX's quantized kernel (or the GEMV above,
    when `layer.gemv`) below `layer.dequantize_rows` rows, the dequantized weights (in
    x's dtype, a transient array) from there."""
    rows = x.size // x.shape[-1] if x.ndim else 1
    w, scales, biases = layer["weight"], layer["scales"], layer.get("biases")
    if rows < layer.dequantize_rows:
        if layer.gemv and gemv_applies(layer, x):
            return gemv(x, w, scales, biases, layer.group_size)
        return mx.quantized_matmul(x, w, scales=scales, biases=biases, transpose=True, group_size=layer.group_size,
                                   bits=layer.bits, mode=layer.mode)
    return x @ mx.dequantize(w, scales, biases, group_size=layer.group_size, bits=layer.bits, mode=layer.mode,
                             dtype=x.dtype).T


class RowRoutedQuantizedLinear(nn.QuantizedLinear):
    """An affine `nn.QuantizedLinear` that, for inputs of at least `dequantize_rows` rows,
    expands its weights to the activations' dtype (a transient array, one layer at a
    time) and runs a plain matmul; fewer rows keep MLX's quantized kernel. The parameters
    are the same arrays, so pinning, identity and memory use do not change."""

    dequantize_rows: int
    gemv: bool = False  # steps of few rows through the GEMV kernel above

    def __call__(self, x: mx.array) -> mx.array:
        y = _matmul(self, x)
        return y + self["bias"] if "bias" in self else y


class RowRoutedAllToSharded(QuantizedAllToShardedLinear):
    """mlx-lm's tensor-parallel shard of a quantized layer (columns), routed the same way."""

    dequantize_rows: int
    gemv: bool = False

    def __call__(self, x: mx.array) -> mx.array:
        y = _matmul(self, sum_gradients(self.group)(x))
        return y + self["bias"] if "bias" in self else y


class RowRoutedShardedToAll(QuantizedShardedToAllLinear):
    """mlx-lm's tensor-parallel shard of a quantized layer (rows, summed across ranks)."""

    dequantize_rows: int
    gemv: bool = False

    def __call__(self, x: mx.array) -> mx.array:
        y = mx.distributed.all_sum(_matmul(self, x), group=self.group)
        return y + self["bias"] if "bias" in self else y


ROUTED = {nn.QuantizedLinear: RowRoutedQuantizedLinear, QuantizedAllToShardedLinear: RowRoutedAllToSharded,
          QuantizedShardedToAllLinear: RowRoutedShardedToAll}


def route_quantized_layers(model: Any, rows: int | None, gemv: bool = False) -> int:
    """Give every affine quantized linear layer of `model` (plain, or a tensor-parallel
    shard) the row-routed call: dequantized weights from `rows` rows (None: never), and
    with `gemv` the GEMV kernel for fewer rows where it applies. Returns how many layers
    were routed (0 when neither is asked for or the model is not quantized)."""
    if rows is None and not gemv:
        return 0
    routed = 0
    for _, module in model.named_modules():
        if type(module) in ROUTED and module.mode == "affine":
            module.__class__ = ROUTED[type(module)]
        if type(module) in ROUTED.values():  # routed now, or by an earlier call
            module.dequantize_rows = rows if rows is not None else 1 << 62
            module.gemv = gemv
            routed += 1
    return routed
