"""The tests' CUDA emulation itself (tests/cuda_emulation.py): a block's threads as fibers
meet at warp shuffles and `__syncthreads` as CUDA's threads do, shared memory is the
block's, blocks run one after another, inputs written in place come back, and a barrier
that some threads never reach ends the launch with an error instead of hanging."""

import numpy as np
import pytest

from tests import cuda_emulation

pytestmark = pytest.mark.skipif(not cuda_emulation.available(), reason="the emulation needs g++ (C++20) and ucontext")

# each warp sums its lanes by shuffles, warp 0 sums the warps' sums through shared memory,
# and every thread adds its block's total to its own element, also written back into x
REDUCE = """
    __shared__ float partial[32];
    const int i = blockIdx.x * blockDim.x + threadIdx.x;
    float v = x[i];
    for (int m = 16; m; m >>= 1) v += __shfl_xor_sync(0xffffffffu, v, m);
    if (threadIdx.x % 32 == 0) partial[threadIdx.x / 32] = v;
    __syncthreads();
    float total = 0.f;
    for (unsigned w = 0; w < blockDim.x / 32; ++w) total += partial[w];
    out[i] = x[i] + total;
    __syncthreads();
    const_cast<float*>(x)[i] = total;
"""


@pytest.mark.parametrize("blocks, threads", [(1, 32), (3, 128)])
def test_shuffles_and_block_barriers_meet_as_cuda_threads_do(blocks, threads):
    x = np.arange(blocks * threads, dtype=np.float32)
    totals = np.repeat(x.reshape(blocks, threads).sum(1), threads)
    got = cuda_emulation.run_kernel(REDUCE, {"x": x.copy()}, {}, blocks, threads, (blocks * threads,))
    np.testing.assert_array_equal(got, x + totals)
    written = x.copy()
    cuda_emulation.run_kernel(REDUCE, {"x": written}, {}, blocks, threads, (blocks * threads,))
    np.testing.assert_array_equal(written, totals)


def test_a_barrier_some_threads_never_reach_ends_the_launch():
    source = "if (threadIdx.x < 32) __syncthreads(); out[threadIdx.x] = 1.f;"
    with pytest.raises(RuntimeError, match="32 of 64 threads wait at barriers"):
        cuda_emulation.run_kernel(source, {"x": np.zeros(1, np.float32)}, {}, 1, 64, (64,))
