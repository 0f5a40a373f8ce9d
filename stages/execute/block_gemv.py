"""The GEMV kernel of a fused decoder block's steps (stages/execute/blocks.py): one
output pair per warp (or SPLIT warps), with the RMS norm before it and the residual add,
RoPE or SwiGLU after it, for steps of up to MAX_ROWS rows; its CUDA source runs in the
tests' emulation (tests/test_decode_blocks.py) and compiles for sm_90 with NVRTC
(tools/nvrtc_check.py)."""

from __future__ import annotations

import mlx.core as mx

from unikern.platform.kernel_cache import cuda_kernel, float_bits, off_small_pool, placeholder

WARPS = 8  # per block of the kernel: WARPS / SPLIT output pairs (split_for)
UNROLL = 2  # 16-byte chunks per lane in flight per weight row and pass: 40-48 registers, many warps per SM
MAX_ROWS = 4  # steps of more rows run the family's own code (MLX's GEMM)
# warps per output pair (split_for): more while the grid has fewer blocks than this (two
# per SM of an H200) and each lane keeps at least MIN_LOADS chunks per row. (MLX's own
# GEMV gives a warp one row and keeps few loads in flight per lane, 8 bytes each, with
# many warps per SM; UNROLL = 1 comes nearest that: tools/probe_cuda.py's
# engine-paged-blocks-u1.)
TARGET_BLOCKS = 264
MIN_LOADS = 4

ITEMSIZE = {mx.float32: 4, mx.bfloat16: 2, mx.float16: 2}
# epilogues
PLAIN, RESIDUAL, ROPE, SWIGLU = 0, 1, 2, 3

# 16 bytes of a row as floats, by the row's dtype (MLX's custom kernels give T as
# float, __nv_bfloat16 or __half)
_HEADER = """
template <typename U> __device__ inline void unikern_unpack(const uint4& v, float* o);
template <> __device__ inline void unikern_unpack<float>(const uint4& v, float* o) {
    o[0] = __uint_as_float(v.x); o[1] = __uint_as_float(v.y);
    o[2] = __uint_as_float(v.z); o[3] = __uint_as_float(v.w);
}
template <> __device__ inline void unikern_unpack<__nv_bfloat16>(const uint4& v, float* o) {
    const __nv_bfloat162* h = reinterpret_cast<const __nv_bfloat162*>(&v);
    for (int i = 0; i < 4; ++i) {
        const float2 f = __bfloat1622float2(h[i]);
        o[2 * i] = f.x; o[2 * i + 1] = f.y;
    }
}
template <> __device__ inline void unikern_unpack<__half>(const uint4& v, float* o) {
    const __half2* h = reinterpret_cast<const __half2*>(&v);
    for (int i = 0; i < 4; ++i) {
        const float2 f = __half22float2(h[i]);
        o[2 * i] = f.x; o[2 * i + 1] = f.y;
    }
}
"""

