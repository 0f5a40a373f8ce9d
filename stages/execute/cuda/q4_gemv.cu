// A GEMV for 4-bit affine weights, for steps of few rows (q4_gemv.py). A block of GEMV_W
// warps computes GEMV_F consecutive output features for up to MT rows (a pass; more rows
// take more passes, whose blocks sit next to each other so the later ones find the weights
// in L2). Its threads stride together over the weights' 32-bit words (8 nibbles, inside
// one scale group): each dequantizes its word of every feature once into registers, then
// multiplies every row of x against them, so a row costs only its own FMAs; per-thread sums
// meet by warp shuffles, then across the warps in shared memory. MLX's affine layout:
// weight [N, K/8] uint32 (nibble i of a word is bits 4i..4i+3), scales and biases [N, K/GS];
// rows come from x's shape at run time. SUMS: each 8 weights' products summed as
// s * sum(x q) + b * sum(x) (MLX's Metal qmv's order), the nibbles made floats by their
// bits; else x times s * q + b. ROPE (the 4-bit q/k/v projection, w's rows q then k
// then v, QN and KN features): below QN + KN a block's F features are F / 2 rotation pairs
// of one head (i and i + HD/2, or 2i and 2i + 1 with TRAD), rotated for each row's position
// (pos; freq_pi: the inverse frequencies over pi) as MLX's RoPE rotates the rounded
// products; with POOL the rows' k and v go into the layer's pool arrays at their slots, in
// place, and `out` holds q alone, else out is [rows, N]. The marker line ROPE_EPILOGUE takes
// q4_gemv_rope.cu in the ROPE build, nothing in the others. SWIGLU (the gate/up projection,
// w's rows gate then up): a block's F features are F / 2 (gate, up) pairs, and out
// [rows, N / 2] is silu(gate) * up, rounded as MLX's ops. RES: + res.

    constexpr int F = GEMV_F;
    constexpr int WORDS = K / 8;
    constexpr int WPL = GEMV_WPL;  // packed words per weight load: 1 (4 bytes) or 4 (16)
    constexpr int PACK = 16 / sizeof(T);  // x elements per 16-byte load
    const int N = w_shape[0];
    const int M = x_shape[0];
    const int passes = (M + MT - 1) / MT;
    const int r0 = (blockIdx.x % passes) * MT;
    const int n0 = (blockIdx.x / passes) * F;
    if (n0 >= N) return;  // the whole block
    auto feature = [&](int j) -> int {  // the block's output feature j
        if (SWIGLU) return (j & 1) ? n0 / 2 + j / 2 + N / 2 : n0 / 2 + j / 2;
        if (!ROPE || n0 >= QN + KN) return n0 + j;
        const int p = n0 / 2 + j / 2, head = p / (HD / 2), i = p % (HD / 2);
        const int f0 = TRAD ? head * HD + 2 * i : head * HD + i;
        return (j & 1) ? (TRAD ? f0 + 1 : f0 + HD / 2) : f0;
    };
    float acc[MT][F];
    for (int r = 0; r < MT; ++r)
        for (int j = 0; j < F; ++j) acc[r][j] = 0.f;
    // the block's threads (GEMV_W warps) stride together, GEMV_U strides per pass of the
    // outer loop, unrolled: a thread's loads of a pass can be issued before its FMAs
    constexpr int STRIDE = GEMV_W * 32;
    for (int c0 = threadIdx.x; c0 < WORDS / WPL; c0 += STRIDE * GEMV_U) {
      #pragma unroll
      for (int u = 0; u < GEMV_U; ++u) {
        const int c = c0 + u * STRIDE;
        if ((WORDS / WPL) % (STRIDE * GEMV_U) && c >= WORDS / WPL) break;  // (whole passes: no test)
        const int g = (c * WPL * 8) / GS;  // 8 * WPL <= 32 weights: inside one scale group
        unsigned words[F][4];  // the first WPL used
        float s[F], b[F];
        #pragma unroll
        for (int j = 0; j < F; ++j) {  // every load of the unit first: more bytes in flight
            const int f = feature(j);
            const unsigned* wrow = w + (size_t)f * WORDS;
            if (WPL == 4) {
                const uint4 v = reinterpret_cast<const uint4*>(wrow)[c];
                words[j][0] = v.x; words[j][1] = v.y; words[j][2] = v.z; words[j][3] = v.w;
            } else {
                words[j][0] = wrow[c];
            }
            s[j] = static_cast<float>(scales[(size_t)f * (K / GS) + g]);
            b[j] = static_cast<float>(biases[(size_t)f * (K / GS) + g]);
        }
        #pragma unroll
        for (int q = 0; q < WPL; ++q) {
            const int word = c * WPL + q;  // 8 weights from k = 8 * word
            if (SUMS) {  // s * sum(x q) + b * sum(x) for these 8 weights (MLX's Metal qmv's order)
                float qf[F][8];
                #pragma unroll
                for (int j = 0; j < F; ++j) {
                    // nibble i exact as a float: its bits where that float's ulp is 1 (2^23,
                    // 2^19, ..., 2^7), the power of two taken off; no conversion instruction
                    const int lo = static_cast<int>(words[j][q]), hi = static_cast<int>(words[j][q] >> 12);
                    qf[j][0] = __int_as_float((lo & 0xF) | 0x4B000000) - 8388608.f;
                    qf[j][1] = __int_as_float((lo & 0xF0) | 0x49000000) - 524288.f;
                    qf[j][2] = __int_as_float((lo & 0xF00) | 0x47000000) - 32768.f;
                    qf[j][3] = __int_as_float((lo & 0xF000) | 0x45000000) - 2048.f;
                    qf[j][4] = __int_as_float((lo & 0xF0000) | 0x43000000) - 128.f;
                    qf[j][5] = __int_as_float((hi & 0xF00) | 0x47000000) - 32768.f;
                    qf[j][6] = __int_as_float((hi & 0xF000) | 0x45000000) - 2048.f;
                    qf[j][7] = __int_as_float((hi & 0xF0000) | 0x43000000) - 128.f;
                }
                #pragma unroll
                for (int r = 0; r < MT; ++r) {
                    if (r0 + r >= M) break;
                    const uint4* xr = reinterpret_cast<const uint4*>(x + (size_t)(r0 + r) * K + (size_t)word * 8);
                    float xv[8], xsum = 0.f;
                    #pragma unroll
                    for (int v = 0; v < 8 / PACK; ++v) {
                        const uint4 raw = xr[v];
                        const T* xs = reinterpret_cast<const T*>(&raw);
                        for (int i = 0; i < PACK; ++i) xv[v * PACK + i] = static_cast<float>(xs[i]);
                    }
                    for (int i = 0; i < 8; ++i) xsum += xv[i];
                    #pragma unroll
                    for (int j = 0; j < F; ++j) {
                        float dot = 0.f;
                        for (int i = 0; i < 8; ++i) dot += xv[i] * qf[j][i];
                        acc[r][j] += s[j] * dot + b[j] * xsum;
                    }
                }
                continue;
            }
            float wf[F][8];
            #pragma unroll
            for (int j = 0; j < F; ++j)
                for (int i = 0; i < 8; ++i) {
                    const unsigned nib = (words[j][q] >> (4 * i)) & 15u;
                    // MAGIC: the nibble as the low bits of the float 2^23 + nib, less 2^23 (an OR
                    // and an add, exact) instead of a conversion (an eighth of the FMAs' rate on sm_90)
                    const float qf = MAGIC ? __int_as_float(0x4B000000 | nib) - 8388608.f : static_cast<float>(nib);
                    wf[j][i] = s[j] * qf + b[j];
                }
            #pragma unroll
            for (int r = 0; r < MT; ++r) {
                if (r0 + r >= M) break;
                const uint4* xr = reinterpret_cast<const uint4*>(x + (size_t)(r0 + r) * K + (size_t)word * 8);
                #pragma unroll
                for (int v = 0; v < 8 / PACK; ++v) {
                    const uint4 raw = xr[v];
                    const T* xs = reinterpret_cast<const T*>(&raw);
                    for (int i = 0; i < PACK; ++i) {
                        const float xv = static_cast<float>(xs[i]);
                        for (int j = 0; j < F; ++j) acc[r][j] += xv * wf[j][v * PACK + i];
                    }
                }
            }
        }
      }
    }
    __shared__ float partial[GEMV_W][MT * F];
    const int warp = threadIdx.x / 32;
    const int lane = threadIdx.x % 32;
    #pragma unroll
    for (int r = 0; r < MT; ++r) {
        #pragma unroll
        for (int j = 0; j < F; ++j) {
            float v = acc[r][j];
            for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffff, v, o);
            if (lane == 0) partial[warp][r * F + j] = v;
        }
    }
    __syncthreads();
    for (int t = threadIdx.x; t < MT * F; t += blockDim.x) {
        const int r = t / F, j = t % F, row = r0 + r, f = feature(j);
        if (row >= M) continue;
        float sum = 0.f, other = 0.f;  // other: the pair's other feature (ROPE, SWIGLU)
        for (int q = 0; q < GEMV_W; ++q) {
            sum += partial[q][t];
            if (ROPE || SWIGLU) other += partial[q][t ^ 1];
        }
        if (SWIGLU) {  // the pair's gate thread: silu(gate) * up
            if (j & 1) continue;
            const float g = static_cast<float>(static_cast<T>(sum)), u = static_cast<float>(static_cast<T>(other));
            const float sig = static_cast<float>(static_cast<T>(1.f / (1.f + expf(-g))));
            const float act = static_cast<float>(static_cast<T>(g * sig));
            out[(size_t)row * (N / 2) + f] = static_cast<T>(act * u);
            continue;
        }
        if (!ROPE) {
            const size_t at = (size_t)row * N + f;
            // RES: + res, rounded as MLX's add of the rounded product and res
            out[at] = RES ? static_cast<T>(static_cast<float>(static_cast<T>(sum)) + static_cast<float>(res[at]))
                          : static_cast<T>(sum);
            continue;
        }
//@ ROPE_EPILOGUE
    }
