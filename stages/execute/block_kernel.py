"""A decoder block's one-row decode step as one CUDA kernel (execute.block_kernel).

At one stream the host paces a token, not the GPU: a 1B token on an H200 ran 99 kernels,
5 per block (blocks.py), and MLX spent 0.89-1.56 ms encoding them plus 0.32-0.53 ms
replaying the traced step, against 0.97 ms of GPU time; llama.cpp's token took 1.2 ms
(tools/results/gpu/H200-issue17.md, session 20). Here the block's five steps run in one
kernel whose phases meet at grid-wide barriers:

  0. RMS norm -> q/k/v GEMV -> RoPE on q and k; k and v into the pool at the row's slot
  1. the decode attention over the row's slot table (paged_attention's group kernel:
     one block per KV head, or with ATTN_SPLIT several, merged by the last done)
  2. output GEMV -> + residual                 -> h
  3. RMS norm -> gate/up GEMV -> SwiGLU         -> a
  4. down GEMV -> + residual                    -> the block's output

A grid of one block per SM (grid_blocks(), so all are resident at once: a
barrier's waiting blocks cannot hold back one not yet started) walks each phase's
output pairs in turn; a phase's blocks stage its input row in shared memory (normalized,
the row's sum of squares summed by the block itself), and each warp (or SPLIT warps) gives
one output pair as block_gemv's kernel does, rounding as MLX's ops round. The barrier is a
count in device memory: the block's first thread arrives with a fence and one atomic add
(block 0 adds 2^31 minus the other blocks, the others 1, so a full round flips the
count's top bit: FLIP_BARRIER; or a count and a generation, the last to arrive resetting
the one and advancing the other) and spins until the round is done (at most SPIN_LIMIT
polls, then it goes on and marks `bar[2]`, so a grid that could not all be resident
gives wrong numbers, which the tests see, instead of a hung GPU). The kernel's
intermediate rows are outputs of their own (q, the attention, h, a, the split
attention's partials): written in one phase, read in the next, never read before they
are written, so no block can hold a stale copy in its cache.

Phases FIRST..LAST run in one launch; the tests' emulation (tests/cuda_emulation.py),
which runs blocks one after another, runs one phase per launch with the rows carried
over. One row, unquantized blocks (blocks.py's BlockPlan), a slot table the group kernel
takes whole (paged_attention.partitions 1; any with ATTN_SPLIT) and shared memory within
48 KB; other steps keep the five kernels.

Measured on an H200 (1B shape, one row, tools/results/gpu/session21): a token 34 kernels
instead of 99, the runner's token 1.08-1.15 ms against 1.33-1.34 (host: the traced step's
replay 0.11-0.19 ms and mx.async_eval 0.38-0.48, against 0.39 and 0.93), the same 64
tokens; the 16 block kernels take 948 us of GPU time with UNROLL 4 (59 us a block for
its 122 MB of weights, 2.1 TB/s), 981 with 2, against 0.96-0.99 ms for the whole token
before. The engine at one request: 769 against 455 tok/s (one-process A/B, 6 of 6).
The phases timed from the GPU's clock (TIMES; tools/probe_block_phases.py, session 23):
of a 57.7 us block, gate/up 20.4 us (3.3 TB/s), down 13.3, q/k/v 10.8, the attention
7.5, o 5.7, each barrier 1.7-2.0. Session 24: the input rows staged in 16-byte chunks
and the one-atomic barrier, 47.1 us (tools/results/gpu/session24/c-bench)."""

from __future__ import annotations

import mlx.core as mx

from unikern.platform import cuda_sm_count
from unikern.platform.kernel_cache import cuda_kernel, float_bits, off_small_pool, placeholder
from unikern.stages.execute import paged_attention
from unikern.stages.execute.block_gemv import _HEADER, ITEMSIZE

# the GPU's nanosecond clock (its low 32 bits), for TIMES
_CLOCK_HEADER = _HEADER + """
__device__ inline unsigned unikern_clock() {
    unsigned long long t;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
    return (unsigned)t;
}
"""

