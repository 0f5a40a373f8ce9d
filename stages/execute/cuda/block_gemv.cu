// The GEMV of a fused decoder block's steps (block_gemv.py): x [rows, K] (rows <= ROWS)
// against w [N, K]: out [rows, NOUT] (NOUT = N, or N / 2 for SWIGLU). NORM: x goes through
// the RMS norm (norm_w, eps) first. BIAS: w's bias. MODE: the epilogue (0 PLAIN, 1
// RESIDUAL: + res [rows, NOUT], 2 ROPE: the first ROPE_PAIRS pairs rotated by pi * pos
// [rows] * freq_pi [HD / 2], and the features in three outputs: out [rows, QN] (q), out_k
// and out_v [rows, (N - QN) / 2], so each is contiguous, or with POOL k and v written in
// place into k_pool and v_pool [kv heads, slots, HD] at each row's slot (slots [rows])
// instead of out_k and out_v; 3 SWIGLU: silu(gate) * up, gate = features [0, N / 2), up =
// [N / 2, N)). A pair's K is split over SPLIT warps of the block, whose sums meet in shared
// memory. Each warp issues its first pass' weight loads first; with NORM it then sums the
// squares of the whole row itself (the row is a few KB, read from L2 by every warp) while
// they are in flight, and normalizes each 16 bytes of x as it multiplies them: no
// block-wide barrier before the multiply. SSI: each row's sum of squares handed in (ss)
// instead; SSO: each row's sum of squares of this kernel's outputs handed out (out_ss),
// added by the last block done (its count in `counter`) in a fixed order.

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
