"""Decode attention read straight from the paged pool (execute.paged_attention).

A decode step of several rows used to gather every row's keys and values out of the pool
into a dense [B, H, L, D] copy per layer and run a masked SDPA over it; an array mask
keeps MLX's CUDA SDPA off its fused decode kernel. Here one kernel per layer walks each
row's slot table in the pool, with the row's length instead of a mask: no gathered copy,
no mask, and fixed shapes, so a one-row window can be a traced (`mx.compile`d) step too.

On CUDA the kernel is written with `mx.fast.cuda_kernel`: one thread block per (row,
query head), each warp taking every NW-th position with an online softmax in float32,
the warps merged at the end. (A version with a lane per position for q.k, one warp-wide
max and sum per 32 positions, measured slower on an H200: 248 against 220 us per token
over the 16 layers of the 1B shape at one row, 990 against 744 at 64 rows;
tools/results/gpu/H200-issue17.md.) Elsewhere (and for head sizes the kernel does not take)
`reference` computes the same thing with MLX's own ops; the CPU tests run the routing
through it and a GPU test holds the kernel to it."""

from __future__ import annotations

import mlx.core as mx

WARPS = 8  # per block: positions are dealt round-robin to the warps

_SOURCE = """
    const int bh = blockIdx.x;  // one block per (row, query head)
    const int b = bh / H;
    const int h = bh % H;
    const int kvh = h / (H / HK);
    const int warp = threadIdx.x / 32;
    const int lane = threadIdx.x % 32;
    const int L = slots_shape[1];
    const size_t S = k_pool_shape[1];
    const int len = min(lengths[b], L);
    float qv[E];
    float acc[E];
    for (int e = 0; e < E; ++e) {
        qv[e] = static_cast<float>(q[(size_t)bh * D + lane * E + e]) * scale[0];
        acc[e] = 0.f;
    }
    float m = -INFINITY;
    float l = 0.f;
    for (int t = warp; t < len; t += NW) {
        const size_t base = ((size_t)kvh * S + (size_t)slots[(size_t)b * L + t]) * D + lane * E;
        float s = 0.f;
        for (int e = 0; e < E; ++e) s += qv[e] * static_cast<float>(k_pool[base + e]);
        for (int o = 16; o > 0; o >>= 1) s += __shfl_xor_sync(0xffffffff, s, o);
        const float m_new = fmaxf(m, s);
        const float corr = expf(m - m_new);
        const float p = expf(s - m_new);
        l = l * corr + p;
        for (int e = 0; e < E; ++e) acc[e] = acc[e] * corr + p * static_cast<float>(v_pool[base + e]);
        m = m_new;
    }
    __shared__ float s_m[NW];
    __shared__ float s_l[NW];
    __shared__ float s_acc[NW][D];
    if (lane == 0) {
        s_m[warp] = m;
        s_l[warp] = l;
    }
    for (int e = 0; e < E; ++e) s_acc[warp][lane * E + e] = acc[e];
    __syncthreads();
    if (warp == 0) {
        float top = -INFINITY;
        for (int w = 0; w < NW; ++w) top = fmaxf(top, s_m[w]);
        float total = 0.f;
        float o[E];
        for (int e = 0; e < E; ++e) o[e] = 0.f;
        for (int w = 0; w < NW; ++w) {
            const float c = s_m[w] == -INFINITY ? 0.f : expf(s_m[w] - top);
            total += s_l[w] * c;
            for (int e = 0; e < E; ++e) o[e] += s_acc[w][lane * E + e] * c;
        }
        for (int e = 0; e < E; ++e) out[(size_t)bh * D + lane * E + e] = static_cast<T>(o[e] / total);
    }
"""

_kernel = None
_scales: dict[float, mx.array] = {}


def kernel_available() -> bool:
    """Whether this MLX runs the CUDA kernel (a CUDA GPU is the default device)."""
    return mx.default_device() == mx.gpu and mx.cuda.is_available()


def supports(head_dim: int, num_heads: int, num_kv_heads: int) -> bool:
    """Shapes the kernel takes: 32 lanes x head_dim/32 elements, whole query groups."""
    return head_dim % 32 == 0 and head_dim <= 256 and num_heads % num_kv_heads == 0


def reference(q: mx.array, pool_k: mx.array, pool_v: mx.array, slots: mx.array, lengths: mx.array,
              scale: float) -> mx.array:
    """The same attention with MLX's ops: gather, mask by length, SDPA.
    q [B, H, 1, D]; pool_k/pool_v [Hk, S, D]; slots [B, L] int32; lengths [B] int32."""
    k = pool_k[:, slots].transpose(1, 0, 2, 3)  # [B, Hk, L, D]
    v = pool_v[:, slots].transpose(1, 0, 2, 3)
    mask = mx.arange(slots.shape[1])[None] < lengths[:, None]
    return mx.fast.scaled_dot_product_attention(q, k, v, scale=scale, mask=mask[:, None, None, :])


def decode(q: mx.array, pool_k: mx.array, pool_v: mx.array, slots: mx.array, lengths: mx.array,
           scale: float, use_kernel: bool) -> mx.array:
    """Attention of one query per row over positions [0, lengths[b]) of its slot table."""
    B, H, T, D = q.shape
    Hk = pool_k.shape[0]
    if not use_kernel or T != 1 or not supports(D, H, Hk) or pool_k.dtype != q.dtype:
        return reference(q, pool_k, pool_v, slots, lengths, scale)
    global _kernel
    if _kernel is None:
        _kernel = mx.fast.cuda_kernel(
            name="unikern_paged_decode",
            input_names=["q", "k_pool", "v_pool", "slots", "lengths", "scale"],
            output_names=["out"],
            source=_SOURCE,
        )
    if scale not in _scales:
        _scales[scale] = mx.array([scale], dtype=mx.float32)
    (out,) = _kernel(
        inputs=[q, pool_k, pool_v, slots.astype(mx.int32), lengths.astype(mx.int32), _scales[scale]],
        template=[("T", q.dtype), ("D", D), ("E", D // 32), ("H", H), ("HK", Hk), ("NW", WARPS)],
        grid=(B * H * WARPS * 32, 1, 1),
        threadgroup=(WARPS * 32, 1, 1),
        output_shapes=[(B, H, 1, D)],
        output_dtypes=[q.dtype],
    )
    return out
