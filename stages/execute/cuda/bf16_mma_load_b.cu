// mma.cu's B fragments (its LOAD_B) for bfloat16 weights as they are: the thread's feature
// g of tile nt, k 16t..16t+15 of the chunk, eight bf16 pairs from two 16-byte loads, pair
// 2st+h being k 16t+4st+2h, +1, the fragment slots the template's MMAs take.
        #pragma unroll
        for (int nt = 0; nt < NT; ++nt) {
            const T* wrow = w + ((size_t)n0 + nt * 8 + g) * K + (size_t)c * 64 + 16 * t;
            unsigned pairs[8];
            unikern_load8(wrow, pairs);
            unikern_load8(wrow + 8, pairs + 4);
            #pragma unroll
            for (int st = 0; st < 4; ++st) {
                bf[nt][st][0] = pairs[2 * st];
                bf[nt][st][1] = pairs[2 * st + 1];
            }
        }
