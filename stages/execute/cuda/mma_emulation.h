// For the tests' CPU emulation (tests/cuda_emulation.py): C++ versions of mma.cuh's
// helpers: bfloat16 pairs packed in 32-bit registers (rounded to nearest even, the low
// half first) and mma.sync m16n8k16 computed by the warp's lanes from each other's
// fragments, with the fragment layouts of PTX's documentation.

static unsigned mma_a[64][32][4];
static unsigned mma_b[64][32][2];
static unsigned bf16_bits(float f) { unsigned u; std::memcpy(&u, &f, 4); u += 0x7fffu + ((u >> 16) & 1u); return u >> 16; }
static float bf16_half(unsigned reg, int high) {
    const unsigned u = (high ? reg >> 16 : reg & 0xffffu) << 16; float f; std::memcpy(&f, &u, 4); return f;
}
static unsigned unikern_pack(float lo, float hi) { return bf16_bits(lo) | (bf16_bits(hi) << 16); }
static float unikern_half(unsigned p, int high) { return bf16_half(p, high); }
static void unikern_load8(const float* p, unsigned r[4]) { for (int i = 0; i < 4; ++i) r[i] = unikern_pack(p[2 * i], p[2 * i + 1]); }
static void unikern_mma(float d[4], const unsigned a[4], const unsigned b[2]) {
    const int w = threadIdx.x / 32, lane = threadIdx.x % 32;
    for (int i = 0; i < 4; ++i) mma_a[w][lane][i] = a[i];
    for (int i = 0; i < 2; ++i) mma_b[w][lane][i] = b[i];
    warp_bars[w]->arrive_and_wait();
    const int g = lane / 4, t = lane % 4;
    for (int i = 0; i < 4; ++i) {  // d[i]: row g (+8 for i >= 2), column 2t + i % 2
        const int row = g + (i >= 2 ? 8 : 0), col = 2 * t + i % 2;
        float sum = 0.f;
        for (int k = 0; k < 16; ++k) {  // A[row][k] and B[k][col] from the lanes that hold them
            const int owner = (k % 8) / 2;
            sum += bf16_half(mma_a[w][(row % 8) * 4 + owner][(row >= 8) + 2 * (k >= 8)], k % 2)
                 * bf16_half(mma_b[w][col * 4 + owner][k >= 8], k % 2);
        }
        d[i] += sum;
    }
    warp_bars[w]->arrive_and_wait();
}