# blocks of the grid: one per SM of the device (platform.cuda_sm_count; 132 on an H100 or
# H200), so all are resident at once (a block's registers and shared memory fit one SM of
# sm_80 and later); None: ask the driver, and where it cannot say the kernel is not used
GRID_BLOCKS: int | None = None
WARPS = 16  # per block (the attention phase's warps too: FEW_BLOCKS_WARPS)
UNROLL = 4  # 16-byte chunks per lane in flight per weight row (2: 981 against 948 us a 1B token)
MIN_CHUNKS = 32  # of a weight row per warp at least (one per lane) when a pair is split
# warps per output pair of the four GEMV phases (q/k/v, o, gate/up, down) forced (tests,
# probes); None: split_for's choice
SPLITS: tuple[int, int, int, int] | None = None
SPIN_LIMIT = 1 << 24  # polls of the barrier's generation before a block gives up on it
SPIN_SLEEP_NS = 32  # a waiting block's pause between polls (0: none)
# the barrier as one atomic a block (1): block 0 adds 2^31 - (blocks - 1), the others 1, so
# a round's sum flips the count's top bit and leaves its low bits as they were; each block
# waits for the flip (cooperative groups' grid sync does the same). 0: the count and a
# generation, the last to arrive resetting the one and advancing the other (two more
# atomics on the barrier's path). On an H200, 1B block, 16 chained: the kernel 46.0 us
# against 47.9, and 47.1 against 49.5 in another machine start
# (tools/results/gpu/session24/{b-stage,c-bench}/probe-phases.log)
FLIP_BARRIER = 1
SHARED_BYTES = 48 << 10  # static shared memory a kernel may declare
PHASES = 5
# the attention phase split over several blocks per KV head, ATTN_MIN_POSITIONS each at least
# (1), instead of one block per KV head while the others wait at the barrier (0). A 1B
# token on an H200, one row at 64-128 positions: GPU 1.025 ms against 1.046, 1.070 ms per
# step against 1.097-1.103 (tools/results/gpu/session22/a-split); it also takes tables of
# 512 positions and more, which one block per KV head does not
ATTN_SPLIT = 1
ATTN_MIN_POSITIONS = 16
# each warp's first weight loads of a phase issued before the barrier (or the norm) the
# phase waits on (1), so each phase's start does not wait a full memory latency: measured
# no faster (GPU 1.048 ms a 1B token against 1.046; with the split 1.039 against 1.025).
# Only where the block's threads' registers fit an SM's 65,536: with it a thread takes
# these many (NVRTC, sm_90), by itemsize (float32: 16 warps do not fit)
PRELOAD = 0
PRELOAD_REGISTERS = {2: 127, 4: 136}
# each block's clock (the GPU's globaltimer, ns, its low 32 bits) in the output `times`:
# at its start, then per phase once its input row is staged, as its work ends and as it
# leaves the barrier after it (tools/probe_block_phases.py reads them); off in the engine
TIMES = 0

# the attention phase: paged_attention's group kernel for one row, its blocks walked by the
# grid ("vb"): one per KV head writing `att`, or (ATTN_SPLIT, `nparts` > 1) each KV head's
# positions split over nparts blocks writing their partial softmaxes to `parts`, the last
# of a KV head's blocks to finish (its counter in `bar`) merging them into `att`, as
# paged_attention's split and merge kernels do
def _without_last_brace(text: str) -> str:
    head, _, tail = text.rpartition("}")
    assert not tail.strip(), "the group kernel's endings close its loop over the heads"
    return head


def _edited(text: str, *edits: tuple[str, str]) -> str:
    """paged_attention's kernel text with each (old, new) replaced, every old present."""
    for old, new in edits:
        assert old in text, f"paged_attention's kernel text no longer holds {old!r}"
        text = text.replace(old, new)
    return text


