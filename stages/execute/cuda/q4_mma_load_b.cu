// mma.cu's B fragments (its LOAD_B) for 4-bit affine weights: thread (g, t) reads two
// packed words of feature g (16 nibbles, k 16t..16t+15 of the chunk, one scale group) and
// dequantizes them into the fragments of the chunk's four k-steps. With SPLIT each weight
// goes in as two bf16 halves (the value rounded, then what rounding lost) through two MMAs:
// the weights as exact as float32's, as MLX's one-row kernel has them, where one bf16
// rounds them to 8 bits of mantissa.
        #pragma unroll
        for (int nt = 0; nt < NT; ++nt) {  // nibbles 4st..4st+3 of the thread's 16, dequantized
            const size_t feature = (size_t)n0 + nt * 8 + g;
            const unsigned* wrow = w + feature * (K / 8);
            const unsigned words[2] = {wrow[c * 8 + 2 * t], wrow[c * 8 + 2 * t + 1]};
            const size_t gi = feature * (K / GS) + (c * 64 + 16 * t) / GS;
            const float s = static_cast<float>(scales[gi]);
            const float b = static_cast<float>(biases[gi]);
            #pragma unroll
            for (int st = 0; st < 4; ++st) {
                const unsigned word = words[st / 2] >> (16 * (st % 2));
                #pragma unroll
                for (int h = 0; h < 2; ++h) {
                    const float w0 = s * static_cast<float>((word >> (8 * h)) & 15u) + b;
                    const float w1 = s * static_cast<float>((word >> (8 * h + 4)) & 15u) + b;
                    bf[nt][st][h] = unikern_pack(w0, w1);
                    if (SPLIT) {
                        lost[nt][st][h] = unikern_pack(w0 - unikern_half(bf[nt][st][h], 0),
                                                       w1 - unikern_half(bf[nt][st][h], 1));
                    }
                }
            }
        }
