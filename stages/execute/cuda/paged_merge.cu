// The split's merge: a warp per (row, query head) over the row's P partials
// (paged_group_parts.cu), P read from the partials' shape; out [B, H, 1, D].

    const int bh = blockIdx.x;
    const int b = bh / H;
    const int h = bh % H;
    const int lane = threadIdx.x;
    const int P = parts_shape[0] / (gridDim.x / H * HK);  // partials per (row, KV head)
    const size_t first = (((size_t)b * HK + h / G) * P * G + h % G) * (D + 2);  // partial 0
    float top = -INFINITY;
    for (int p = 0; p < P; ++p) top = fmaxf(top, parts[first + (size_t)p * G * (D + 2) + D]);
    float total = 0.f;
    float o[E];
    for (int e = 0; e < E; ++e) o[e] = 0.f;
    for (int p = 0; p < P; ++p) {
        const size_t at = first + (size_t)p * G * (D + 2);
        const float c = parts[at + D] == -INFINITY ? 0.f : expf(parts[at + D] - top);
        total += parts[at + D + 1] * c;
        for (int e = 0; e < E; ++e) o[e] += parts[at + lane * E + e] * c;
    }
    for (int e = 0; e < E; ++e) out[(size_t)bh * D + lane * E + e] = static_cast<T>(o[e] / total);