_ATTENTION = ("for (int vb = blockIdx.x; vb < HK * nparts; vb += gridDim.x) {\n"
              + _edited(paged_attention._GROUP_SOURCE, ("blockIdx.x", "vb"), ("gridDim.x", "(HK * nparts)"),
                        ("q[row + e]", "qs[row + e]"))
              + "        if (nparts == 1) {\n"
              + _without_last_brace(_edited(paged_attention._GROUP_OUT, ("out[row + e]", "att[row + e]")))
              + "        } else {\n"
              + _without_last_brace(_edited(paged_attention._GROUP_PARTS, ("out[at", "parts[at")))
              + """        }
    }
    if (nparts > 1) {  // the last of the KV head's blocks merges its partials (the merge kernel's text)
        __shared__ int last_part;
        __syncthreads();
        if (threadIdx.x == 0) {
            __threadfence();
            last_part = atomicAdd(const_cast<unsigned*>(bar) + 3 + kvh, 1u) == (unsigned)nparts - 1;
        }
        __syncthreads();
        if (last_part) {
            __threadfence();
            for (int g = warp; g < G; g += NW) {
""" + _edited(paged_attention._MERGE_SOURCE, ("const int bh = blockIdx.x;", "const int bh = kvh * G + g;"),
              ("const int lane = threadIdx.x;", "const int lane = threadIdx.x % 32;"),
              ("const int P = parts_shape[0] / (gridDim.x / H * HK);", "const int P = nparts;"), ("out[", "att[")) + """
            }
            if (threadIdx.x == 0) atomicExch(const_cast<unsigned*>(bar) + 3 + kvh, 0u);  // ready for the next launch
        }
    }
    __syncthreads();
}
""")


