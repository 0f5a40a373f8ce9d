// The tensor-core helpers of mma.cu: unikern_load8 (8 bf16 as 4 pairs), unikern_pack (two
// floats to a bf16 pair), unikern_half (one half of a pair back as a float), unikern_mma
// (mma.sync m16n8k16, bf16 in, float32 sums). mma_emulation.h gives C++ versions of the
// four for the tests' CPU emulation.

__device__ inline void unikern_load8(const __nv_bfloat16* p, unsigned r[4]) {
    const uint4 v = *reinterpret_cast<const uint4*>(p);
    r[0] = v.x; r[1] = v.y; r[2] = v.z; r[3] = v.w;
}
__device__ inline unsigned unikern_pack(float lo, float hi) {
    __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
    return *reinterpret_cast<unsigned*>(&v);
}
__device__ inline float unikern_half(unsigned p, int high) {
    const __nv_bfloat162 v = *reinterpret_cast<const __nv_bfloat162*>(&p);
    return high ? __high2float(v) : __low2float(v);
}
__device__ inline void unikern_mma(float d[4], const unsigned a[4], const unsigned b[2]) {
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 "
                 "{%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};"
                 : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
}
