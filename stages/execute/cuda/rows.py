"""Rows of a table at indices by one kernel (rows.cu): on CUDA the token embedding's
lookup (a 4-bit one's three; stages/execute/embeddings.py), the last positions' rows of a
forward (paged_cache.rows_at) and the pool's slot reads (kv.pool.slot_rows). MLX's gather
does the same, but its CUDA backend compiles a gather with NVRTC per (dtype, index dtype,
index count) the first time a machine meets it: the last of MLX's modules in a fresh 1B
start, 10.0 s of an H200's 14.8 s (tools/results/h200/startup-1b-h200-8db264e-fusion-off.json).
unikern's kernels are built once and kept on disk (unikern.platform.cuda_build)."""

from __future__ import annotations

import mlx.core as mx

from unikern.platform.kernel_cache import cuda_kernel
from unikern.stages.execute.cuda import sources

THREADS = 256
CHUNK_BYTES = 16  # what one thread copies (rows.cu)


def take(table: mx.array, ids: mx.array) -> mx.array:
    """table [N, W] at row indices `ids` (integers, any shape): [*ids.shape, W], by the
    kernel; an index outside the table gives zeros."""
    if table.ndim != 2 or not mx.issubdtype(ids.dtype, mx.integer):
        raise ValueError(f"rows.take reads a 2-d table at integer indices, not a {table.shape} table at {ids.dtype}")
    W = table.shape[1]
    flat = ids.reshape(-1)
    per_chunk = max(1, CHUNK_BYTES // table.dtype.size)
    threads = flat.size * -(-W // per_chunk)
    kernel = cuda_kernel("unikern_rows", ("table", "ids"), sources.text("rows.cu"))
    (out,) = kernel(inputs=[table, flat], template=[("T", table.dtype)],
                    grid=(max(1, -(-threads // THREADS)) * THREADS, 1, 1), threadgroup=(THREADS, 1, 1),
                    output_shapes=[(flat.size, W)], output_dtypes=[table.dtype])
    return out.reshape(*ids.shape, W)