_SOURCE = """
    constexpr int PACK = 16 / sizeof(T);
    const int warp = threadIdx.x / 32;
    const int lane = threadIdx.x % 32;
    __shared__ __align__(16) T xs[XMAX];  // the phase's input row, normalized where it is
    __shared__ float red[WARPS];
    __shared__ float sums[WARPS][2];

    // every block at the barrier before any goes on (see the module's notes)
    auto grid_sync = [&]() {
        __syncthreads();
        if (FLIP && threadIdx.x == 0) {  // one atomic a block: the sum of a round flips the top bit
            unsigned* count = const_cast<unsigned*>(bar);
            volatile unsigned* arrived = count;
            __threadfence();
            const unsigned before = atomicAdd(count, blockIdx.x == 0 ? 0x80000000u - (gridDim.x - 1) : 1u);
            int spins = 0;
            while (((before ^ *arrived) & 0x80000000u) == 0 && spins < SPIN_LIMIT) {
                if (SPIN_SLEEP) __nanosleep(SPIN_SLEEP);
                ++spins;
            }
            if (spins == SPIN_LIMIT) atomicExch(count + 2, 1u);
            __threadfence();
        } else if (threadIdx.x == 0) {
            unsigned* count = const_cast<unsigned*>(bar);
            volatile unsigned* gen = count + 1;
            const unsigned seen = *gen;
            __threadfence();
            if (atomicAdd(count, 1u) == gridDim.x - 1) {
                atomicExch(count, 0u);
                __threadfence();
                atomicAdd(count + 1, 1u);
            } else {
                int spins = 0;
                while (*gen == seen && spins < SPIN_LIMIT) {
                    if (SPIN_SLEEP) __nanosleep(SPIN_SLEEP);
                    ++spins;
                }
                if (spins == SPIN_LIMIT) atomicExch(count + 2, 1u);
            }
            __threadfence();
        }
        __syncthreads();
    };

    // K elements of `row` into xs: with `nw`, RMS-normalized as MLX's rms_norm rounds
    // (the normalized value rounded, times the weight, rounded). In 16-byte chunks (rows
    // and weights are 16-byte aligned, as MLX allocates them): at the 1B shape one or two
    // per thread, so staging waits on memory about once, where element by element it
    // waited 4-16 times (H200, session 24, each thread's chunks loaded at once in unrolled
    // loops: the 1B kernel 47.9 us against 55.7). The loops stay rolled: unrolled, the
    // kernel took 128-136 registers a thread instead of 96-108, and float32's 16 warps no
    // longer fit an SM
    auto stage = [&](const T* row, int K, const T* nw, float eps) {
        const int C = K / PACK;
        const uint4* rv = reinterpret_cast<const uint4*>(row);
        uint4* xv = reinterpret_cast<uint4*>(xs);
        if (nw == nullptr) {
            for (int c = threadIdx.x; c < C; c += blockDim.x) xv[c] = rv[c];
        } else {
            const uint4* wv = reinterpret_cast<const uint4*>(nw);
            float s = 0.f;
            for (int c = threadIdx.x; c < C; c += blockDim.x) {
                float v[PACK];
                unikern_unpack<T>(rv[c], v);
                #pragma unroll
                for (int e = 0; e < PACK; ++e) s += v[e] * v[e];
            }
            for (int o = 16; o > 0; o >>= 1) s += __shfl_xor_sync(0xffffffff, s, o);
            if (lane == 0) red[warp] = s;
            __syncthreads();
            float t = 0.f;
            for (int w = 0; w < WARPS; ++w) t += red[w];
            const float inv = rsqrtf(t / K + eps);
            for (int c = threadIdx.x; c < C; c += blockDim.x) {
                float v[PACK], g[PACK];
                unikern_unpack<T>(rv[c], v);
                unikern_unpack<T>(wv[c], g);
                T* dst = xs + c * PACK;
                #pragma unroll
                for (int e = 0; e < PACK; ++e)
                    dst[e] = static_cast<T>(g[e] * static_cast<float>(static_cast<T>(v[e] * inv)));
            }
        }
        __syncthreads();
    };

    // q/k/v's pair p: the two halves of a RoPE rotation for q and k, neighbours for v
    auto qkv_rows = [&](int p, int& f0, int& f1) {
        f0 = 2 * p;
        f1 = 2 * p + 1;
        if (p < (QN + KN) / 2) {
            const int head = p / (D / 2), i = p % (D / 2);
            f0 = TRAD ? head * D + 2 * i : head * D + i;
            f1 = TRAD ? f0 + 1 : f0 + D / 2;
        }
    };

    // PRELOAD: a phase's first pass of weight loads for each warp's first pair, issued
    // before the barrier (or the norm) that the phase waits on, used by its first dot_pair
    uint4 wa[UW], wb[UW];  // a pass of loads of the two rows (kept here: the preload's too)
    bool preloaded = false;
    auto preload = [&](const T* w, int K, int split, int f0, int f1, bool live) {
        const int C = K / PACK;
        const int lo = (warp % split) * ((C + split - 1) / split);
        const int hi = min(C, lo + (C + split - 1) / split);
        #pragma unroll
        for (int u = 0; u < UW; ++u) {
            const int c = lo + u * 32 + lane;
            if (live && c < hi) {
                wa[u] = reinterpret_cast<const uint4*>(w + (size_t)f0 * K)[c];
                wb[u] = reinterpret_cast<const uint4*>(w + (size_t)f1 * K)[c];
            }
        }
        preloaded = true;
    };
    auto preload_phase = [&](int phase) {  // the rows each warp's first pair of `phase` reads
        if (phase == 0) {
            const int p = blockIdx.x * (WARPS / SA) + warp / SA;
            int f0, f1;
            qkv_rows(p, f0, f1);
            preload(w_qkv, WIDTH, SA, f0, f1, p < NQKV / 2);
        } else if (phase == 2) {
            const int p = blockIdx.x * (WARPS / SC) + warp / SC;
            preload(w_o, QN, SC, 2 * p, 2 * p + 1, p < WIDTH / 2);
        } else if (phase == 3) {
            const int p = blockIdx.x * (WARPS / SD) + warp / SD;
            preload(w_gu, WIDTH, SD, p, p + INTER, p < INTER);
        } else if (phase == 4) {
            const int p = blockIdx.x * (WARPS / SE) + warp / SE;
            preload(w_down, INTER, SE, 2 * p, 2 * p + 1, p < WIDTH / 2);
        }
    };

    // rows f0 and f1 of w [., K] against xs, over `split` warps of the block: the sums, in
    // the pair's first warp (every thread of the block calls it: it may wait on the block)
    auto dot_pair = [&](const T* w, int K, int split, int f0, int f1, bool live, float& s0, float& s1) {
        const int C = K / PACK;
        const int per = (C + split - 1) / split;
        const int lo = (warp % split) * per;
        const int hi = min(C, lo + per);
        const uint4* w0 = reinterpret_cast<const uint4*>(w + (size_t)f0 * K);
        const uint4* w1 = reinterpret_cast<const uint4*>(w + (size_t)f1 * K);
        const uint4* xv = reinterpret_cast<const uint4*>(xs);
        float a0 = 0.f, a1 = 0.f;
        for (int c0 = lo; live && c0 < hi; c0 += 32 * UW) {
            if (c0 != lo || !preloaded) {  // (preloaded: the same rows, the warp's first pair of the phase)
                #pragma unroll
                for (int u = 0; u < UW; ++u) {
                    const int c = c0 + u * 32 + lane;
                    if (c < hi) {
                        wa[u] = w0[c];
                        wb[u] = w1[c];
                    }
                }
            }
            #pragma unroll
            for (int u = 0; u < UW; ++u) {
                const int c = c0 + u * 32 + lane;
                if (c < hi) {
                    float fa[PACK], fb[PACK], xe[PACK];
                    unikern_unpack<T>(wa[u], fa);
                    unikern_unpack<T>(wb[u], fb);
                    unikern_unpack<T>(xv[c], xe);
                    #pragma unroll
                    for (int e = 0; e < PACK; ++e) {
                        a0 += xe[e] * fa[e];
                        a1 += xe[e] * fb[e];
                    }
                }
            }
        }
        for (int o = 16; o > 0; o >>= 1) {
            a0 += __shfl_xor_sync(0xffffffff, a0, o);
            a1 += __shfl_xor_sync(0xffffffff, a1, o);
        }
        if (split > 1) {  // the pair's other warps hand their sums to its first
            if (lane == 0) {
                sums[warp][0] = a0;
                sums[warp][1] = a1;
            }
            __syncthreads();
            if (warp % split == 0)
                for (int q = 1; q < split; ++q) {
                    a0 += sums[warp + q][0];
                    a1 += sums[warp + q][1];
                }
            __syncthreads();
        }
        s0 = a0;
        s1 = a1;
        preloaded = false;
    };

    // every pair p of a phase: blocks in turn, WARPS / split pairs each (block-uniform)
    #define UNIKERN_PAIRS(NPAIRS, SPLIT_)                                                   \\
        for (int first_p = blockIdx.x * (WARPS / SPLIT_); first_p < NPAIRS;                 \\
             first_p += gridDim.x * (WARPS / SPLIT_))
    #define UNIKERN_PAIR(SPLIT_) const int p = first_p + warp / SPLIT_;                     \\
        const bool live = p < NPAIRS_NOW;                                                   \\
        const bool writer = live && lane == 0 && warp % SPLIT_ == 0

    // dst = res + xs @ w.T (w [WIDTH, K]): the o and down phases, pairs of neighbours
    auto residual_gemv = [&](const T* w, int K, int split, const T* res, T* dst) {
        constexpr int NPAIRS_NOW = WIDTH / 2;
        UNIKERN_PAIRS(NPAIRS_NOW, split) {
            UNIKERN_PAIR(split);
            float s0, s1;
            dot_pair(w, K, split, live ? 2 * p : 0, live ? 2 * p + 1 : 0, live, s0, s1);
            if (writer) {
                dst[2 * p] = static_cast<T>(static_cast<float>(static_cast<T>(s0)) + static_cast<float>(res[2 * p]));
                dst[2 * p + 1] = static_cast<T>(static_cast<float>(static_cast<T>(s1)) + static_cast<float>(res[2 * p + 1]));
            }
        }
    };

    auto stamp = [&](int k) {  // TIMES: this block's clock, stamp k of 1 + 3 * PHASES
        if (TIMES && threadIdx.x == 0) times[blockIdx.x * (1 + 3 * PHASES) + k] = unikern_clock();
    };
    stamp(0);
    if (PRELOAD) preload_phase(FIRST);  // (phase 1, the attention, reads no weights)
    for (int phase = FIRST; phase <= LAST; ++phase) {
        if (phase == 0) {  // q/k/v with the input norm and RoPE; k and v into the pool
            stage(x, WIDTH, n1, __int_as_float(EPS1));
            stamp(1 + 3 * phase);
            constexpr int NPAIRS_NOW = NQKV / 2;
            UNIKERN_PAIRS(NPAIRS_NOW, SA) {
                UNIKERN_PAIR(SA);
                const bool rope = p < (QN + KN) / 2;
                int f0, f1;
                qkv_rows(p, f0, f1);
                float s0, s1;
                dot_pair(w_qkv, WIDTH, SA, live ? f0 : 0, live ? f1 : 0, live, s0, s1);
                if (writer) {
                    if (BIAS) {
                        s0 += static_cast<float>(b_qkv[f0]);
                        s1 += static_cast<float>(b_qkv[f1]);
                    }
                    float y0 = static_cast<float>(static_cast<T>(s0));  // the matmul's output, rounded
                    float y1 = static_cast<float>(static_cast<T>(s1));
                    if (rope) {
                        float sn, cs;  // the angle in units of pi: an exact range reduction
                        sincospif(static_cast<float>(pos[0]) * freq_pi[p % (D / 2)], &sn, &cs);
                        const float r0 = y0 * cs - y1 * sn, r1 = y1 * cs + y0 * sn;
                        y0 = r0;
                        y1 = r1;
                    }
                    if (f0 < QN) {
                        qs[f0] = static_cast<T>(y0);
                        qs[f1] = static_cast<T>(y1);
                    } else {  // kv head c / D of k or v, at the row's slot
                        const bool is_v = f0 >= QN + KN;
                        const int c0 = f0 - (is_v ? QN + KN : QN), c1 = f1 - (is_v ? QN + KN : QN);
                        T* pool = is_v ? const_cast<T*>(v_pool) : const_cast<T*>(k_pool);
                        const size_t S = k_pool_shape[1];
                        pool[((size_t)(c0 / D) * S + wslot[0]) * D + c0 % D] = static_cast<T>(y0);
                        pool[((size_t)(c1 / D) * S + wslot[0]) * D + c1 % D] = static_cast<T>(y1);
                    }
                }
            }
        } else if (phase == 1) {  // the attention over the row's table, k and v of phase 0 in it
            stamp(1 + 3 * phase);  // (nothing to stage)
            const int len = min(lengths[0], slots_shape[1]);
            const int nparts = ATTN_SPLIT ? max(1, min((int)gridDim.x / HK, (len + ATTN_MIN - 1) / ATTN_MIN)) : 1;
""" + _ATTENTION + """
        } else if (phase == 2) {  // h = x + att @ w_o.T
            stage(att, QN, nullptr, 0.f);
            stamp(1 + 3 * phase);
            residual_gemv(w_o, QN, SC, x, h);
        } else if (phase == 3) {  // a = swiglu(gate, up) of norm(h) @ w_gu.T, rounded as mlx-lm's
            stage(h, WIDTH, n2, __int_as_float(EPS2));
            stamp(1 + 3 * phase);
            constexpr int NPAIRS_NOW = INTER;
            UNIKERN_PAIRS(NPAIRS_NOW, SD) {
                UNIKERN_PAIR(SD);
                float s0, s1;
                dot_pair(w_gu, WIDTH, SD, live ? p : 0, live ? p + INTER : 0, live, s0, s1);
                if (writer) {
                    const float g = static_cast<float>(static_cast<T>(s0));
                    const float u = static_cast<float>(static_cast<T>(s1));
                    const float sig = static_cast<float>(static_cast<T>(1.f / (1.f + expf(-g))));
                    const float act = static_cast<float>(static_cast<T>(g * sig));
                    a[p] = static_cast<T>(act * u);
                }
            }
        } else {  // out = h + a @ w_down.T
            stage(a, INTER, nullptr, 0.f);
            stamp(1 + 3 * phase);
            residual_gemv(w_down, INTER, SE, h, out);
        }
        stamp(2 + 3 * phase);
        if (phase < LAST) {
            if (PRELOAD) preload_phase(phase + 1);
            grid_sync();
        }
        stamp(3 + 3 * phase);
    }
    #undef UNIKERN_PAIRS
    #undef UNIKERN_PAIR
"""
INPUTS = ("x", "w_qkv", "b_qkv", "n1", "w_o", "n2", "w_gu", "w_down", "pos", "freq_pi", "k_pool", "v_pool",
          "wslot", "slots", "lengths", "bar")
