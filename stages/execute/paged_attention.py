"""Decode attention read straight from the paged pool (execute.paged_attention).

A decode step of several rows used to gather every row's keys and values out of the pool
into a dense [B, H, L, D] copy per layer and run a masked SDPA over it; an array mask
keeps MLX's CUDA SDPA off its fused decode kernel. Here one kernel per layer walks each
row's slot table in the pool, with the row's length instead of a mask: no gathered copy,
no mask, and fixed shapes, so a one-row window can be a traced (`mx.compile`d) step too.

On CUDA the kernel is written with `mx.fast.cuda_kernel`: one thread block per (row,
query head); each warp takes 32 positions at a time, a lane per position for q.k (one
warp-wide max and sum per 32 positions, an online softmax in float32) and a lane per
feature for the values; the warps are merged at the end. (Its first version gave each
position a whole warp and a shuffle reduction: 220 us per token over the 16 layers of
the 1B shape on an H200, latency-bound.) Elsewhere (and for head sizes the kernel does not take)
`reference` computes the same thing with MLX's own ops; the CPU tests run the routing
through it and a GPU test holds the kernel to it."""

from __future__ import annotations

import mlx.core as mx

WARPS = 8  # per block: chunks of 32 positions are dealt round-robin to the warps

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
    constexpr int PACK = 16 / sizeof(T);  // elements per 16-byte load
    __shared__ float s_q[D];
    for (int e = threadIdx.x; e < D; e += blockDim.x) {
        s_q[e] = static_cast<float>(q[(size_t)bh * D + e]) * scale[0];
    }
    __syncthreads();
    float acc[E];
    for (int e = 0; e < E; ++e) acc[e] = 0.f;
    float m = -INFINITY;
    float l = 0.f;
    // each warp takes 32 positions at a time, one per lane: the lane's whole q.k in
    // 16-byte loads, one max and one sum across the warp per chunk; then the chunk's
    // values, a row at a time, each lane its E features of the row
    for (int t0 = warp * 32; t0 < len; t0 += NW * 32) {
        const int t = t0 + lane;
        float s = -INFINITY;
        int slot = 0;
        if (t < len) {
            slot = slots[(size_t)b * L + t];
            const uint4* row = reinterpret_cast<const uint4*>(k_pool + ((size_t)kvh * S + slot) * D);
            float dot = 0.f;
            for (int c = 0; c < D / PACK; ++c) {
                const uint4 raw = row[c];
                const T* x = reinterpret_cast<const T*>(&raw);
                for (int i = 0; i < PACK; ++i) dot += s_q[c * PACK + i] * static_cast<float>(x[i]);
            }
            s = dot;
        }
        float top = s;
        for (int o = 16; o > 0; o >>= 1) top = fmaxf(top, __shfl_xor_sync(0xffffffff, top, o));
        const float m_new = fmaxf(m, top);  // finite: lane 0's position is in range
        const float corr = expf(m - m_new);
        const float p = t < len ? expf(s - m_new) : 0.f;
        float sum = p;
        for (int o = 16; o > 0; o >>= 1) sum += __shfl_xor_sync(0xffffffff, sum, o);
        l = l * corr + sum;
        for (int e = 0; e < E; ++e) acc[e] *= corr;
        const int n = min(32, len - t0);
        for (int j = 0; j < n; ++j) {
            const float pj = __shfl_sync(0xffffffff, p, j);
            const int sj = __shfl_sync(0xffffffff, slot, j);
            const T* vr = v_pool + ((size_t)kvh * S + sj) * D + lane * E;
            for (int e = 0; e < E; ++e) acc[e] += pj * static_cast<float>(vr[e]);
        }
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
