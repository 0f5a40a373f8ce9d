// A decoder block's one-row decode step as one kernel (block_kernel.py has the phases, the
// grid and the barrier explained): phases FIRST..LAST of norm -> q/k/v GEMV -> RoPE and the
// pool write; the attention; output GEMV + residual; norm -> gate/up GEMV -> SwiGLU; down
// GEMV + residual, meeting at grid-wide barriers (grid_sync). The attention phase is
// paged_group.cu's text with a few names renamed, and its ends (marker lines GROUP,
// GROUP_OUT, GROUP_PARTS, MERGE: paged_group_out.cu, paged_group_parts.cu and
// paged_merge.cu's text), filled in by block_kernel.py.

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
    // waited 4-16 times (on an H200, tools/probe/probe_block_phases.py, each thread's chunks
    // loaded at once in unrolled loops: the 1B kernel 47.9 us against 55.7). The loops
    // stay rolled: unrolled, the kernel took 128-136 registers a thread instead of
    // 96-108, and float32's 16 warps no longer fit an SM
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
    #define UNIKERN_PAIRS(NPAIRS, SPLIT_)                                                   \
        for (int first_p = blockIdx.x * (WARPS / SPLIT_); first_p < NPAIRS;                 \
             first_p += gridDim.x * (WARPS / SPLIT_))
    #define UNIKERN_PAIR(SPLIT_) const int p = first_p + warp / SPLIT_;                     \
        const bool live = p < NPAIRS_NOW;                                                   \
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
for (int vb = blockIdx.x; vb < HK * nparts; vb += gridDim.x) {
//@ GROUP
        if (nparts == 1) {
//@ GROUP_OUT
        } else {
//@ GROUP_PARTS
        }
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
//@ MERGE

            }
            if (threadIdx.x == 0) atomicExch(const_cast<unsigned*>(bar) + 3 + kvh, 0u);  // ready for the next launch
        }
    }
    __syncthreads();
}

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
