"""Decode attention read straight from the paged pool (execute.paged_attention).

A decode step of several rows used to gather every row's keys and values out of the pool
into a dense [B, H, L, D] copy per layer and run a masked SDPA over it; an array mask
keeps MLX's CUDA SDPA off its fused decode kernel. Here one kernel per layer walks each
row's slot table in the pool, with the row's length instead of a mask: no gathered copy,
no mask, and fixed shapes, so a one-row window can be a traced (`mx.compile`d) step too.

On CUDA the kernel is written with `mx.fast.cuda_kernel`: one thread block per (row,
KV head) (or per row and query head: `KERNEL`), each warp taking every NW-th position
with an online softmax in float32, the warps merged at the end; a long row at few rows
is split over several blocks and merged by a second kernel (`partitions`). (A version
with a lane per position for q.k, one warp-wide max and sum per 32 positions, measured
slower on an H200: 248 against 220 us per token over the 16 layers of the 1B shape at
one row, 990 against 744 at 64 rows; tools/results/gpu/H200-issue17.md.) Elsewhere (and
for head sizes the kernel does not take) `reference` computes the same thing with MLX's
own ops; the CPU tests run the routing through it, run the kernels' CUDA source in a
thread-per-lane emulation (tests/cuda_emulation.py), and a GPU test holds the kernels
to it."""

from __future__ import annotations

import mlx.core as mx

from unikern.platform.kernel_cache import cuda_kernel, float_bits, off_small_pool

WARPS = 8  # per block: positions are dealt round-robin to the warps
# With fewer blocks than this (a one-row step has one per KV head: 8 of an H200's 132
# SMs busy), the group kernel's blocks take FEW_BLOCKS_WARPS warps where their partials
# fit in shared memory: more positions in flight per block. A one-row token of the 1B
# shape on an H200 (CUPTI, 16 layers): 170 us with 16 warps, 210 with 8; the kernel
# before the slot prefetch below took 227 (session 8). The 8B shape's 32 layers: 376 us,
# 578 before (tools/results/gpu/session9/).
FEW_BLOCKS = 128
FEW_BLOCKS_WARPS = 16

# A block still walks its share of a row's positions alone, so with few blocks one row's
# time grows with its context: at 4,000 positions the unsplit kernel took 211 us per
# layer of the 1B shape on an H200, where mlx-lm's attention took 12 (one row,
# tools/results/gpu/session9/c-long-context). So where few blocks would run and the slot
# table is long, the group kernel splits each row's positions over P blocks
# (`partitions`), each writing its unnormalized partial softmax (its sum of exp-weighted
# values, its max and its sum of weights) in float32, and a second kernel merges a row's
# P partials per query head (flash-decoding). On an H200, one row of the 1B shape at a
# 4,000-token prompt: attention 3.37 ms per token unsplit, 0.78-0.89 ms split (16 blocks
# per KV head), the token 4.53 -> 1.93 ms against mlx-lm's 3.78; 16 rows at 1,000
# tokens (2 blocks each): 1.88 -> 1.21 ms per step. Aiming at 512 or 1,024 blocks gave
# 0.75 and 0.70 ms, the merge growing as the partial kernel shrank: within 3% of the
# token's GPU time (tools/results/gpu/session10/).
SPLIT_BLOCKS = 256  # aim: about this many blocks of the partial kernel
SPLIT_MIN_POSITIONS = 256  # table positions per partition at least: shorter rows stay whole

# Positions whose keys and values a warp of the group kernel loads before using any: its
# loads in flight (the partial kernel at one block per SM looks bound by their latency,
# inferred from its 44-48 us per layer for 8 MB). 2 was measured (sessions 9 and 10);
# more is written for the next measurement (tools/probe_cuda.py's engine-paged-u4 and
# -u8), not measured yet.
POSITIONS_IN_FLIGHT = 2

