// A residual add and the RMS norm of its sum as one kernel (residual_norm.py): one block
// per row, each thread keeping PER elements of the row (D = THREADS * PER). The sum x + r in
// `out` (rounded to T, as MLX's add rounds it), its norm in `normed` (as MLX's CUDA
// rms_norm computes it: float32 sum of squares, the normalized value rounded to T, then
// times the weight in T). EPS: the float's bits.

    const size_t row = blockIdx.x;
    const int t = threadIdx.x;
    const size_t rows = x_shape[0];
    float hv[PER];
    float squares = 0.f;
    for (int i = 0; i < PER; ++i) {
        const size_t at = row * D + (size_t)i * THREADS + t;
        const T h = static_cast<T>(static_cast<float>(x[at]) + static_cast<float>(r[at]));
        out[at] = h;
        hv[i] = static_cast<float>(h);
        squares += hv[i] * hv[i];
    }
    for (int o = 16; o > 0; o >>= 1) squares += __shfl_xor_sync(0xffffffff, squares, o);
    __shared__ float warp_sums[THREADS / 32];
    if (t % 32 == 0) warp_sums[t / 32] = squares;
    __syncthreads();
    float total = 0.f;
    for (int w = 0; w < THREADS / 32; ++w) total += warp_sums[w];
    const float normalizer = rsqrtf(total / D + __int_as_float(EPS));
    for (int i = 0; i < PER; ++i) {
        const size_t at = row * D + (size_t)i * THREADS + t;
        normed[at] = weight[(size_t)i * THREADS + t] * static_cast<T>(hv[i] * normalizer);
    }
