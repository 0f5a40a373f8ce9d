// For the tests' CPU emulation (tests/cuda_emulation.py): unpack.cuh's helper for float32
// rows (16 bytes as 4 floats), and __align__.

#define __align__(n) __attribute__((aligned(n)))
template <typename U> static void unikern_unpack(const uint4& v, float* o) { std::memcpy(o, &v, 16); }
