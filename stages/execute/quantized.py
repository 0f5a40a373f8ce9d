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


def _matmul(layer: nn.Module, x: mx.array) -> mx.array:
    """x @ layer's weights^T, without its bias: MLX's quantized kernel below
    `layer.dequantize_rows` rows, the dequantized weights (in x's dtype, a transient
    array) from there."""
    rows = x.size // x.shape[-1] if x.ndim else 1
    w, scales, biases = layer["weight"], layer["scales"], layer.get("biases")
    if rows < layer.dequantize_rows:
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

    def __call__(self, x: mx.array) -> mx.array:
        y = _matmul(self, x)
        return y + self["bias"] if "bias" in self else y


class RowRoutedAllToSharded(QuantizedAllToShardedLinear):
    """mlx-lm's tensor-parallel shard of a quantized layer (columns), routed the same way."""

    dequantize_rows: int

    def __call__(self, x: mx.array) -> mx.array:
        y = _matmul(self, sum_gradients(self.group)(x))
        return y + self["bias"] if "bias" in self else y


class RowRoutedShardedToAll(QuantizedShardedToAllLinear):
    """mlx-lm's tensor-parallel shard of a quantized layer (rows, summed across ranks)."""

    dequantize_rows: int

    def __call__(self, x: mx.array) -> mx.array:
        y = mx.distributed.all_sum(_matmul(self, x), group=self.group)
        return y + self["bias"] if "bias" in self else y


ROUTED = {nn.QuantizedLinear: RowRoutedQuantizedLinear, QuantizedAllToShardedLinear: RowRoutedAllToSharded,
          QuantizedShardedToAllLinear: RowRoutedShardedToAll}


def route_quantized_layers(model: Any, rows: int | None) -> int:
    """Give every affine quantized linear layer of `model` (plain, or a tensor-parallel
    shard) the row-routed call. Returns how many layers were routed (0 when `rows` is
    None or the model is not quantized)."""
    if rows is None:
        return 0
    routed = 0
    for _, module in model.named_modules():
        if type(module) in ROUTED and module.mode == "affine":
            module.__class__ = ROUTED[type(module)]
        if type(module) in ROUTED.values():  # routed now, or by an earlier call
            module.dequantize_rows = rows
            routed += 1
    return routed
