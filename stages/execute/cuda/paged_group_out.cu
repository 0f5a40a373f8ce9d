// The end of paged_group.cu (its STORE) where a row is not split: each head's output,
// normalized, into out [B, H, 1, D].

        const size_t row = ((size_t)b * H + (size_t)kvh * G + g) * D + lane * E;
        for (int e = 0; e < E; ++e) out[row + e] = static_cast<T>(o[e] / total);
    }
