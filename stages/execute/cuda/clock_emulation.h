// For the tests' CPU emulation (tests/cuda_emulation.py): clock.cuh's unikern_clock, a
// clock that only moves on.

static std::atomic<unsigned> clock_ticks{1};
static unsigned unikern_clock() { return clock_ticks++; }  // a clock that only moves on
