// Decode attention read from the paged pool, one block per (row, query head): the body of
// an mx.fast.cuda_kernel (paged_attention.py launches it where KERNEL is "head"). Each warp
// takes every NW-th position of the row's slot table with an online softmax in float32,
// lane i holding elements E*i..E*i+E-1 of the head; the warps' partials meet in shared
// memory at the end. q [B, H, 1, D] (scaled by SCALE here), k_pool and v_pool [HK, S, D],
// slots [B, L] int32, lengths [B] int32; out [B, H, 1, D].

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
