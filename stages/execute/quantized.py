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


# A GEMV for 4-bit affine weights, for steps of a few rows (execute.quantized_gemv):
# one warp per output feature, each lane taking 32 weights (one 16-byte load of packed
# nibbles, inside one scale group) at a time and every row of x against them, so the
# weights are read once per step whatever the rows; sum(x * (s*q + b)) is computed as
# s * sum(x*q) + b * sum(x) per 32 weights. Written for MLX's affine layout: weight
# [N, K/8] uint32 (nibble i of a word is bits 4i..4i+3), scales and biases [N, K/GS].
_GEMV_SOURCE = """
    const int warp = threadIdx.x / 32;
    const int lane = threadIdx.x % 32;
    const int N = w_shape[0];
    const int n = blockIdx.x * NW + warp;
    if (n >= N) return;  // the whole warp: no block barrier below
    constexpr int CHUNKS = K / 32;
    constexpr int PACK = 16 / sizeof(T);  // x elements per 16-byte load
    const uint4* wrow = reinterpret_cast<const uint4*>(w + (size_t)n * (K / 8));
    float acc[M];
    for (int r = 0; r < M; ++r) acc[r] = 0.f;
    for (int c = lane; c < CHUNKS; c += 32) {
        const uint4 packed = wrow[c];
        const unsigned words[4] = {packed.x, packed.y, packed.z, packed.w};
        const size_t g = (size_t)n * (K / GS) + (c * 32) / GS;
        const float s = static_cast<float>(scales[g]);
        const float bias = static_cast<float>(biases[g]);
        for (int r = 0; r < M; ++r) {
            const uint4* xr = reinterpret_cast<const uint4*>(x + (size_t)r * K + (size_t)c * 32);
            float dq = 0.f;
            float sx = 0.f;
            for (int v = 0; v < 32 / PACK; ++v) {
                const uint4 raw = xr[v];
                const T* xs = reinterpret_cast<const T*>(&raw);
                for (int i = 0; i < PACK; ++i) {
                    const int k = v * PACK + i;  // 0..31 within the chunk
                    const float xv = static_cast<float>(xs[i]);
                    dq += xv * static_cast<float>((words[k / 8] >> (4 * (k % 8))) & 15u);
                    sx += xv;
                }
            }
            acc[r] += s * dq + bias * sx;
        }
    }
    for (int r = 0; r < M; ++r) {
        for (int o = 16; o > 0; o >>= 1) acc[r] += __shfl_xor_sync(0xffffffff, acc[r], o);
    }
    if (lane == 0) {
        for (int r = 0; r < M; ++r) out[(size_t)r * N + n] = static_cast<T>(acc[r]);
    }
"""
GEMV_WARPS = 8  # output features per block
GEMV_MAX_ROWS = 8
_gemv_kernel = None


def gemv_launch(rows: int, n: int, k: int, group_size: int) -> tuple[dict[str, int], int]:
    """The GEMV kernel's integer template parameters and block count for x [rows, k]
    against n output features."""
    return {"K": k, "GS": group_size, "M": rows, "NW": GEMV_WARPS}, -(-n // GEMV_WARPS)


def gemv_applies(layer: nn.Module, x: mx.array) -> bool:
    """Shapes and formats the GEMV kernel takes: 4-bit affine weights with scale groups of
    a multiple of 32, at most GEMV_MAX_ROWS rows, x in the scales' dtype."""
    k = x.shape[-1]
    rows = x.size // k
    return (layer.bits == 4 and layer.mode == "affine" and layer.group_size % 32 == 0 and k % layer.group_size == 0
            and 0 < rows <= GEMV_MAX_ROWS and x.dtype == layer["scales"].dtype and "biases" in layer)


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
