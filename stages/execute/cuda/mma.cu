// A tensor-core kernel for steps of up to 64 rows of bfloat16: mma.sync m16n8k16 (bf16 in,
// float32 sums). A block of MMA_W warps computes 8*NT output features for up to 16*RT rows
// (a pass), its warps splitting K in 64-wide chunks. The B fragments' loads are the marker
// line LOAD_B: 4-bit weights dequantized (q4_mma_load_b.cu) or bfloat16 weights as they
// are (bf16_mma_load_b.cu). A load fills bf[NT][4][2], tile nt's k-step st for the thread's
// feature g = lane / 4: the bf16 pairs of k 16t+4st+2h, +1 of the chunk (t = lane % 4,
// h = 0, 1), and with SPLIT lost[NT][4][2]. A k-step's 16 positions may be any 16 of the
// chunk as long as A and B agree: the fragment slots that thread t owns (k 2t, 2t+1, 2t+8,
// 2t+9 of the step) take its own k 16t+4s..16t+4s+3, so no thread needs another's weights,
// and its A fragments come from two 16-byte loads per row. Sums meet across the warps in
// shared memory.

    constexpr int CHUNKS = K / 64;
    const int N = w_shape[0];
    const int M = x_shape[0];
    const int warp = threadIdx.x / 32;
    const int lane = threadIdx.x % 32;
    const int g = lane / 4;
    const int t = lane % 4;
    const int passes = (M + 16 * RT - 1) / (16 * RT);
    const int r0 = (blockIdx.x % passes) * 16 * RT;
    const int n0 = (blockIdx.x / passes) * 8 * NT;  // NT tiles of 8 features
    if (n0 >= N) return;  // the whole block
    float acc[RT][NT][4];
    #pragma unroll
    for (int rt = 0; rt < RT; ++rt)
        for (int nt = 0; nt < NT; ++nt)
            for (int i = 0; i < 4; ++i) acc[rt][nt][i] = 0.f;
    for (int c = warp; c < CHUNKS; c += MMA_W) {
        unsigned bf[NT][4][2];  // tile nt, k-step st: the thread's k 4st..4st+3 as two pairs
        unsigned lost[NT][4][2];  // with SPLIT: what rounding them to bf16 lost
//@ LOAD_B
        #pragma unroll
        for (int rt = 0; rt < RT; ++rt) {
            const int ra = r0 + rt * 16 + g;
            unsigned xa[8], xb[8];  // rows ra and ra + 8, k 16t..16t+15 of the chunk, as pairs
            for (int i = 0; i < 8; ++i) { xa[i] = 0u; xb[i] = 0u; }
            const size_t col = (size_t)c * 64 + 16 * t;
            if (ra < M) {
                unikern_load8(x + (size_t)ra * K + col, xa);
                unikern_load8(x + (size_t)ra * K + col + 8, xa + 4);
            }
            if (ra + 8 < M) {
                unikern_load8(x + (size_t)(ra + 8) * K + col, xb);
                unikern_load8(x + (size_t)(ra + 8) * K + col + 8, xb + 4);
            }
            #pragma unroll
            for (int st = 0; st < 4; ++st) {
                const unsigned a[4] = {xa[2 * st], xb[2 * st], xa[2 * st + 1], xb[2 * st + 1]};
                #pragma unroll
                for (int nt = 0; nt < NT; ++nt) {  // one A fragment for every tile
                    unikern_mma(acc[rt][nt], a, bf[nt][st]);
                    if (SPLIT) unikern_mma(acc[rt][nt], a, lost[nt][st]);
                }
            }
        }
    }
    __shared__ float partial[MMA_W][RT * NT * 4][32];
    #pragma unroll
    for (int rt = 0; rt < RT; ++rt)
        for (int nt = 0; nt < NT; ++nt)
            for (int i = 0; i < 4; ++i) partial[warp][(rt * NT + nt) * 4 + i][lane] = acc[rt][nt][i];
    __syncthreads();
    for (int idx = threadIdx.x; idx < RT * NT * 4 * 32; idx += blockDim.x) {
        const int slot = idx / 32;  // (rt * NT + nt) * 4 + i
        const int ln = idx % 32;
        const int i = slot % 4;
        const int nt = (slot / 4) % NT;
        const int row = r0 + (slot / (4 * NT)) * 16 + ln / 4 + (i >= 2 ? 8 : 0);
        if (row >= M) continue;
        float sum = 0.f;
        for (int q = 0; q < MMA_W; ++q) sum += partial[q][slot][ln];
        out[(size_t)row * N + n0 + nt * 8 + 2 * (ln % 4) + (i % 2)] = static_cast<T>(sum);
    }
