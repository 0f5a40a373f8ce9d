"""A model's token embeddings looked up by unikern's row kernel (cuda/rows.py) on CUDA,
where MLX's gather is a kernel its backend compiles at run time: the modules keep their
weights, their place in the tree and `as_linear` (a tied head)."""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn

from unikern.stages.execute.cuda.rows import take


class RowsEmbedding(nn.Embedding):
    """nn.Embedding whose lookup is the row kernel."""

    def __call__(self, x: mx.array) -> mx.array:
        return take(self["weight"], x)


class RowsQuantizedEmbedding(nn.QuantizedEmbedding):
    """nn.QuantizedEmbedding whose three lookups (packed weights, scales, biases) are the
    row kernel's, dequantized as mlx's own."""

    def __call__(self, x: mx.array) -> mx.array:
        biases = self.get("biases")
        return mx.dequantize(take(self["weight"], x), scales=take(self["scales"], x),
                             biases=take(biases, x) if biases is not None else None,
                             group_size=self.group_size, bits=self.bits, mode=self.mode)


_ROUTED = {nn.Embedding: RowsEmbedding, nn.QuantizedEmbedding: RowsQuantizedEmbedding}


def route_embeddings(model: nn.Module) -> int:
    """Give every embedding of `model` (exactly mlx's nn.Embedding or nn.QuantizedEmbedding,
    nothing a family subclassed) the row kernel's lookup, in place; returns how many."""
    routed = 0
    for _, module in model.named_modules():
        rows_class = _ROUTED.get(type(module))
        if rows_class is not None:
            module.__class__ = rows_class
            routed += 1
    return routed
