"""Quantized linear layers that multiply many rows by dequantizing their weights first."""

from __future__ import annotations

from typing import Any

import mlx.core as mx
import mlx.nn as nn

# Rows from which a step multiplies dequantized weights (None: never), by backend. MLX's
# CPU and CUDA quantized matmuls cost about one row's time per row (CPU, 4096x4096 4-bit:
# 15.8 ms per row against 120 ms for 64 rows dequantized first; an H200 at the 8B shape
# ran 64 rows in ~210 ms against 7.6 ms for one), while dequantizing costs one pass over
# the weights whatever the rows. Metal's quantized kernels tile rows well: left alone.
AUTO_ROWS = {"cpu": 8, "cuda": 8, "metal": None}


class RowRoutedQuantizedLinear(nn.QuantizedLinear):
    """An affine `nn.QuantizedLinear` that, for inputs of at least `dequantize_rows` rows,
    expands its weights to the activations' dtype (a transient array, one layer at a
    time) and runs a plain matmul; fewer rows keep MLX's quantized kernel. The parameters
    are the same arrays, so pinning, identity and memory use do not change."""

    dequantize_rows: int

    def __call__(self, x: mx.array) -> mx.array:
        rows = x.size // x.shape[-1] if x.ndim else 1
        if rows < self.dequantize_rows:
            return super().__call__(x)
        w = mx.dequantize(self["weight"], self["scales"], self.get("biases"), group_size=self.group_size,
                          bits=self.bits, mode=self.mode, dtype=x.dtype)
        y = x @ w.T
        if "bias" in self:
            y = y + self["bias"]
        return y


def route_quantized_layers(model: Any, rows: int | None) -> int:
    """Give every affine `nn.QuantizedLinear` of `model` the row-routed call. Returns
    how many layers were routed (0 when `rows` is None or the model is not quantized)."""
    if rows is None:
        return 0
    routed = 0
    for _, module in model.named_modules():
        if type(module) is nn.QuantizedLinear and module.mode == "affine":
            module.__class__ = RowRoutedQuantizedLinear
            module.dequantize_rows = rows
            routed += 1
        elif isinstance(module, RowRoutedQuantizedLinear):
            module.dequantize_rows = rows
            routed += 1
    return routed
