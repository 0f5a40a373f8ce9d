// The end of paged_group.cu (its STORE) for the split's partial kernel: per (block, head of
// the group) D + 2 floats in out, the weighted sum of values, then the max and the sum of
// the weights (-inf and 0 for no positions). paged_merge.cu reduces them.

        const size_t at = ((size_t)blockIdx.x * G + g) * (D + 2);
        for (int e = 0; e < E; ++e) out[at + lane * E + e] = o[e];
        if (lane == 0) {
            out[at + D] = top;
            out[at + D + 1] = total;
        }
    }
