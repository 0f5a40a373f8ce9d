// A decode window's step laid out for its B rows in one kernel (step_layout.py), in place
// of the element-wise ops of paged_cache.window_layout, which MLX fuses inside a traced
// step into kernels it compiles at run time: each row's offset (its start plus the step),
// length (offset + 1) and write slot (the write table's entry for the step), and its read
// slots with the positions past the offset turned to the zero block (slot 0), beside the
// mask of the positions it sees. One thread per (row, table position).

    const int B = read_slots_shape[0], L = read_slots_shape[1], P = write_table_shape[1];
    const int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < B * L) {
        const int b = i / L, l = i % L, s = step[0];
        const int offset = starts[b] + s;
        const bool visible = l <= offset;
        seen[i] = visible;
        read[i] = visible ? read_slots[i] : 0;
        if (l == 0) {
            offsets[b] = offset;
            lengths[b] = offset + 1;
            write[b] = write_table[s * P + b];
        }
    }
