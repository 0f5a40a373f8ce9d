// One feature f of a decode step's q/k/v row `row` (q's heads, then k's, then v's; QN and
// KN features), its value y (float): q and k rotated with the other of their RoPE pair
// (pairs i and i + HD/2, or 2i and 2i + 1 when TRAD; PAIR, an expression of `d`, f's index
// in its head, that the including kernel fills in, gives the other's value) for the row's
// position, computed in float32 and rounded once as MLX's RoPE does; q stored to out
// [rows, QN] (all of q, k and v to out [rows, N] without POOL), k and v into the pool
// [kv heads, slots, HD] at the row's slot, in place. Included (its marker line ROPE_STORE)
// by rope_write.cu and q4_gemv_rope.cu.

        if (f < QN + KN) {  // q or k: rotated with the other of its pair
            const int d = f % HD;
            const bool second = TRAD ? (d & 1) : (d >= HD / 2);
            const float yp = PAIR;
            float sn, cs;  // the angle in units of pi: an exact range reduction, no slow path
            sincospif(static_cast<float>(pos[row]) * freq_pi[TRAD ? d / 2 : d % (HD / 2)], &sn, &cs);
            y = second ? y * cs + yp * sn : y * cs - yp * sn;
        }
        if (!POOL || f < QN) {
            out[(size_t)row * (POOL ? QN : N) + f] = static_cast<T>(y);
        } else {  // k or v of kv head c / HD
            const bool is_v = f >= QN + KN;
            const int c = f - (is_v ? QN + KN : QN);
            T* pool = is_v ? const_cast<T*>(v_pool) : const_cast<T*>(k_pool);
            pool[((size_t)(c / HD) * k_pool_shape[1] + slots[row]) * HD + c % HD] = static_cast<T>(y);
        }