_HEAD_SOURCE = """
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
        qv[e] = static_cast<float>(q[(size_t)bh * D + lane * E + e]) * __int_as_float(SCALE);
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

# The same attention with one block per (row, KV head) for all G query heads of its
# group: each key and value is read once for the group instead of G times, and each warp
# carries G independent dot products and softmaxes per position (G times the work between
# its dependent shuffles). The default (KERNEL): on an H200 at the 1B shape (8 KV heads of
# 4 query heads each) it took 227 / 587 / 598 us per step at 1 / 16 / 64 rows against the
# head kernel's 238 / 703 / 616 (CUPTI, tools/results/gpu/session8/a-gemv/probe-engine*).
_GROUP_SOURCE = """
    const int P = gridDim.x / (lengths_shape[0] * HK);  // blocks per (row, KV head): 1 unsplit
    const int bk = blockIdx.x / P;
    const int part = blockIdx.x % P;
    const int b = bk / HK;
    const int kvh = bk % HK;
    const int warp = threadIdx.x / 32;
    const int lane = threadIdx.x % 32;
    const int L = slots_shape[1];
    const size_t S = k_pool_shape[1];
    const int len = min(lengths[b], L);
    const int chunk = (len + P - 1) / P;  // this block's positions: [lo, hi)
    const int lo = min(len, part * chunk);
    const int hi = min(len, lo + chunk);
    float qv[G][E];
    float acc[G][E];
    float m[G];
    float l[G];
    for (int g = 0; g < G; ++g) {
        const size_t row = ((size_t)b * H + (size_t)kvh * G + g) * D + lane * E;
        for (int e = 0; e < E; ++e) {
            qv[g][e] = static_cast<float>(q[row + e]) * __int_as_float(SCALE);
            acc[g][e] = 0.f;
        }
        m[g] = -INFINITY;
        l[g] = 0.f;
    }
    // positions warp, warp + NW, ...: lane i of the warp loads the slot of the warp's
    // i-th next position, handed out by shuffles, so a key's load waits on no other
    // load; U positions' keys and values are loaded before any is used
    for (int t0 = lo + warp; t0 < hi; t0 += 32 * NW) {
        const int mine = t0 + lane * NW;
        const int my_slot = mine < hi ? slots[(size_t)b * L + mine] : 0;
        const int count = min(32, (hi - t0 + NW - 1) / NW);  // the warp's positions this round
        for (int j = 0; j < count; j += U) {
            const int pair = min(U, count - j);  // the same in every lane
            float kf[U][E];
            float vf[U][E];
            for (int u = 0; u < U; ++u) {
                const int slot = __shfl_sync(0xffffffff, my_slot, u < pair ? j + u : j);
                const size_t base = ((size_t)kvh * S + (size_t)slot) * D + lane * E;
                for (int e = 0; e < E; ++e) {
                    kf[u][e] = static_cast<float>(k_pool[base + e]);
                    vf[u][e] = static_cast<float>(v_pool[base + e]);
                }
            }
            #pragma unroll
            for (int u = 0; u < U; ++u) {  // unrolled: kf and vf stay in registers
                if (u >= pair) break;  // the same in every lane: the shuffles below see the whole warp
                float s[G];
                for (int g = 0; g < G; ++g) {
                    s[g] = 0.f;
                    for (int e = 0; e < E; ++e) s[g] += qv[g][e] * kf[u][e];
                }
                for (int o = 16; o > 0; o >>= 1) {
                    for (int g = 0; g < G; ++g) s[g] += __shfl_xor_sync(0xffffffff, s[g], o);
                }
                for (int g = 0; g < G; ++g) {
                    const float m_new = fmaxf(m[g], s[g]);
                    const float corr = expf(m[g] - m_new);
                    const float p = expf(s[g] - m_new);
                    l[g] = l[g] * corr + p;
                    for (int e = 0; e < E; ++e) acc[g][e] = acc[g][e] * corr + p * vf[u][e];
                    m[g] = m_new;
                }
            }
        }
    }
    __shared__ float s_m[NW][G];
    __shared__ float s_l[NW][G];
    __shared__ float s_acc[NW][G][D];
    for (int g = 0; g < G; ++g) {
        if (lane == 0) {
            s_m[warp][g] = m[g];
            s_l[warp][g] = l[g];
        }
        for (int e = 0; e < E; ++e) s_acc[warp][g][lane * E + e] = acc[g][e];
    }
    __syncthreads();
    for (int g = warp; g < G; g += NW) {  // a warp merges each head of the group
        float top = -INFINITY;
        for (int w = 0; w < NW; ++w) top = fmaxf(top, s_m[w][g]);
        float total = 0.f;
        float o[E];
        for (int e = 0; e < E; ++e) o[e] = 0.f;
        for (int w = 0; w < NW; ++w) {
            const float c = s_m[w][g] == -INFINITY ? 0.f : expf(s_m[w][g] - top);
            total += s_l[w][g] * c;
            for (int e = 0; e < E; ++e) o[e] += s_acc[w][g][lane * E + e] * c;
        }
"""

_GROUP_OUT = """
        const size_t row = ((size_t)b * H + (size_t)kvh * G + g) * D + lane * E;
        for (int e = 0; e < E; ++e) out[row + e] = static_cast<T>(o[e] / total);
    }