OUTPUTS = ("out", "qs", "att", "h", "a", "parts", "times")


def split_for(K: int, pairs: int, itemsize: int, grid: int, warps: int) -> int:
    """Warps per output pair for a phase of `pairs` pairs over rows of K: the split whose
    warps wait on memory the fewest times in a row (the phase's rounds of the grid times
    the passes of UNROLL loads per lane a warp's share of a row takes), then the one that
    leaves the fewest blocks idle (ties: the smaller), each warp keeping at least
    MIN_CHUNKS of its row's 16-byte chunks. A 1B block on an H200 (session 23,
    c-phases): q/k/v over 4 warps a pair took 3 rounds of one pass, its work done 6.8-9.0
    us into the kernel; over 1 warp (1 round of 2 passes) 3.1-7.6 us, the kernel 56.1 us
    against 57.7."""
    chunks, best, best_key = K * itemsize // 16, 1, None
    split = 1
    while split <= warps:
        if split == 1 or chunks // split >= MIN_CHUNKS:
            turns = -(-pairs // (warps // split))  # block turns
            rounds = -(-turns // grid)
            per_warp = -(-chunks // split)  # of a row's chunks
            passes = rounds * -(-per_warp // (32 * UNROLL))
            key = (passes, rounds * grid - turns)
            if best_key is None or key < best_key:
                best, best_key = split, key
        split *= 2
    return best


def splits(width: int, inter: int, qn: int, kn: int, itemsize: int, grid: int, warps: int) -> tuple[int, ...]:
    """Warps per pair of the q/k/v, o, gate/up and down phases (SPLITS where forced)."""
    if SPLITS is not None:
        return SPLITS
    return (split_for(width, (qn + 2 * kn) // 2, itemsize, grid, warps), split_for(qn, width // 2, itemsize, grid, warps),
            split_for(width, inter, itemsize, grid, warps), split_for(inter, width // 2, itemsize, grid, warps))


def shared_bytes(width: int, inter: int, heads: int, kv_heads: int, head_dim: int, itemsize: int) -> int:
    """The kernel's static shared memory: the staged row, the attention's per-warp partials."""
    group, warps = heads // kv_heads, WARPS
    return (max(width, inter, heads * head_dim) * itemsize + warps * group * (head_dim + 2) * 4
            + warps * 12)


def grid_blocks() -> int | None:
    """The grid's blocks: GRID_BLOCKS, or the device's SMs where it is None."""
    return GRID_BLOCKS or cuda_sm_count()


def fits(width: int, inter: int, heads: int, kv_heads: int, head_dim: int, dtype: mx.Dtype, table: int) -> bool:
    """Whether a one-row step of these shapes takes the kernel: 16-byte loads along every
    weight row, head sizes the attention takes, a slot table `table` wide that one block
    per KV head takes whole (paged_attention's kernel would not split it) or any with
    ATTN_SPLIT, the shared memory within SHARED_BYTES, a grid size known (grid_blocks)."""
    if dtype not in ITEMSIZE or not grid_blocks():
        return False
    pack = 16 // ITEMSIZE[dtype]
    return (width % pack == 0 and inter % pack == 0 and (heads * head_dim) % pack == 0 and width % 2 == 0
            and paged_attention.supports(head_dim, heads, kv_heads)
            and (ATTN_SPLIT or paged_attention.partitions(1, kv_heads, table) == 1)
            and shared_bytes(width, inter, heads, kv_heads, head_dim, ITEMSIZE[dtype]) <= SHARED_BYTES)


def barrier(kv_heads: int) -> mx.array:
    """A zero barrier for the kernel (count, generation, the spin-out mark, then a
    counter per KV head for the split attention's merge), in device memory
    (kernel_cache.SMALL_POOL_BYTES)."""
    return mx.zeros((off_small_pool(3 + kv_heads, 4),), dtype=mx.uint32)


def block_step(x: mx.array, w_qkv: mx.array, b_qkv: mx.array | None, norm1: tuple[mx.array, float], w_o: mx.array,
               norm2: tuple[mx.array, float], w_gu: mx.array, w_down: mx.array, pos: mx.array, freq_pi: mx.array,
               heads: int, kv_heads: int, head_dim: int, traditional: bool, scale: float,
               pool: tuple[mx.array, mx.array, mx.array], slots: mx.array, lengths: mx.array, bar: mx.array,
               phases: tuple[int, int] = (0, PHASES - 1)) -> list[mx.array]:
    """One row x [1, ..., width] through a decoder block (see the module's notes): its
    outputs [out (x's shape), q, the attention, h, a]. w_qkv [(heads + 2 kv_heads) *
    head_dim, width] with its bias or None, norm1 and norm2 (weight, eps) before the q/k/v
    and gate/up GEMVs, w_gu [2 * inter, width] (gate's rows, then up's), w_down [width,
    inter]; pos: the row's position (int32 [1]); freq_pi: RoPE's inverse frequencies over
    pi; pool: the layer's pool arrays [kv heads, slots, head_dim] and the row's slot (k and
    v go there in place); slots [1, L] and lengths [1]: the row's slot table and length
    for the attention; bar: `barrier(kv_heads)`, kept for the call site; `phases`: the first and
    last phase to run. The grid: grid_blocks() blocks of WARPS warps."""
    width = w_qkv.shape[1]
    inter = w_down.shape[1]
    if x.size != width or w_gu.shape != (2 * inter, width) or w_o.shape != (width, heads * head_dim):
        raise ValueError(f"the block kernel takes one row of {width} and a block's weights: x {x.shape}, "
                         f"o {w_o.shape}, gate/up {w_gu.shape}, down {w_down.shape}")
    k_pool, v_pool, wslot = pool
    itemsize, grid, warps = ITEMSIZE[x.dtype], grid_blocks(), WARPS
    if not grid:
        raise RuntimeError("the block kernel's grid is one block per SM, and the CUDA driver did not say how many "
                           "SMs the device has: set block_kernel.GRID_BLOCKS, or execute.block_kernel: never")
    qn, kn = heads * head_dim, kv_heads * head_dim
    template = [("T", x.dtype), ("WIDTH", width), ("INTER", inter), ("QN", qn), ("KN", kn), ("NQKV", qn + 2 * kn),
                ("XMAX", max(width, inter, qn)), ("WARPS", warps), ("UW", UNROLL),
                *zip(("SA", "SC", "SD", "SE"), splits(width, inter, qn, kn, itemsize, grid, warps), strict=True),
                ("BIAS", int(b_qkv is not None)), ("TRAD", int(traditional)),
                ("EPS1", float_bits(norm1[1])), ("EPS2", float_bits(norm2[1])),
                # the attention phase (paged_attention's group kernel)
                ("D", head_dim), ("E", head_dim // 32), ("H", heads), ("HK", kv_heads), ("G", heads // kv_heads),
                ("NW", warps), ("U", paged_attention.POSITIONS_IN_FLIGHT), ("SCALE", float_bits(scale)),
                ("FIRST", phases[0]), ("LAST", phases[1]), ("SPIN_LIMIT", SPIN_LIMIT), ("SPIN_SLEEP", SPIN_SLEEP_NS), ("FLIP", FLIP_BARRIER),
                ("ATTN_SPLIT", ATTN_SPLIT), ("ATTN_MIN", ATTN_MIN_POSITIONS), ("PRELOAD", int(PRELOAD and PRELOAD_REGISTERS[itemsize] * warps * 32 <= 65536)),
                ("PHASES", PHASES), ("TIMES", TIMES)]
    inputs = [x, w_qkv, b_qkv if b_qkv is not None else placeholder(x.dtype), norm1[0], w_o, norm2[0], w_gu, w_down,
              pos, freq_pi, k_pool, v_pool, wslot, slots, lengths, bar]
    kernel = cuda_kernel("unikern_block_step", INPUTS, _SOURCE, _CLOCK_HEADER, OUTPUTS)
    return kernel(inputs=inputs, template=template, grid=(grid * warps * 32, 1, 1), threadgroup=(warps * 32, 1, 1),
                  output_shapes=[x.shape, (1, heads, 1, head_dim), (1, heads, 1, head_dim), (1, width), (1, inter),
                                 (max(1, grid // kv_heads) * heads * (head_dim + 2) if ATTN_SPLIT else 1,),
                                 (grid * (1 + 3 * PHASES) if TIMES else 1,)],
                  output_dtypes=[x.dtype] * 5 + [mx.float32, mx.uint32])