# x [rows, K] (rows <= ROWS) against w [N, K]: out [rows, NOUT] (NOUT = N, or N / 2 for
# SWIGLU). NORM: x goes through the RMS norm (norm_w, eps) first. BIAS: w's bias. MODE:
# the epilogue (PLAIN, RESIDUAL: + res [rows, NOUT], ROPE: the first ROPE_PAIRS pairs
# rotated by pi * pos [rows] * freq_pi [HD / 2], and the features in three outputs:
# out [rows, QN] (q), out_k and out_v [rows, (N - QN) / 2], so each is contiguous, or
# with POOL k and v written in place into k_pool and v_pool [kv heads, slots, HD] at
# each row's slot (slots [rows]) instead of out_k and out_v;
# SWIGLU: silu(gate) * up, gate = features [0, N / 2), up = [N / 2, N)). A pair's K is
# split over SPLIT warps of the block, whose sums meet in shared memory. Each warp issues
# its first pass' weight loads first; with NORM it then sums the squares of the whole
# row itself (the row is a few KB, read from L2 by every warp) while they are in flight,
# and normalizes each 16 bytes of x as it multiplies them: no block-wide barrier before
# the multiply. (The first version staged the normalized rows in shared memory, with two
# barriers per block: on an H200 its q/k/v GEMV ran at 0.55 TB/s and its gate/up at
# 1.8, against MLX's GEMV's 3.2 over the token; tools/results/gpu/session11/c-blocks-v2.)
_SOURCE = """
    constexpr int PACK = 16 / sizeof(T);  // elements per 16-byte load
    constexpr int C = K / PACK;  // 16-byte chunks per row of w
    constexpr int PER = (C + SPLIT - 1) / SPLIT;  // chunks per warp of a pair
    const int warp = threadIdx.x / 32;
    const int lane = threadIdx.x % 32;
    const int rows = x_shape[0];
    const int p = blockIdx.x * (WARPS / SPLIT) + warp / SPLIT;  // this warp's pair of output features
    const bool live = p < N / 2;  // (no return before the block's barrier)
    int f0 = 2 * p, f1 = 2 * p + 1;
    if (MODE == 3) {
        f0 = p;
        f1 = p + N / 2;
    }
    if (MODE == 2 && p < ROPE_PAIRS) {
        const int head = p / (HD / 2), i = p % (HD / 2);
        f0 = TRAD ? head * HD + 2 * i : head * HD + i;
        f1 = TRAD ? f0 + 1 : f0 + HD / 2;
    }
    if (!live) f0 = f1 = 0;
    const uint4* w0 = reinterpret_cast<const uint4*>(w + (size_t)f0 * K);
    const uint4* w1 = reinterpret_cast<const uint4*>(w + (size_t)f1 * K);
    const int lo = (warp % SPLIT) * PER;
    const int hi = min(C, lo + PER);
    uint4 a[U], b[U];
    #pragma unroll
    for (int u = 0; u < U; ++u) {  // the first pass' loads, before anything waits
        const int c = lo + u * 32 + lane;
        if (live && c < hi) {
            a[u] = w0[c];
            b[u] = w1[c];
        }
    }
    float inv[ROWS];  // each row's 1 / rms (NORM)
    #pragma unroll
    for (int r = 0; r < ROWS; ++r) {
        float s = 0.f;
        if (NORM && SSI && r < rows) {
            s = ss[r];  // handed over by the kernel that wrote x (SSO)
        } else if (NORM && live && r < rows) {
            const uint4* xr = reinterpret_cast<const uint4*>(x + (size_t)r * K);
            #pragma unroll 8
            for (int c = lane; c < C; c += 32) {
                float v[PACK];
                unikern_unpack<T>(xr[c], v);
                #pragma unroll
                for (int e = 0; e < PACK; ++e) s += v[e] * v[e];
            }
            for (int o = 16; o > 0; o >>= 1) s += __shfl_xor_sync(0xffffffff, s, o);
        }
        inv[r] = rsqrtf(s / K + __int_as_float(EPS));
    }
    float acc0[ROWS], acc1[ROWS];
    for (int r = 0; r < ROWS; ++r) {
        acc0[r] = 0.f;
        acc1[r] = 0.f;
    }
    for (int c0 = lo; live && c0 < hi; c0 += 32 * U) {
        if (c0 != lo) {
            #pragma unroll
            for (int u = 0; u < U; ++u) {
                const int c = c0 + u * 32 + lane;
                if (c < hi) {
                    a[u] = w0[c];
                    b[u] = w1[c];
                }
            }
        }
        #pragma unroll
        for (int u = 0; u < U; ++u) {
            const int c = c0 + u * 32 + lane;
            if (c < hi) {
                float wa[PACK], wb[PACK], nw[PACK];
                unikern_unpack<T>(a[u], wa);
                unikern_unpack<T>(b[u], wb);
                if (NORM) unikern_unpack<T>(reinterpret_cast<const uint4*>(norm_w)[c], nw);
                #pragma unroll
                for (int r = 0; r < ROWS; ++r) {
                    if (r < rows) {
                        float xv[PACK];
                        unikern_unpack<T>(reinterpret_cast<const uint4*>(x + (size_t)r * K)[c], xv);
                        #pragma unroll
                        for (int e = 0; e < PACK; ++e) {
                            // as MLX's rms_norm: the normalized value rounded, times the weight rounded
                            const float xe = NORM ? static_cast<float>(static_cast<T>(
                                nw[e] * static_cast<float>(static_cast<T>(xv[e] * inv[r])))) : xv[e];
                            acc0[r] += xe * wa[e];
                            acc1[r] += xe * wb[e];
                        }
                    }
                }
            }
        }
    }
    #pragma unroll
    for (int r = 0; r < ROWS; ++r) {
        for (int o = 16; o > 0; o >>= 1) {
            acc0[r] += __shfl_xor_sync(0xffffffff, acc0[r], o);
            acc1[r] += __shfl_xor_sync(0xffffffff, acc1[r], o);
        }
    }
    if (SPLIT > 1) {  // the pair's other warps hand their sums to its first
        __shared__ float sums[WARPS][2 * ROWS];
        if (lane == 0)
            for (int r = 0; r < ROWS; ++r) {
                sums[warp][2 * r] = acc0[r];
                sums[warp][2 * r + 1] = acc1[r];
            }
        __syncthreads();
        if (warp % SPLIT == 0)
            for (int r = 0; r < ROWS; ++r)
                for (int q = 1; q < SPLIT; ++q) {
                    acc0[r] += sums[warp + q][2 * r];
                    acc1[r] += sums[warp + q][2 * r + 1];
                }
    }
    // (no return before SSO's barriers below: every thread reaches them)
    const bool writer = live && lane == 0 && warp % SPLIT == 0;
    float sq[ROWS];  // SSO: this pair's outputs squared, per row
    for (int r = 0; r < ROWS; ++r) sq[r] = 0.f;
    if (writer) {
    T* dst = out;  // and the columns and width of the output the pair belongs to
    int c0 = f0, c1 = f1, width = NOUT;
    bool pooled = false;
    if (MODE == 2 && f0 >= QN) {
        const int kn = (N - QN) / 2;
        const bool is_v = f0 >= QN + kn;
        dst = is_v ? out_v : out_k;
        c0 -= is_v ? QN + kn : QN;
        c1 -= is_v ? QN + kn : QN;
        width = kn;
        if (POOL) {  // k and v go straight into the layer's pool [kv heads, slots, HD], in place
            dst = is_v ? const_cast<T*>(v_pool) : const_cast<T*>(k_pool);
            pooled = true;
        }
    }
    for (int r = 0; r < rows; ++r) {
        float s0 = acc0[r], s1 = acc1[r];
        if (BIAS) {
            s0 += static_cast<float>(bias[f0]);
            s1 += static_cast<float>(bias[f1]);
        }
        const float y0 = static_cast<float>(static_cast<T>(s0));  // the matmul's output, rounded
        const float y1 = static_cast<float>(static_cast<T>(s1));
        // a pair is one head's (HD even): row r's slot of that head's slots
        T* o = pooled ? dst + (size_t)(c0 / HD) * (k_pool_shape[1] - 1) * HD + (size_t)slots[r] * HD
                      : dst + (size_t)r * width;
        if (MODE == 1) {
            const T v0 = static_cast<T>(y0 + static_cast<float>(res[(size_t)r * NOUT + f0]));
            const T v1 = static_cast<T>(y1 + static_cast<float>(res[(size_t)r * NOUT + f1]));
            o[c0] = v0;
            o[c1] = v1;
            const float a0 = static_cast<float>(v0), a1 = static_cast<float>(v1);
            sq[r] += a0 * a0 + a1 * a1;
        } else if (MODE == 2 && p < ROPE_PAIRS) {
            float s, c;  // the angle in units of pi: an exact range reduction, no slow path
            sincospif(static_cast<float>(pos[r]) * freq_pi[p % (HD / 2)], &s, &c);
            o[c0] = static_cast<T>(y0 * c - y1 * s);
            o[c1] = static_cast<T>(y1 * c + y0 * s);
        } else if (MODE == 3) {
            const float sig = static_cast<float>(static_cast<T>(1.f / (1.f + expf(-y0))));
            const float act = static_cast<float>(static_cast<T>(y0 * sig));
            o[p] = static_cast<T>(act * y1);
        } else {
            o[c0] = static_cast<T>(y0);
            o[c1] = static_cast<T>(y1);
        }
    }
    }
    if (SSO) {  // each row's sum of squares of this kernel's outputs, for the next RMS norm
        __shared__ float blk[WARPS][ROWS];
        __shared__ int last;
        if (lane == 0)
            for (int r = 0; r < ROWS; ++r) blk[warp][r] = writer ? sq[r] : 0.f;
        __syncthreads();
        if (threadIdx.x == 0) {  // the block's share, then whether it is the last block done
            for (int r = 0; r < rows; ++r) {
                float t = 0.f;
                for (int w = 0; w < WARPS; ++w) t += blk[w][r];
                out_part[(size_t)r * gridDim.x + blockIdx.x] = t;
            }
            __threadfence();
            last = atomicAdd(const_cast<unsigned*>(counter), 1u) == gridDim.x - 1;
        }
        __syncthreads();
        if (last && warp == 0) {  // the last block adds every block's share, in a fixed order
            __threadfence();
            const volatile float* part = out_part;
            for (int r = 0; r < rows; ++r) {
                float t = 0.f;
                for (int b = lane; b < (int)gridDim.x; b += 32) t += part[(size_t)r * gridDim.x + b];
                for (int o = 16; o > 0; o >>= 1) t += __shfl_xor_sync(0xffffffff, t, o);
                if (lane == 0) out_ss[r] = t;
            }
            if (lane == 0) atomicExch(const_cast<unsigned*>(counter), 0u);  // ready for the next launch
        }
    }
"""
_INPUTS = ("x", "w", "bias", "norm_w", "res", "pos", "freq_pi", "k_pool", "v_pool", "slots", "ss",
           "counter")