"""

# the split's partial kernel: per (block, head of the group) D + 2 floats, the weighted
# sum of values, then the max and the sum of the weights (-inf and 0 for no positions)
_GROUP_PARTS = """
        const size_t at = ((size_t)blockIdx.x * G + g) * (D + 2);
        for (int e = 0; e < E; ++e) out[at + lane * E + e] = o[e];
        if (lane == 0) {
            out[at + D] = top;
            out[at + D + 1] = total;
        }
    }
"""

# the split's merge: a warp per (row, query head) over the row's P partials
_MERGE_SOURCE = """
    const int bh = blockIdx.x;
    const int b = bh / H;
    const int h = bh % H;
    const int lane = threadIdx.x;
    const int P = parts_shape[0] / (gridDim.x / H * HK);  // partials per (row, KV head)
    const size_t first = (((size_t)b * HK + h / G) * P * G + h % G) * (D + 2);  // partial 0
    float top = -INFINITY;
    for (int p = 0; p < P; ++p) top = fmaxf(top, parts[first + (size_t)p * G * (D + 2) + D]);
    float total = 0.f;
    float o[E];
    for (int e = 0; e < E; ++e) o[e] = 0.f;
    for (int p = 0; p < P; ++p) {
        const size_t at = first + (size_t)p * G * (D + 2);
        const float c = parts[at + D] == -INFINITY ? 0.f : expf(parts[at + D] - top);
        total += parts[at + D + 1] * c;
        for (int e = 0; e < E; ++e) o[e] += parts[at + lane * E + e] * c;
    }
    for (int e = 0; e < E; ++e) out[(size_t)bh * D + lane * E + e] = static_cast<T>(o[e] / total);
