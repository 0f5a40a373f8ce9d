// The CUDA built-ins for the programs of tests/cuda_emulation.py: each program is a
// kernel's own source, the lines that read its inputs and write its outputs, and this
// header; tests/cuda_emulation_runtime.cpp (compiled once per test process) runs the
// CUDA threads of a block as fibers on one OS thread. Precompiled once per test process.
#pragma once
#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstddef>
#include <cstdio>
#include <cstring>

using std::min;
using std::max;
struct dim3 { unsigned x, y, z; };
struct alignas(16) uint4 { unsigned x, y, z, w; };

extern dim3* current_index;  // the running fiber's index in its block
#define threadIdx (*current_index)
extern dim3 blockIdx, blockDim, gridDim;

// a barrier of `expected` fibers: the last to arrive starts the next generation and goes
// on; the others wait in the scheduler until their generation has passed
struct FiberBarrier {
    unsigned expected, arrived, generation;
    void arrive_and_wait();
};
extern FiberBarrier* warp_bars[64];  // one per warp of the block
extern FiberBarrier* block_bar;

#define __shared__ static

float exchange_lanes(float v, int from);  // lane `from`'s v, through the warp's buffer and barrier
static inline float __shfl_xor_sync(unsigned, float v, int mask) { return exchange_lanes(v, (threadIdx.x % 32) ^ mask); }
static inline float __shfl_sync(unsigned, float v, int lane) { return exchange_lanes(v, lane); }
static inline int __shfl_sync(unsigned, int v, int lane) {  // through the float buffer, bit for bit
    float f; std::memcpy(&f, &v, 4); f = exchange_lanes(f, lane); int r; std::memcpy(&r, &f, 4); return r;
}
static inline void __syncthreads() { block_bar->arrive_and_wait(); }
static inline void __threadfence() { std::atomic_thread_fence(std::memory_order_seq_cst); }
static inline unsigned atomicAdd(unsigned* p, unsigned v) { return std::atomic_ref<unsigned>(*p).fetch_add(v); }
static inline unsigned atomicExch(unsigned* p, unsigned v) { return std::atomic_ref<unsigned>(*p).exchange(v); }
static inline float __int_as_float(int i) { float f; std::memcpy(&f, &i, 4); return f; }
static inline float rsqrtf(float v) { return 1.f / std::sqrt(v); }
static inline void sincospif(float x, float* s, float* c) { *s = std::sin(M_PI * x); *c = std::cos(M_PI * x); }
static inline void __nanosleep(unsigned) {}  // (the blocks run one after another: no other block to wait for)

void* read_input(size_t bytes);  // the next `bytes` of stdin, in memory of its own
void* zeros(size_t bytes);
// `kernel` over `blocks` blocks of `threads` fibers, blocks one after another (their
// shared memory reused): 0, or 3 where some fibers wait at a barrier the others never reach
int run_blocks(void (*kernel)(), unsigned blocks, unsigned threads);
