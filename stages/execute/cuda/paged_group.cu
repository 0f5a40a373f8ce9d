// Decode attention read from the paged pool, one block per (row, KV head) for all G query
// heads of its group (paged_attention.py's default kernel): each key and value is read once
// for the group instead of G times, and each warp carries G independent dot products and
// softmaxes per position (G times the work between its dependent shuffles). With P blocks
// per (row, KV head) (the split, paged_attention.partitions) block `part` takes positions
// [lo, hi) of the row. The marker line STORE ends the kernel: paged_group_out.cu (each
// head's output) or paged_group_parts.cu (the split's partials). block_step.cu runs this
// text as its attention phase, a few names renamed (block_kernel.py).

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
//@ STORE
