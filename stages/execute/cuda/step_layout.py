"""A decode window step's offsets, lengths, write slots, read slots and mask by one kernel
(step_layout.cu) on CUDA: layouts.window_layout's element-wise ops and its write
table's gather, which inside a traced step MLX fuses into kernels it compiles at run time
(NVRTC, one after another: 5 of the 15 modules a fresh H200 machine compiled at start-up,
about 16 s, tools/results/h200/startup-1b-read-ahead.json). unikern's own kernels are built
once and kept on disk (unikern.platform.cuda_build)."""

from __future__ import annotations

import mlx.core as mx

from unikern.platform.kernel_cache import cuda_kernel, off_small_pool
from unikern.stages.execute.cuda import sources

THREADS = 256


def step_layout(starts: mx.array, step: mx.array, write_table: mx.array,
                read_slots: mx.array) -> tuple[mx.array, mx.array, mx.array, mx.array, mx.array]:
    """For the B rows of `read_slots` (int32 [B, L]) at window step `step` (an int32 array
    of one element; `starts` and the write table are int32 too): offsets and lengths
    (starts[:B] + step, and + 1), write slots (write_table[step, :B]), the read slots with
    each position past the row's offset set to 0, and the mask of the positions each row
    sees (bool [B, L]). `starts` and the write table's rows may hold more than B entries. The per-row arrays are views of the first B
    of arrays held out of MLX's pool of small arrays (kernel_cache.off_small_pool)."""
    B, L = read_slots.shape
    kernel = cuda_kernel("unikern_step_layout", ("starts", "step", "write_table", "read_slots"),
                         sources.text("step_layout.cu"), outputs=("offsets", "lengths", "write", "read", "seen"))
    rows = off_small_pool(B, 4)
    offsets, lengths, write, read, seen = kernel(
        inputs=[starts, step, write_table, read_slots], template=[],
        grid=(-(-B * L // THREADS) * THREADS, 1, 1), threadgroup=(THREADS, 1, 1),
        output_shapes=[(rows,), (rows,), (rows,), (B, L), (B, L)],
        output_dtypes=[mx.int32, mx.int32, mx.int32, mx.int32, mx.bool_])
    return offsets[:B], lengths[:B], write[:B], read, seen