"""

# which kernel decode() runs: "group" (above) or "head" (a block per row and query head;
# tests and tools/probe_cuda.py set it to compare the two)
KERNEL = "group"
GROUP_SHARED_BYTES = 32 << 10  # the group kernel's per-warp partials live in shared memory


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


def partitions(B: int, Hk: int, L: int) -> int:
    """Blocks the group kernel splits each (row, KV head) over, for B rows of a slot
    table L positions wide: up to SPLIT_BLOCKS blocks in all, SPLIT_MIN_POSITIONS table
    positions each at least; 1 (no split) for short tables and full batches."""
    return max(1, min(SPLIT_BLOCKS // (B * Hk), L // SPLIT_MIN_POSITIONS))


def launch(B: int, H: int, Hk: int, D: int, P: int = 1) -> tuple[str, str, dict[str, int], int]:
    """The kernel KERNEL selects for these shapes (the group kernel where its partials fit
    in shared memory): its name, source, integer template parameters (NW: warps per
    block) and block count. P > 1 (the group kernel only): the split's partial kernel,
    P blocks per (row, KV head), whose output `merge_launch`'s kernel reduces."""
    constants = {"D": D, "E": D // 32, "H": H, "HK": Hk, "NW": WARPS}
    if not uses_group_kernel(H, Hk, D):
        assert P == 1, "only the group kernel splits a row's positions"
        return "head", _HEAD_SOURCE, constants, B * H
    group = H // Hk
    if B * Hk * P < FEW_BLOCKS and FEW_BLOCKS_WARPS * group * D * 4 <= GROUP_SHARED_BYTES:
        constants["NW"] = FEW_BLOCKS_WARPS
    constants["U"] = POSITIONS_IN_FLIGHT
    if P > 1:
        return "group_parts", _GROUP_SOURCE + _GROUP_PARTS, {**constants, "G": group}, B * Hk * P
    return "group", _GROUP_SOURCE + _GROUP_OUT, {**constants, "G": group}, B * Hk


def merge_launch(B: int, H: int, Hk: int, D: int) -> tuple[str, dict[str, int], int, int]:
    """The split's merge (it reads P from its input's shape): its source, template
    parameters, block count and threads per block (a warp per row and query head)."""
    return _MERGE_SOURCE, {"D": D, "E": D // 32, "H": H, "HK": Hk, "G": H // Hk}, B * H, 32


def uses_group_kernel(H: int, Hk: int, D: int) -> bool:
    """KERNEL is the group kernel and its per-warp partials fit in shared memory."""
    return KERNEL == "group" and WARPS * (H // Hk) * D * 4 <= GROUP_SHARED_BYTES


# keys and values [B, Hk, 1, D] written into the pools [Hk, S, D] at each row's slot, in
# place (the pool arrays are inputs: MLX sees no write to them, so what reads them back
# takes `done` as an input of its own kernel, which orders it after this one; MLX's CUDA
# graph orders a kernel after the kernels that wrote its inputs' buffers, nothing else:
# through `mx.depends` on `done` the attention ran beside the write on an H200 and missed
# the step's own key, tools/results/gpu/session16/d-write-kernel). With `after` it held on
# an H200 in session 17 (its CUDA test, same tokens, parity) and is the default
# (WRITE_IN_PLACE): an 8B-shape 4-bit token 4.94 -> 3.47 ms in the runner, 1B 64-row steps
# 711 -> 629 primitives (tools/results/gpu/session17/a-probe).
_WRITE_SOURCE = """
    const int i = blockIdx.x * blockDim.x + threadIdx.x;  // over B * Hk * D
    const int Hk = k_pool_shape[0], S = k_pool_shape[1], D = k_pool_shape[2];
    if (i < slots_shape[0] * Hk * D) {
        const int d = i % D, h = (i / D) % Hk, b = i / (D * Hk);
        const size_t to = ((size_t)h * S + slots[b]) * D + d;
        // keys and values as they come (strided: the family's transposed views, which MLX
        // would otherwise copy for the kernel, two copies per layer and step)
        const_cast<T*>(k_pool)[to] = keys[b * keys_strides[0] + h * keys_strides[1] + d * keys_strides[3]];
        const_cast<T*>(v_pool)[to] = values[b * values_strides[0] + h * values_strides[1] + d * values_strides[3]];
    }
    if (i == 0) done[0] = 1;
"""
WRITE_THREADS = 256
WRITE_IN_PLACE = True  # decode steps' pool writes through `write` (PagedLayerCache)


def write(keys: mx.array, values: mx.array, pool_k: mx.array, pool_v: mx.array, slots: mx.array) -> mx.array:
    """One decode step's keys and values [B, Hk, 1, D] into a layer's pool arrays [Hk, S,
    D] at the rows' slots (int32 [B], contiguous), in place, by one kernel for both (on an
    H200 each of MLX's two scatters it replaces cost the host about 9 us per layer and
    token to encode: tools/probe_ops.py). Returns a small marker array (16 bytes: out of
    MLX's pool of small arrays) that whatever reads the pool back takes as an input of
    its kernel (decode's `after`). Keys and values may be strided
    views (read through their strides, not copied); the pool arrays must be the pool's own
    contiguous ones (the kernel indexes them as such)."""
    B, Hk, T, D = keys.shape
    if T != 1 or pool_k.dtype != keys.dtype or pool_k.shape[0] != Hk or pool_k.shape[2] != D:
        raise ValueError(f"the pool write takes one token per row in the pool's dtype and heads: keys {keys.shape} "
                         f"{keys.dtype}, pool {pool_k.shape} {pool_k.dtype}")
    kernel = cuda_kernel("unikern_pool_write", ("keys", "values", "k_pool", "v_pool", "slots"), _WRITE_SOURCE,
                         outputs=("done",), contiguous=False)
    n = B * Hk * D
    (done,) = kernel(inputs=[keys, values, pool_k, pool_v, slots.astype(mx.int32)], template=[("T", keys.dtype)],
                     grid=(-(-n // WRITE_THREADS) * WRITE_THREADS, 1, 1), threadgroup=(WRITE_THREADS, 1, 1),
                     output_shapes=[(off_small_pool(1, keys.dtype.size),)], output_dtypes=[keys.dtype])
    return done


# One feature f of a decode step's q/k/v row `row` (q's heads, then k's, then v's; QN and
# KN features), its value y (float): q and k rotated with the other of their RoPE pair
# (pairs i and i + HD/2, or 2i and 2i + 1 when TRAD; PAIR, an expression of `d`, f's index
# in its head, gives the other's value) for the row's position, computed in float32 and
# rounded once as MLX's RoPE does; q stored to out [rows, QN] (all of q, k and v to out
# [rows, N] without POOL), k and v into the pool [kv heads, slots, HD] at the row's slot,
# in place. Shared by rope_write and the 4-bit GEMV's RoPE epilogue (quantized.py).
ROPE_STORE = """
        if (f < QN + KN) {  // q or k: rotated with the other of its pair
            const int d = f % HD;
            const bool second = TRAD ? (d & 1) : (d >= HD / 2);
            const float yp = PAIR;
            float sn, cs;  // the angle in units of pi: an exact range reduction, no slow path
            sincospif(static_cast<float>(pos[row]) * freq_pi[TRAD ? d / 2 : d % (HD / 2)], &sn, &cs);
            y = second ? y * cs + yp * sn : y * cs - yp * sn;
        }
        if (!POOL || f < QN) {
            out[(size_t)row * (POOL ? QN : N) + f] = static_cast<T>(y);
        } else {  // k or v of kv head c / HD
            const bool is_v = f >= QN + KN;
            const int c = f - (is_v ? QN + KN : QN);
            T* pool = is_v ? const_cast<T*>(v_pool) : const_cast<T*>(k_pool);
            pool[((size_t)(c / HD) * k_pool_shape[1] + slots[row]) * HD + c % HD] = static_cast<T>(y);
        }"""
# a decode step's q/k/v rows [B, N] (a matmul's output), each thread one feature of one
# row through ROPE_STORE (the attention kernel takes q, which orders it after the writes).
# It replaces the fused blocks' MLX ops between a step of more rows' q/k/v matmul and the
# attention: RoPE, the pool write and the four slices and two reshapes around them.
_ROPE_WRITE_SOURCE = """
    const int i = blockIdx.x * blockDim.x + threadIdx.x;  // over B * N
    const int N = qkv_shape[1];
    if (i < qkv_shape[0] * N) {
        const int row = i / N, f = i % N;
        float y = static_cast<float>(qkv[i]);
""" + ROPE_STORE.replace(
    "PAIR", "static_cast<float>(qkv[i - d + (TRAD ? (d ^ 1) : (second ? d - HD / 2 : d + HD / 2))])") + """
    }
"""


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
                         _ROPE_WRITE_SOURCE)
    constants = {"HD": head_dim, "QN": q_features, "KN": (N - q_features) // 2, "TRAD": int(traditional), "POOL": 1}
    (q,) = kernel(inputs=[y, pos.astype(mx.int32), freq_pi, k_pool, v_pool, slots.astype(mx.int32)],
                  template=[("T", y.dtype), *constants.items()],
                  grid=(-(-B * N // WRITE_THREADS) * WRITE_THREADS, 1, 1), threadgroup=(WRITE_THREADS, 1, 1),
                  output_shapes=[(B, heads, 1, head_dim)], output_dtypes=[y.dtype])
    return q


def decode(q: mx.array, pool_k: mx.array, pool_v: mx.array, slots: mx.array, lengths: mx.array,
           scale: float, use_kernel: bool, after: mx.array | None = None) -> mx.array:
    """Attention of one query per row over positions [0, lengths[b]) of its slot table;
    `after`: an array the kernel takes and does not read (write's), so it runs after the
    kernel that made it."""
    B, H, T, D = q.shape
    Hk = pool_k.shape[0]
    if not use_kernel or T != 1 or not supports(D, H, Hk) or pool_k.dtype != q.dtype:
        if after is not None:
            raise ValueError("the pool written in place is read back by the attention kernel only (`after`)")
        return reference(q, pool_k, pool_v, slots, lengths, scale)
    P = partitions(B, Hk, slots.shape[1]) if uses_group_kernel(H, Hk, D) else 1
    name, source, constants, blocks = launch(B, H, Hk, D, P)
    # `after` only where given: the kernel built as ever otherwise (the signature is in its name)
    names = ("q", "k_pool", "v_pool", "slots", "lengths") + (("after",) if after is not None else ())
    kernel = cuda_kernel(f"unikern_paged_decode_{name}", names, source)
    (out,) = kernel(
        inputs=[q, pool_k, pool_v, slots.astype(mx.int32), lengths.astype(mx.int32),
                *([after] if after is not None else [])],
        template=[("T", q.dtype), *constants.items(), ("SCALE", float_bits(scale))],
        grid=(blocks * constants["NW"] * 32, 1, 1),
        threadgroup=(constants["NW"] * 32, 1, 1),
        output_shapes=[(B, H, 1, D) if P == 1 else (blocks, H // Hk, D + 2)],
        output_dtypes=[q.dtype if P == 1 else mx.float32],
    )
    if P == 1:
        return out
    source, constants, blocks, threads = merge_launch(B, H, Hk, D)
    merge = cuda_kernel("unikern_paged_decode_merge", ("parts",), source)
    (out,) = merge(inputs=[out], template=[("T", q.dtype), *constants.items()], grid=(blocks * threads, 1, 1),
                   threadgroup=(threads, 1, 1), output_shapes=[(B, H, 1, D)], output_dtypes=[q.dtype])
    return out
