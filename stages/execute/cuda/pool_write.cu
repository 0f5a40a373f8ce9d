// A step's keys and values [B, HK, T, D] written into the pool arrays [HK, S, D] at each
// token's slot (slots [B * T], row by row), in place (pool_write.py's `write`): a decode
// step's one token per row, a prompt's chunk, a prefix hit's copied slots. The pool arrays
// are inputs: MLX sees no write to them, so whatever reads them back takes `done` as an
// input of its own kernel, which orders it after this one (MLX's CUDA graph orders a
// kernel after the kernels that wrote its inputs' buffers, nothing else). Where keys and
// values are read (k_at, v_at) pool_write.py fills in: through their strides or packed.

    const size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x;  // over B * tokens * Hk * D
    const int Hk = k_pool_shape[0], S = k_pool_shape[1], D = k_pool_shape[2], tokens = keys_shape[2];
    if (i < (size_t)slots_shape[0] * Hk * D) {
        const int d = i % D, h = (i / D) % Hk;
        const size_t bt = i / ((size_t)D * Hk);  // the token: row bt / tokens, its t-th
        const size_t b = bt / tokens, t = bt % tokens;
        const size_t to = ((size_t)h * S + slots[bt]) * D + d;
//@ AT
        const_cast<T*>(k_pool)[to] = keys[k_at];
        const_cast<T*>(v_pool)[to] = values[v_at];
    }
    if (i == 0) done[0] = 1;
