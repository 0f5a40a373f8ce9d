"""Rows of a table at indices by one of unikern's kernels (rows.cu) on CUDA: the token
embedding's lookup (a 4-bit one's three too), the last positions' rows of a forward
(paged_cache.rows_at) and the pool's slot reads (kv.pool.slot_rows). MLX's gather does
the same, but its CUDA backend compiles a gather with NVRTC per (dtype, index dtype,
index count) the first time a machine meets it: the last of MLX's modules in a fresh 1B
start, 10.0 s of an H200's 14.8 s (tools/results/h200/startup-1b-h200-8db264e-fusion-off.json).
unikern's kernels are built once and kept on disk (unikern.platform.cuda_build).
UNIKERN_ROW_KERNEL=0 keeps MLX's gather, to compare the two on a GPU."""

from __future__ import annotations

import os

import mlx.core as mx
import mlx.nn as nn

from unikern.platform import cuda_is_default
from unikern.platform.kernel_cache import cuda_kernel
from unikern.stages.execute.cuda import sources

KERNEL = os.environ.get("UNIKERN_ROW_KERNEL", "1") != "0"
THREADS = 256
CHUNK_BYTES = 16  # what one thread copies (rows.cu)


def take(table: mx.array, ids: mx.array) -> mx.array:
    """table [N, W] at row indices `ids` (integers, any shape): [*ids.shape, W], by the
    kernel; an index outside the table gives zeros."""
    if table.ndim != 2 or not mx.issubdtype(ids.dtype, mx.integer):
        raise ValueError(f"rows.take reads a 2-d table at integer indices, not a {table.shape} table at {ids.dtype}")
    N, W = table.shape
    flat = ids.reshape(-1)
    per_chunk = max(1, CHUNK_BYTES // table.dtype.size)
    threads = flat.size * -(-W // per_chunk)
    kernel = cuda_kernel("unikern_rows", ("table", "ids"), sources.text("rows.cu"))
    (out,) = kernel(inputs=[table, flat], template=[("T", table.dtype)],
                    grid=(max(1, -(-threads // THREADS)) * THREADS, 1, 1), threadgroup=(THREADS, 1, 1),
                    output_shapes=[(flat.size, W)], output_dtypes=[table.dtype])
    return out.reshape(*ids.shape, W)


def take_rows(table: mx.array, ids: mx.array) -> mx.array:
    """table[ids] for a 2-d table: the kernel on CUDA (unless UNIKERN_ROW_KERNEL=0), MLX's
    gather elsewhere."""
    return take(table, ids) if KERNEL and cuda_is_default() else table[ids]


class RowsEmbedding(nn.Embedding):
    """nn.Embedding whose lookup is `take` (its weights and `as_linear` unchanged)."""

    def __call__(self, x: mx.array) -> mx.array:
        return take(self["weight"], x)


class RowsQuantizedEmbedding(nn.QuantizedEmbedding):
    """nn.QuantizedEmbedding whose three lookups (packed weights, scales, biases) are
    `take`, dequantized as mlx's own."""

    def __call__(self, x: mx.array) -> mx.array:
        biases = self.get("biases")
        return mx.dequantize(take(self["weight"], x), scales=take(self["scales"], x),
                             biases=take(biases, x) if biases is not None else None,
                             group_size=self.group_size, bits=self.bits, mode=self.mode)


_SWAPS = {nn.Embedding: RowsEmbedding, nn.QuantizedEmbedding: RowsQuantizedEmbedding}


def route_embeddings(model: nn.Module) -> int:
    """Give every embedding of `model` (exactly mlx's nn.Embedding or nn.QuantizedEmbedding,
    nothing a family subclassed) the kernel's lookup, in place: the module keeps its
    weights, its name in the tree and everything else; returns how many."""
    swapped = 0
    for _, module in model.named_modules():
        rows_class = _SWAPS.get(type(module))
        if rows_class is not None:
            module.__class__ = rows_class
            swapped += 1
    return swapped
