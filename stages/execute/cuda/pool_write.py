"""Keys and values written into the paged pool in place by one kernel (`write`,
pool_write.cu: a decode step's, a prompt chunk's, a prefix hit's copies), or a decode
step's q/k/v rows rotated and k and v written (`rope_write`, rope_write.cu): in place of
MLX's scatters, RoPE and the slices around them."""

from __future__ import annotations

import mlx.core as mx

from unikern.platform.kernel_cache import cuda_kernel, off_small_pool
from unikern.stages.execute.cuda import sources

WRITE_THREADS = 256
# where the write kernel reads a token's keys and values: a decode step's as they come
# (strided: the family's transposed views, which MLX would otherwise copy for the kernel,
# two copies per layer and step), more tokens a row packed (row-major [B, Hk, T, D], MLX
# copying a strided view first): a text that reads strides goes through MLX's compiler in
# every process (kernel_cache.Kernel), one that does not is a cubin kept on disk, and a
# prompt's chunks meet it in every layer
STRIDED_AT = """\
        const size_t k_at = b * keys_strides[0] + h * keys_strides[1] + t * keys_strides[2] + d * keys_strides[3];
        const size_t v_at = b * values_strides[0] + h * values_strides[1] + t * values_strides[2] + d * values_strides[3];
"""
PACKED_AT = """\
        const size_t k_at = ((b * Hk + h) * tokens + t) * D + d, v_at = k_at;
"""
# the RoPE store (rope_store.cu), its PAIR (the pair's other value) read from the row itself
ROPE_WRITE_SOURCE = sources.fill(sources.text("rope_write.cu"), ROPE_STORE=sources.text("rope_store.cu"))


def write(keys: mx.array, values: mx.array, pool_k: mx.array, pool_v: mx.array, slots: mx.array) -> mx.array:
    """A step's keys and values [B, Hk, T, D] into a layer's pool arrays [Hk, S, D] at
    the tokens' slots (int [B * T], row by row), in place, by one kernel for both: a
    decode step's token per row (on an H200 each of MLX's two scatters it replaces cost
    the host about 9 us per layer and token to encode: tools/probe/probe_ops.py), a
    prompt's chunk and a prefix hit's copied slots (MLX's scatter there is a kernel its
    CUDA backend compiles at run time: 4.4 s of a fresh H100's start). Returns a small
    marker array (16 bytes: out of MLX's pool of small arrays) that whatever reads the
    pool back takes as an input of its kernel (paged_attention.decode's `after`: MLX
    orders a kernel after those that wrote its inputs, nothing else; through `mx.depends`
    on the marker the attention ran beside the write on an H200 and missed the step's
    own key) or of the index of its gather (paged_cache's `after`). A decode step's keys
    and values may be strided views (read through their strides, not copied; more tokens
    a row are packed first: STRIDED_AT); the pool arrays must be the pool's own contiguous
    ones (the kernel indexes them as such)."""
    B, Hk, T, D = keys.shape
    if (values.shape != keys.shape or pool_k.dtype != keys.dtype or pool_k.shape[0] != Hk or pool_k.shape[2] != D
            or slots.size != B * T):
        raise ValueError(f"the pool write takes the pool's dtype and heads and a slot per token: keys {keys.shape} "
                         f"{keys.dtype}, values {values.shape}, pool {pool_k.shape} {pool_k.dtype}, slots {slots.shape}")
    strided = T == 1
    kernel = cuda_kernel("unikern_pool_write", ("keys", "values", "k_pool", "v_pool", "slots"),
                         sources.fill(sources.text("pool_write.cu"), AT=STRIDED_AT if strided else PACKED_AT),
                         outputs=("done",), contiguous=not strided)
    n = B * T * Hk * D
    (done,) = kernel(inputs=[keys, values, pool_k, pool_v, slots.reshape(-1).astype(mx.int32)],
                     template=[("T", keys.dtype)], grid=(-(-n // WRITE_THREADS) * WRITE_THREADS, 1, 1),
                     threadgroup=(WRITE_THREADS, 1, 1), output_shapes=[(off_small_pool(1, keys.dtype.size),)],
                     output_dtypes=[keys.dtype])
    return done


def rope_write(y: mx.array, pos: mx.array, freq_pi: mx.array, heads: int, head_dim: int, traditional: bool,
               pool: tuple[mx.array, mx.array, mx.array]) -> mx.array:
    """A decode step's q/k/v rows y [B, (heads + 2 kv heads) * head_dim] through one
    kernel: q and k rotated for the rows' positions (`pos`, int32 [B]; `freq_pi`: RoPE's
    inverse frequencies over pi, float32 [head_dim / 2]), k and v written into the pool
    (`pool`: a layer's pool arrays [kv heads, slots, head_dim] and each row's slot, as
    PagedLayerCache.pool_target gives them); returns q [B, heads, 1, head_dim], which
    whatever reads the pool back must take (the paged attention kernel does)."""
    k_pool, v_pool, slots = pool
    B, N = y.shape
    q_features = heads * head_dim
    kernel = cuda_kernel("unikern_rope_write", ("qkv", "pos", "freq_pi", "k_pool", "v_pool", "slots"),
                         ROPE_WRITE_SOURCE)
    constants = {"HD": head_dim, "QN": q_features, "KN": (N - q_features) // 2, "TRAD": int(traditional), "POOL": 1}
    (q,) = kernel(inputs=[y, pos.astype(mx.int32), freq_pi, k_pool, v_pool, slots.astype(mx.int32)],
                  template=[("T", y.dtype), *constants.items()],
                  grid=(-(-B * N // WRITE_THREADS) * WRITE_THREADS, 1, 1), threadgroup=(WRITE_THREADS, 1, 1),
                  output_shapes=[(B, heads, 1, head_dim)], output_dtypes=[y.dtype])
    return q
