// The runtime of tests/cuda_emulation.py's programs: the CUDA threads of a block as
// fibers (a ucontext with a stack of its own each) that a scheduler on one OS thread
// switches between. A fiber runs until it waits at a barrier; the last to arrive goes on,
// and the scheduler resumes the ones whose barrier has moved on. (With an OS thread per
// CUDA thread, a launch spends most of its time in futex calls on CI's 2 shared cores.)
#include "cuda_emulation.h"

#include <cstdlib>
#include <ucontext.h>

namespace {
struct Fiber {
    ucontext_t context;
    dim3 index;
    FiberBarrier* waits_on;  // nullptr: runnable
    unsigned waits_for;      // the generation it waits to pass
    bool done;
};
constexpr size_t STACK_BYTES = 1 << 17;
Fiber* fibers;
char* stacks;
ucontext_t scheduler;
Fiber* running;
void (*launched)();
float exchange[64][32];

void fiber_main() {
    launched();
    running->done = true;  // (uc_link: back to the scheduler)
}
}  // namespace

dim3* current_index;
dim3 blockIdx, blockDim, gridDim;
FiberBarrier* warp_bars[64];
FiberBarrier* block_bar;

void FiberBarrier::arrive_and_wait() {
    if (++arrived == expected) {
        arrived = 0;
        ++generation;
        return;
    }
    Fiber* f = running;
    f->waits_on = this;
    f->waits_for = generation;
    swapcontext(&f->context, &scheduler);
}

float exchange_lanes(float v, int from) {
    const int w = threadIdx.x / 32;
    exchange[w][threadIdx.x % 32] = v;
    warp_bars[w]->arrive_and_wait();
    const float r = exchange[w][from];
    warp_bars[w]->arrive_and_wait();
    return r;
}

void* zeros(size_t bytes) { return std::calloc(bytes ? bytes : 1, 1); }

void* read_input(size_t bytes) {
    void* p = zeros(bytes);
    if (std::fread(p, 1, bytes, stdin) != bytes) {
        std::fprintf(stderr, "the emulation's input ended early: %zu bytes expected\n", bytes);
        std::exit(2);
    }
    return p;
}

int run_blocks(void (*kernel)(), unsigned blocks, unsigned threads) {
    const unsigned warps = threads / 32;
    for (unsigned w = 0; w < warps; ++w) warp_bars[w] = new FiberBarrier{32, 0, 0};
    block_bar = new FiberBarrier{threads, 0, 0};
    blockDim = {threads, 1, 1};
    gridDim = {blocks, 1, 1};
    fibers = new Fiber[threads];
    stacks = static_cast<char*>(std::malloc(STACK_BYTES * threads));
    launched = kernel;
    for (unsigned b = 0; b < blocks; ++b) {
        blockIdx = {b, 0, 0};
        for (unsigned t = 0; t < threads; ++t) {
            Fiber& f = fibers[t];
            f.index = {t, 0, 0};
            f.waits_on = nullptr;
            f.done = false;
            getcontext(&f.context);
            f.context.uc_stack.ss_sp = stacks + STACK_BYTES * t;
            f.context.uc_stack.ss_size = STACK_BYTES;
            f.context.uc_link = &scheduler;
            makecontext(&f.context, fiber_main, 0);
        }
        for (unsigned left = threads; left;) {  // round robin over the fibers that can go on
            bool moved = false;
            for (unsigned t = 0; t < threads; ++t) {
                Fiber& f = fibers[t];
                if (f.done || (f.waits_on && f.waits_on->generation == f.waits_for)) continue;
                f.waits_on = nullptr;
                running = &f;
                current_index = &f.index;
                swapcontext(&scheduler, &f.context);
                moved = true;
                if (f.done) --left;
            }
            if (!moved) {
                std::fprintf(stderr, "block %u: %u of %u threads wait at barriers that the others never reach\n", b, left, threads);
                return 3;
            }
        }
    }
    return 0;
}