_OUTPUTS = ("out", "out_k", "out_v", "out_ss", "out_part")


def counter() -> mx.array:
    """A zero counter for one call site's `hand_ss` (uint32; its first element counts
    the blocks done). In device memory: in MLX's pool of small arrays every block's
    atomic crossed the bus (kernel_cache.SMALL_POOL_BYTES)."""
    return mx.zeros((off_small_pool(1, 4),), dtype=mx.uint32)


def split_for(K: int, N: int, dtype: mx.Dtype) -> int:
    """Warps per output pair of the kernel over w [N, K] (see TARGET_BLOCKS): a power of
    two, at most WARPS."""
    chunks = K * ITEMSIZE[dtype] // 16
    split = 1
    while (split < WARPS and (N // 2) * split < TARGET_BLOCKS * WARPS
           and chunks // (2 * split) >= 32 * MIN_LOADS):
        split *= 2
    return split


def gemv(x: mx.array, w: mx.array, mode: int, bias: mx.array | None = None,
         norm: tuple[mx.array, mx.array] | None = None, res: mx.array | None = None,
         pos: mx.array | None = None, freq_pi: mx.array | None = None, head_dim: int = 0,
         rope_pairs: int = 0, q_features: int = 0, traditional: bool = False,
         out_shape: tuple[int, ...] | None = None,
         pool: tuple[mx.array, mx.array, mx.array] | None = None, ss: mx.array | None = None,
         hand_ss: mx.array | None = None) -> mx.array | list[mx.array] | tuple[mx.array, mx.array]:
    """The kernel over x [rows, K] and w [N, K] (see _SOURCE): its output, or for ROPE [q, k,
    v] (q_features of q, the rest halved between k and v). norm: (weight, eps, a float: a
    template argument, not an array read by every warp); freq_pi: RoPE's inverse frequencies
    over pi. x may be any contiguous [rows, ...] array of rows x K elements, and the output
    is given the shape the caller reads it in (`out_shape`; for ROPE, [rows, heads, 1,
    head_dim] each): the kernel reads and writes flat rows, so no reshape node is added on
    either side (each costs the host about 1 us per token and layer on an H200:
    tools/probe_ops.py).
    pool (ROPE): (k_pool, v_pool, slots), a layer's pool arrays [kv heads, slots, head_dim]
    and each row's slot (int32 [rows]): k and v are written there in place, not returned
    (their outputs are placeholders), in place of two scatters per layer. The arrays must be
    the pool's own contiguous ones (the kernel writes into their buffers; MLX would copy a
    strided input and the write would go to the copy), and whatever reads them back must
    depend on q (the paged attention kernel takes q) so MLX orders it after this kernel.
    hand_ss (RESIDUAL): a uint32 counter (`counter()`), zero, kept for this call site (the
    kernel leaves it zero): returns (out, ss), ss the rows' sums of squares of the outputs
    as rounded (float32, its first `rows` elements; longer where one row's would lie in
    MLX's pool of small arrays, kernel_cache.SMALL_POOL_BYTES), added in a fixed order, so
    the same every run, for the next kernel's norm. ss (with norm): those sums, so the
    kernel does not add the row's squares itself: the RMS norm of x with no kernel of its
    own and no warp reading the whole row first (execute.fuse_blocks' KERNEL_NORM = 2)."""
    rows, K = x.shape[0], w.shape[1]
    if x.size != rows * K:
        raise ValueError(f"the block kernel's input must hold {rows} rows of {K}, not shape {x.shape}")
    if rows > MAX_ROWS:
        raise ValueError(f"the block kernel takes up to {MAX_ROWS} rows, not {rows}")
    N = w.shape[0]
    f32 = placeholder(mx.float32)
    nout = N // 2 if mode == SWIGLU else q_features if mode == ROPE else N
    split = split_for(K, N, x.dtype)
    template = [("T", x.dtype), ("K", K), ("N", N), ("NOUT", nout), ("ROWS", 1 << (rows - 1).bit_length()),
                ("WARPS", WARPS), ("SPLIT", split), ("U", UNROLL), ("NORM", int(norm is not None)),
                ("BIAS", int(bias is not None)), ("MODE", mode), ("HD", head_dim or 2), ("ROPE_PAIRS", rope_pairs),
                ("QN", q_features if mode == ROPE else N), ("TRAD", int(traditional)), ("POOL", int(pool is not None)),
                ("SSI", int(ss is not None)), ("SSO", int(hand_ss is not None)),
                ("EPS", float_bits(norm[1]) if norm else 0)]
    inputs = [x, w, bias if bias is not None else placeholder(x.dtype),
              norm[0] if norm else placeholder(x.dtype),
              res if res is not None else placeholder(x.dtype),
              pos if pos is not None else placeholder(mx.int32), freq_pi if freq_pi is not None else f32,
              *(pool if pool is not None else (placeholder(x.dtype), placeholder(x.dtype), placeholder(mx.int32))),
              ss if ss is not None else f32, hand_ss if hand_ss is not None else placeholder(mx.uint32)]
    if (ss is not None and norm is None) or (hand_ss is not None and mode != RESIDUAL):
        raise ValueError("the block kernel takes handed sums of squares with a norm, and hands them from RESIDUAL "
                         f"steps (mode {mode}, norm {norm is not None}, ss {ss is not None}, hand_ss "
                         f"{hand_ss is not None})")
    if pool is not None and (mode != ROPE or pool[0].dtype != x.dtype or pool[0].shape[-1] != head_dim):
        raise ValueError(f"the block kernel writes the pool from ROPE steps of its dtype and head_dim only: mode "
                         f"{mode}, pool {pool[0].dtype} {pool[0].shape}, input {x.dtype}, head_dim {head_dim}")
    kv = (N - q_features) // 2
    if mode == ROPE:
        shapes = [(rows, nout // head_dim, 1, head_dim)] + [(1,) if pool else (rows, kv // head_dim, 1, head_dim)] * 2
    else:
        shapes = [out_shape or (rows, nout), (1,), (1,)]
    blocks = -(-(N // 2) // (WARPS // split))
    shapes += [(off_small_pool(rows, 4),), (rows, blocks)] if hand_ss is not None else [(1,), (1,)]
    kernel = cuda_kernel("unikern_block_gemv", _INPUTS, _SOURCE, _HEADER, _OUTPUTS)
    outs = kernel(inputs=inputs, template=template, grid=(blocks * WARPS * 32, 1, 1), threadgroup=(WARPS * 32, 1, 1),
                  output_shapes=shapes, output_dtypes=[x.dtype] * 3 + [mx.float32] * 2)
    if hand_ss is not None:
        return outs[0], outs[3]
    return list(outs[:3]) if mode == ROPE else outs[0]
