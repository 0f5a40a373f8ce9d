// The GPU's nanosecond clock (its low 32 bits), for block_step.cu's TIMES.
// clock_emulation.h is the tests' stand-in.

__device__ inline unsigned unikern_clock() {
    unsigned long long t;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
    return (unsigned)t;
}
