// 16 bytes of a row as floats, by the row's dtype (MLX's custom kernels give T as float,
// __nv_bfloat16 or __half): block_gemv.cu's and block_step.cu's loads. unpack_emulation.h
// is its float32 version for the tests' CPU emulation.

template <typename U> __device__ inline void unikern_unpack(const uint4& v, float* o);
template <> __device__ inline void unikern_unpack<float>(const uint4& v, float* o) {
    o[0] = __uint_as_float(v.x); o[1] = __uint_as_float(v.y);
    o[2] = __uint_as_float(v.z); o[3] = __uint_as_float(v.w);
}
template <> __device__ inline void unikern_unpack<__nv_bfloat16>(const uint4& v, float* o) {
    const __nv_bfloat162* h = reinterpret_cast<const __nv_bfloat162*>(&v);
    for (int i = 0; i < 4; ++i) {
        const float2 f = __bfloat1622float2(h[i]);
        o[2 * i] = f.x; o[2 * i + 1] = f.y;
    }
}
template <> __device__ inline void unikern_unpack<__half>(const uint4& v, float* o) {
    const __half2* h = reinterpret_cast<const __half2*>(&v);
    for (int i = 0; i < 4; ++i) {
        const float2 f = __half22float2(h[i]);
        o[2 * i] = f.x; o[2 * i + 1] = f.y;
    }
}
