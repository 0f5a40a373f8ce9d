// One decode step's keys and values [B, HK, 1, D] written into the pool arrays [HK, S, D]
// at each row's slot (slots [B]), in place (pool_write.py's `write`). The pool arrays are
// inputs: MLX sees no write to them, so whatever reads them back takes `done` as an input of
// its own kernel, which orders it after this one (MLX's CUDA graph orders a kernel after the
// kernels that wrote its inputs' buffers, nothing else).

    const int i = blockIdx.x * blockDim.x + threadIdx.x;  // over B * Hk * D
    const int Hk = k_pool_shape[0], S = k_pool_shape[1], D = k_pool_shape[2];
    if (i < slots_shape[0] * Hk * D) {
        const int d = i % D, h = (i / D) % Hk, b = i / (D * Hk);
        const size_t to = ((size_t)h * S + slots[b]) * D + d;
        // keys and values as they come (strided: the family's transposed views, which MLX
        // would otherwise copy for the kernel, two copies per layer and step)
        const_cast<T*>(k_pool)[to] = keys[b * keys_strides[0] + h * keys_strides[1] + d * keys_strides[3]];
        const_cast<T*>(v_pool)[to] = values[b * values_strides[0] + h * values_strides[1] + d * values_strides[3]];
    }
    if (i == 0) done[0] = 1;
