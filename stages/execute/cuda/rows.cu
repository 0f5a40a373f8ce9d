// Rows of a table [N, W] at row indices ids [R]: out[r, :] = table[ids[r], :] (rows.py's
// `take`), in place of MLX's gather, which its CUDA backend compiles with NVRTC on a
// machine's first start. Any dtype T: a thread copies one 16-byte chunk of a row, as one
// uint4 where the chunk is whole and both ends are aligned, else element by element (a
// row's tail). An index past the table's rows gives a row of zeros, not a stray read.

    const size_t N = table_shape[0], W = table_shape[1], R = ids_shape[0];
    constexpr size_t E = sizeof(T) >= 16 ? 1 : 16 / sizeof(T);  // elements per chunk
    const size_t C = (W + E - 1) / E;  // chunks per row
    const size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (i < R * C) {
        const size_t r = i / C, c = i % C, row = (size_t)ids[r];
        T* to = out + r * W + c * E;
        const size_t n = W - c * E < E ? W - c * E : E;  // a row's last chunk may be short
        if (row >= N) {
            unsigned char* bytes = reinterpret_cast<unsigned char*>(to);
            for (size_t k = 0; k < n * sizeof(T); ++k) bytes[k] = 0;
        } else {
            const T* from = table + row * W + c * E;
            if (n == E && sizeof(T) * E == 16 && ((size_t)from | (size_t)to) % 16 == 0) {
                *reinterpret_cast<uint4*>(to) = *reinterpret_cast<const uint4*>(from);
            } else {
                for (size_t e = 0; e < n; ++e) to[e] = from[e];
            }
        }
    }
