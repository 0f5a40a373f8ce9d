// A decode step's q/k/v rows qkv [B, N] (a matmul's output), each thread one feature of
// one row through rope_store.cu (the attention kernel takes q, which orders it after the
// writes). It replaces the fused blocks' MLX ops between a step of more rows' q/k/v matmul
// and the attention: RoPE, the pool write and the four slices and two reshapes around them.

    const int i = blockIdx.x * blockDim.x + threadIdx.x;  // over B * N
    const int N = qkv_shape[1];
    if (i < qkv_shape[0] * N) {
        const int row = i / N, f = i % N;
        float y = static_cast<float>(qkv[i]);
#define PAIR static_cast<float>(qkv[i - d + (TRAD ? (d ^ 1) : (second ? d - HD / 2 : d + HD / 2))])
//@ ROPE_STORE
#undef PAIR
    }
