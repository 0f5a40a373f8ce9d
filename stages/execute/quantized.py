"""Quantized linear layers that multiply many rows by dequantizing their weights first."""

from __future__ import annotations

import functools
from typing import Any

import mlx.core as mx
import mlx.nn as nn
from mlx.nn.layers.distributed import (
    QuantizedAllToShardedLinear,
    QuantizedShardedToAllLinear,
    sum_gradients,
)

from unikern.platform.kernel_cache import cuda_kernel, placeholder
from unikern.stages.execute.paged_attention import ROPE_STORE

# Rows from which a step multiplies dequantized weights (None: never), by backend. MLX's
# CPU and CUDA quantized matmuls cost about one row's time per row (CPU, 4096x4096 4-bit:
# 15.8 ms per row against 120 ms for 64 rows dequantized first; an H200 at the 8B shape
# ran 64 rows in ~210 ms against 7.6 ms for one), while dequantizing costs one pass over
# the weights whatever the rows. Metal's quantized kernels tile rows well: left alone.
AUTO_ROWS = {"cpu": 8, "cuda": 8, "metal": None}
# The activations' dtypes whose steps "auto" dequantizes, by backend (absent: any). MLX's
# CPU quantized matmul sums each output k by k in the activations' dtype, rounding every
# product and partial sum to it (mlx/backend/cpu/quantized.cpp, _qmm_t): bfloat16 and
# float16 rows sum in 8 and 11 bits, which no matmul (float32 sums) gives back, and
# mlx-lm's tokens changed (tests/test_quantized_parity.py); float32 rows sum in float32
# either way, bit for bit under MLX's reference BLAS, in another order under a preloaded
# one, as unquantized float32 layers' batched rows do.
AUTO_DTYPES = {"cpu": ("float32",)}
# The same with unikern's CUDA kernels below it (execute.quantized_gemv / quantized_mma).
# The GEMV, measured at the 8B shape on an H200 (tools/results/gpu/session8/a-gemv):
# steps of 16 rows 728 -> 894 tok/s against dequantized weights, 64 rows 2,579 -> 1,074;
# so from 17 rows. The tensor-core kernel (tools/results/gpu/session8/b-mma: a 64-row
# decode step 14.7 ms through it, 55.1 through the GEMV, 196.5 through MLX's quantized
# matmul; against dequantized weights see execute.quantized_mma): from 65 rows.
KERNEL_ROWS = {"gemv": 17, "mma": 65}


# A GEMV for 4-bit affine weights, for steps of few rows (execute.quantized_gemv). A block
# of GEMV_WARPS warps computes GEMV_FEATURES consecutive output features for up to MT rows
# (a pass; more rows take more passes, whose blocks sit next to each other so the later
# ones find the weights in L2). Its threads stride together over the weights' 32-bit words
# (8 nibbles, inside one scale group): each dequantizes its word of every feature once
# into registers, then multiplies every row of x against them, so a row costs only its own
# FMAs; per-thread sums meet by warp shuffles, then across the warps in shared memory.
# MLX's affine layout: weight [N, K/8] uint32 (nibble i of a word is bits 4i..4i+3),
# scales and biases [N, K/GS]; rows come from x's shape at run time, so the kernel is
# built once per (K, GS, MT, dtype). ROPE (blocks.py's 4-bit q/k/v projection, w's rows q
# then k then v, QN and KN features): below QN + KN a block's F features are F / 2
# rotation pairs of one head (i and i + HD/2, or 2i and 2i + 1 with TRAD), rotated for
# each row's position (pos; freq_pi: the inverse frequencies over pi) as MLX's RoPE
# rotates the rounded products; with POOL the rows' k and v go into the layer's pool
# arrays at their slots, in place, and `out` holds q alone, else out is [rows, N]. SWIGLU
# (the 4-bit blocks' gate/up projection, w's rows gate then up): a block's F features are
# F / 2 (gate, up) pairs, and out [rows, N / 2] is silu(gate) * up, rounded as MLX's ops.
_GEMV_BODY = """
    constexpr int F = GEMV_F;
    constexpr int WORDS = K / 8;
    constexpr int WPL = GEMV_WPL;  // packed words per weight load: 1 (4 bytes) or 4 (16)
    constexpr int PACK = 16 / sizeof(T);  // x elements per 16-byte load
    const int N = w_shape[0];
    const int M = x_shape[0];
    const int passes = (M + MT - 1) / MT;
    const int r0 = (blockIdx.x % passes) * MT;
    const int n0 = (blockIdx.x / passes) * F;
    if (n0 >= N) return;  // the whole block
    auto feature = [&](int j) -> int {  // the block's output feature j
        if (SWIGLU) return (j & 1) ? n0 / 2 + j / 2 + N / 2 : n0 / 2 + j / 2;
        if (!ROPE || n0 >= QN + KN) return n0 + j;
        const int p = n0 / 2 + j / 2, head = p / (HD / 2), i = p % (HD / 2);
        const int f0 = TRAD ? head * HD + 2 * i : head * HD + i;
        return (j & 1) ? (TRAD ? f0 + 1 : f0 + HD / 2) : f0;
    };
    float acc[MT][F];
    for (int r = 0; r < MT; ++r)
        for (int j = 0; j < F; ++j) acc[r][j] = 0.f;
    // the block's threads (GEMV_W warps) stride together, GEMV_U strides per pass of the
    // outer loop, unrolled: a thread's loads of a pass can be issued before its FMAs
    constexpr int STRIDE = GEMV_W * 32;
    for (int c0 = threadIdx.x; c0 < WORDS / WPL; c0 += STRIDE * GEMV_U) {
      #pragma unroll
      for (int u = 0; u < GEMV_U; ++u) {
        const int c = c0 + u * STRIDE;
        if ((WORDS / WPL) % (STRIDE * GEMV_U) && c >= WORDS / WPL) break;  // (whole passes: no test)
        const int g = (c * WPL * 8) / GS;  // 8 * WPL <= 32 weights: inside one scale group
        unsigned words[F][4];  // the first WPL used
        float s[F], b[F];
        #pragma unroll
        for (int j = 0; j < F; ++j) {  // every load of the unit first: more bytes in flight
            const int f = feature(j);
            const unsigned* wrow = w + (size_t)f * WORDS;
            if (WPL == 4) {
                const uint4 v = reinterpret_cast<const uint4*>(wrow)[c];
                words[j][0] = v.x; words[j][1] = v.y; words[j][2] = v.z; words[j][3] = v.w;
            } else {
                words[j][0] = wrow[c];
            }
            s[j] = static_cast<float>(scales[(size_t)f * (K / GS) + g]);
            b[j] = static_cast<float>(biases[(size_t)f * (K / GS) + g]);
        }
        #pragma unroll
        for (int q = 0; q < WPL; ++q) {
            const int word = c * WPL + q;  // 8 weights from k = 8 * word
            float wf[F][8];
            #pragma unroll
            for (int j = 0; j < F; ++j)
                for (int i = 0; i < 8; ++i) {
                    const unsigned nib = (words[j][q] >> (4 * i)) & 15u;
                    // MAGIC: the nibble as the low bits of the float 2^23 + nib, less 2^23 (an OR
                    // and an add, exact) instead of a conversion (an eighth of the FMAs' rate on sm_90)
                    const float qf = MAGIC ? __int_as_float(0x4B000000 | nib) - 8388608.f : static_cast<float>(nib);
                    wf[j][i] = s[j] * qf + b[j];
                }
            #pragma unroll
            for (int r = 0; r < MT; ++r) {
                if (r0 + r >= M) break;
                const uint4* xr = reinterpret_cast<const uint4*>(x + (size_t)(r0 + r) * K + (size_t)word * 8);
                #pragma unroll
                for (int v = 0; v < 8 / PACK; ++v) {
                    const uint4 raw = xr[v];
                    const T* xs = reinterpret_cast<const T*>(&raw);
                    for (int i = 0; i < PACK; ++i) {
                        const float xv = static_cast<float>(xs[i]);
                        for (int j = 0; j < F; ++j) acc[r][j] += xv * wf[j][v * PACK + i];
                    }
                }
            }
        }
      }
    }
    __shared__ float partial[GEMV_W][MT * F];
    const int warp = threadIdx.x / 32;
    const int lane = threadIdx.x % 32;
    #pragma unroll
    for (int r = 0; r < MT; ++r) {
        #pragma unroll
        for (int j = 0; j < F; ++j) {
            float v = acc[r][j];
            for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffff, v, o);
            if (lane == 0) partial[warp][r * F + j] = v;
        }
    }
    __syncthreads();
    for (int t = threadIdx.x; t < MT * F; t += blockDim.x) {
        const int r = t / F, j = t % F, row = r0 + r, f = feature(j);
        if (row >= M) continue;
        float sum = 0.f, other = 0.f;  // other: the pair's other feature (ROPE, SWIGLU)
        for (int q = 0; q < GEMV_W; ++q) {
            sum += partial[q][t];
            if (ROPE || SWIGLU) other += partial[q][t ^ 1];
        }
        if (SWIGLU) {  // the pair's gate thread: silu(gate) * up
            if (j & 1) continue;
            const float g = static_cast<float>(static_cast<T>(sum)), u = static_cast<float>(static_cast<T>(other));
            const float sig = static_cast<float>(static_cast<T>(1.f / (1.f + expf(-g))));
            const float act = static_cast<float>(static_cast<T>(g * sig));
            out[(size_t)row * (N / 2) + f] = static_cast<T>(act * u);
            continue;
        }
        if (!ROPE) {
            const size_t at = (size_t)row * N + f;
            // RES: + res, rounded as MLX's add of the rounded product and res
            out[at] = RES ? static_cast<T>(static_cast<float>(static_cast<T>(sum)) + static_cast<float>(res[at]))
                          : static_cast<T>(sum);
            continue;
        }
ROPE_EPILOGUE
    }
"""
# ROPE's epilogue, in a build of its own (`_GEMV_ROPE_SOURCE`): the other builds keep
# their five inputs, since each input costs the host a little at every launch
_GEMV_ROPE_EPILOGUE = """        float y = static_cast<float>(static_cast<T>(sum));  // the product, rounded
""" + ROPE_STORE.replace("PAIR", "static_cast<float>(static_cast<T>(other))")
_GEMV_SOURCE = _GEMV_BODY.replace("ROPE_EPILOGUE", "")
_GEMV_ROPE_SOURCE = _GEMV_BODY.replace("ROPE_EPILOGUE", _GEMV_ROPE_EPILOGUE)
GEMV_WARPS = 4  # warps per block, splitting K between them
# the GEMV's nibbles made floats by the bits of 2^23 + q (MAGIC) instead of I2F, which
# sm_90 runs at 16 per SM and clock against 128 FMAs: at one row each weight costs a
# conversion and two FMAs, so an 8B token's ~7G conversions alone would take ~1.7 ms at
# 1.98 GHz on 132 SMs, where its 4-bit GEMVs took 2.4 ms of GPU time in session 18
# (tools/results/gpu/session18/c-probe8b). 76 registers against 63 at one row (NVRTC).
# On an H200 in session 19 (tools/results/gpu/session19/b-probe) slower: the 8B gate/up
# GEMV 1,240 against 1,155 us per token, so the conversions are not what bounds it: off.
GEMV_MAGIC_NIBBLES = False
GEMV_FEATURES = 4  # output features per block, each weight word read once for all rows
GEMV_PASS_ROWS = 16  # rows per pass at most (registers: a thread keeps rows x features sums)
# iterations of a thread's loop over K per pass, unrolled: with fewer warps per block
# (GEMV_WARPS 1 or 2) a thread walks 4 or 2 of a K = 4096 row's 16-byte loads per
# feature, and unrolled their loads can all be in flight at once, as with 4 warps, without
# the block's shared-memory reduction after every few loads. 1: one iteration per pass
# (the default; the others not yet run on a GPU: tools/probe_cuda.py's -w1-u4, -w2-u2)
GEMV_UNROLL = 1
# each thread's weight loads: 16 bytes (32 weights) per feature and load, or 4 (one word)
# without GEMV_WIDE_LOADS. One 8B-shape 4-bit token on an H200 (CUPTI, the engine's
# runner): the GEMV's 4096-wide calls 2,490 -> 2,162 us, 14336-wide 749 -> 595 us, the
# token's GPU time 5.43 -> 4.96 ms (tools/results/gpu/session9/a-kernels)
GEMV_WIDE_LOADS = True
# blocks.py's 4-bit blocks add their residuals inside the GEMV (`res`): 2 of a block's
# kernels fewer per one-row token (an 8B token's 64 adds: 827 -> 763 primitives, 4.94 ->
# 4.34 ms in the runner on an H200, tools/results/gpu/session17/a-probe). On since session 17.
GEMV_RESIDUAL = True
# blocks.py's 4-bit blocks rotate q and k inside the q/k/v GEMV and write k and v into the
# pool from it (`gemv_rope`), where the paged kernel reads them back: an 8B one-row token's
# 32 RoPE kernels, 32 pool writes and ~190 views fewer. On since session 18.
GEMV_ROPE = True
# and their gate/up GEMV gives silu(gate) * up itself (`gemv_swiglu`): 32 SwiGLU kernels
# and 32 splits fewer per 8B one-row token. On since session 18: with GEMV_ROPE, 4.02 ->
# 3.30 ms per 8B one-row token in the runner on an H200, 348 -> 252 kernels
# (tools/results/gpu/session18/c-probe8b).
GEMV_SWIGLU = True


def gemv_launch(rows: int, n: int, k: int, group_size: int, res: bool = False,
                rope: dict[str, int] | None = None) -> tuple[dict[str, int], int]:
    """The GEMV kernel's integer template parameters and block count for x [rows, k]
    against n output features: rows per pass rounded up to a power of two (few builds).
    `rope`: ROPE's parameters (ROPE, HD, QN, KN, TRAD, POOL; see _GEMV_BODY)."""
    per_pass = 1 << (min(rows, GEMV_PASS_ROWS) - 1).bit_length()
    constants = {"K": k, "GS": group_size, "MT": per_pass, "GEMV_W": GEMV_WARPS, "GEMV_F": GEMV_FEATURES,
                 "GEMV_U": GEMV_UNROLL, "GEMV_WPL": 4 if GEMV_WIDE_LOADS else 1, "MAGIC": int(GEMV_MAGIC_NIBBLES), "RES": int(res),
                 "SWIGLU": 0, **(rope or {"ROPE": 0, "HD": 2, "QN": 0, "KN": 0, "TRAD": 0, "POOL": 0})}
    return constants, -(-rows // per_pass) * -(-n // GEMV_FEATURES)


def _affine_4bit(layer: nn.Module, x: mx.array, features_multiple: int) -> bool:
    """What both 4-bit kernels take: 4-bit affine weights with biases, scale groups of a
    multiple of 32 that divide k, output features a multiple of `features_multiple`, x
    not empty and in the scales' dtype."""
    return (layer.bits == 4 and layer.mode == "affine" and layer.group_size % 32 == 0
            and x.shape[-1] % layer.group_size == 0 and layer["weight"].shape[0] % features_multiple == 0
            and x.size > 0 and x.dtype == layer["scales"].dtype and "biases" in layer)


def gemv_applies(layer: nn.Module, x: mx.array) -> bool:
    """Shapes and formats the GEMV kernel takes: those of _affine_4bit, output features a
    multiple of GEMV_FEATURES."""
    return _affine_4bit(layer, x, GEMV_FEATURES)


def gemv(x: mx.array, w: mx.array, scales: mx.array, biases: mx.array, group_size: int,
         res: mx.array | None = None) -> mx.array:
    """x @ dequantize(w)^T through the GEMV kernel: x [..., K] -> [..., N]; with `res`
    ([..., N], x's dtype), res + that, the add inside the kernel (one kernel fewer)."""
    launch = functools.partial(gemv_launch, res=res is not None)
    return _run_kernel("unikern_q4_gemv", _GEMV_SOURCE, "", launch, GEMV_WARPS, x, w, scales, biases, group_size,
                       res=res if res is not None else placeholder(x.dtype))


def gemv_rope(x: mx.array, layer: nn.Module, pos: mx.array, freq_pi: mx.array, q_features: int, head_dim: int,
              traditional: bool, pool: tuple[mx.array, mx.array, mx.array] | None = None) -> mx.array:
    """A 4-bit q/k/v projection (w's rows q, then k, then v) with RoPE in the GEMV: x
    [rows, K] -> [rows, N], q and k rotated for the rows' positions (`pos`, int32 [rows];
    `freq_pi`: RoPE's inverse frequencies over pi, float32 [head_dim / 2]). With `pool`
    (k_pool, v_pool, slots: a layer's pool arrays [kv heads, slots, head_dim] and each
    row's slot), k and v go there in place and the result is q alone, [rows, heads, 1,
    head_dim]; whatever reads the pool back must take q (blocks.py's paged kernel does)."""
    rows, k, n = x.shape[0], x.shape[-1], layer["weight"].shape[0]
    rope = {"ROPE": 1, "HD": head_dim, "QN": q_features, "KN": (n - q_features) // 2, "TRAD": int(traditional),
            "POOL": int(pool is not None)}
    constants, blocks = gemv_launch(rows, n, k, layer.group_size, rope=rope)
    k_pool, v_pool, slots = pool if pool is not None else (placeholder(x.dtype),) * 2 + (placeholder(mx.int32),)
    shape = (rows, q_features // head_dim, 1, head_dim) if pool is not None else (rows, n)
    return rows_kernel("unikern_q4_gemv", _GEMV_ROPE_SOURCE, "", constants, blocks, GEMV_WARPS, x, layer["weight"],
                       scales=layer["scales"], biases=layer["biases"], out_shape=shape, res=placeholder(x.dtype),
                       pos=pos, freq_pi=freq_pi, k_pool=k_pool, v_pool=v_pool, slots=slots)


def gemv_swiglu(x: mx.array, layer: nn.Module) -> mx.array:
    """A 4-bit gate/up projection (w's rows gate, then up) with SwiGLU in the GEMV: x
    [rows, K] -> silu(gate) * up, [rows, N / 2], one kernel."""
    rows, k, n = x.shape[0], x.shape[-1], layer["weight"].shape[0]
    constants, blocks = gemv_launch(rows, n, k, layer.group_size)
    constants["SWIGLU"] = 1
    return rows_kernel("unikern_q4_gemv", _GEMV_SOURCE, "", constants, blocks, GEMV_WARPS, x, layer["weight"],
                       scales=layer["scales"], biases=layer["biases"], out_shape=(rows, n // 2),
                       res=placeholder(x.dtype))


def epilogue_gemv_applies(layer: nn.Module, x: mx.array, setting: bool) -> bool:
    """Where blocks.py's 4-bit blocks take `gemv_rope` (setting GEMV_ROPE) or
    `gemv_swiglu` (GEMV_SWIGLU): a routed layer without a bias whose step of x's rows
    goes through the GEMV kernel."""
    return setting and isinstance(layer, RowRouting) and "bias" not in layer and takes_gemv(layer, x)


def takes_gemv(layer: nn.Module, x: mx.array) -> bool:
    """Whether a routed layer's step of x's rows goes through the GEMV kernel (_matmul's
    routing): fewer rows than `dequantize_rows`, not the tensor-core kernel's, the GEMV
    on and taking the shapes."""
    rows = x.size // x.shape[-1] if x.ndim else 1
    return (rows < layer.dequantize_rows and not (layer.mma and rows > GEMV_ROWS and mma_applies(layer, x))
            and layer.gemv and gemv_applies(layer, x))


def _run_kernel(name: str, source: str, header: str, launch: Any, warps: int, x: mx.array, w: mx.array,
                scales: mx.array, biases: mx.array, group_size: int, **extra: mx.array) -> mx.array:
    """One of the 4-bit kernels over x [..., K] -> [..., N]: `launch` gives its template
    constants and block count, blocks of `warps` warps; `extra` inputs after the biases."""
    constants, blocks = launch(x.size // x.shape[-1], w.shape[0], x.shape[-1], group_size)
    return rows_kernel(name, source, header, constants, blocks, warps, x, w, scales=scales, biases=biases, **extra)


def rows_kernel(name: str, source: str, header: str, constants: dict[str, int], blocks: int, warps: int,
                x: mx.array, w: mx.array, out_shape: tuple[int, ...] | None = None, **extra: mx.array) -> mx.array:
    """A kernel over the rows of x [..., K] and weights w [N, ...] (and the `extra` inputs,
    by name, after them): `blocks` blocks of `warps` warps, x's dtype as T and `constants`
    as its template; returns [..., N], or the output as `out_shape` gives it."""
    k, n = x.shape[-1], w.shape[0]
    rows = x.size // k
    (out,) = cuda_kernel(name, ("x", "w", *extra), source, header)(
        inputs=[x.reshape(rows, k), w, *extra.values()],
        template=[("T", x.dtype), *constants.items()],
        grid=(blocks * warps * 32, 1, 1),
        threadgroup=(warps * 32, 1, 1),
        output_shapes=[out_shape or (rows, n)],
        output_dtypes=[x.dtype],
    )
    return out if out_shape else out.reshape(*x.shape[:-1], n)


# A tensor-core kernel for 4-bit affine weights and bfloat16 rows, for steps of more rows
# than the GEMV's (execute.quantized_mma): mma.sync m16n8k16 (bf16 in, float32 sums). A
# block of MMA_W warps computes 8*NT output features for up to 16*RT rows (a pass), its
# warps splitting K in 64-wide chunks. Thread (g = lane/4, t = lane%4) reads two packed
# words of feature g (16 nibbles, k 16t..16t+15 of the chunk, one scale group) and turns
# them into the B fragments of the chunk's four k-steps. A k-step's 16 positions may be
# any 16 of the chunk as long as A and B agree: the fragment slots that thread t owns
# (k 2t, 2t+1, 2t+8, 2t+9 of the step) take its own k 16t+4s..16t+4s+3, so no thread needs
# another's nibbles, and its A fragments come from two 16-byte loads per row. Sums meet
# across the warps in shared memory. With SPLIT, each dequantized weight goes in as two
# bf16 halves (the value rounded, then what rounding lost) through two MMAs: the weights
# as exact as float32's, as MLX's one-row kernel has them, where one bf16 rounds them to
# 8 bits of mantissa. Helpers (MMA_HEADER): unikern_load8 (8 bf16 as 4 pairs),
# unikern_pack (two floats to a bf16 pair), unikern_half (one half of a pair back as a
# float), unikern_mma (the instruction); tests/cuda_emulation.py gives C++ versions of
# the four for its CPU run.
MMA_HEADER = """
__device__ inline void unikern_load8(const __nv_bfloat16* p, unsigned r[4]) {
    const uint4 v = *reinterpret_cast<const uint4*>(p);
    r[0] = v.x; r[1] = v.y; r[2] = v.z; r[3] = v.w;
}
__device__ inline unsigned unikern_pack(float lo, float hi) {
    __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
    return *reinterpret_cast<unsigned*>(&v);
}
__device__ inline float unikern_half(unsigned p, int high) {
    const __nv_bfloat162 v = *reinterpret_cast<const __nv_bfloat162*>(&p);
    return high ? __high2float(v) : __low2float(v);
}
__device__ inline void unikern_mma(float d[4], const unsigned a[4], const unsigned b[2]) {
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 "
                 "{%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};"
                 : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
}
"""
# The kernel's body with its B fragments' loads left out (MMA_LOAD_B): the 4-bit weights'
# here, bfloat16 weights' in dense_mma.py. A load fills bf[NT][4][2], tile nt's k-step st
# for the thread's feature g: the bf16 pairs of k 16t+4st+2h, +1 of the chunk (h = 0, 1),
# and with SPLIT lost[NT][4][2].
MMA_TEMPLATE = """
    constexpr int CHUNKS = K / 64;
    const int N = w_shape[0];
    const int M = x_shape[0];
    const int warp = threadIdx.x / 32;
    const int lane = threadIdx.x % 32;
    const int g = lane / 4;
    const int t = lane % 4;
    const int passes = (M + 16 * RT - 1) / (16 * RT);
    const int r0 = (blockIdx.x % passes) * 16 * RT;
    const int n0 = (blockIdx.x / passes) * 8 * NT;  // NT tiles of 8 features
    if (n0 >= N) return;  // the whole block
    float acc[RT][NT][4];
    #pragma unroll
    for (int rt = 0; rt < RT; ++rt)
        for (int nt = 0; nt < NT; ++nt)
            for (int i = 0; i < 4; ++i) acc[rt][nt][i] = 0.f;
    for (int c = warp; c < CHUNKS; c += MMA_W) {
        unsigned bf[NT][4][2];  // tile nt, k-step st: the thread's k 4st..4st+3 as two pairs
        unsigned lost[NT][4][2];  // with SPLIT: what rounding them to bf16 lost
MMA_LOAD_B
        #pragma unroll
        for (int rt = 0; rt < RT; ++rt) {
            const int ra = r0 + rt * 16 + g;
            unsigned xa[8], xb[8];  // rows ra and ra + 8, k 16t..16t+15 of the chunk, as pairs
            for (int i = 0; i < 8; ++i) { xa[i] = 0u; xb[i] = 0u; }
            const size_t col = (size_t)c * 64 + 16 * t;
            if (ra < M) {
                unikern_load8(x + (size_t)ra * K + col, xa);
                unikern_load8(x + (size_t)ra * K + col + 8, xa + 4);
            }
            if (ra + 8 < M) {
                unikern_load8(x + (size_t)(ra + 8) * K + col, xb);
                unikern_load8(x + (size_t)(ra + 8) * K + col + 8, xb + 4);
            }
            #pragma unroll
            for (int st = 0; st < 4; ++st) {
                const unsigned a[4] = {xa[2 * st], xb[2 * st], xa[2 * st + 1], xb[2 * st + 1]};
                #pragma unroll
                for (int nt = 0; nt < NT; ++nt) {  // one A fragment for every tile
                    unikern_mma(acc[rt][nt], a, bf[nt][st]);
                    if (SPLIT) unikern_mma(acc[rt][nt], a, lost[nt][st]);
                }
            }
        }
    }
    __shared__ float partial[MMA_W][RT * NT * 4][32];
    #pragma unroll
    for (int rt = 0; rt < RT; ++rt)
        for (int nt = 0; nt < NT; ++nt)
            for (int i = 0; i < 4; ++i) partial[warp][(rt * NT + nt) * 4 + i][lane] = acc[rt][nt][i];
    __syncthreads();
    for (int idx = threadIdx.x; idx < RT * NT * 4 * 32; idx += blockDim.x) {
        const int slot = idx / 32;  // (rt * NT + nt) * 4 + i
        const int ln = idx % 32;
        const int i = slot % 4;
        const int nt = (slot / 4) % NT;
        const int row = r0 + (slot / (4 * NT)) * 16 + ln / 4 + (i >= 2 ? 8 : 0);
        if (row >= M) continue;
        float sum = 0.f;
        for (int q = 0; q < MMA_W; ++q) sum += partial[q][slot][ln];
        out[(size_t)row * N + n0 + nt * 8 + 2 * (ln % 4) + (i % 2)] = static_cast<T>(sum);
    }
"""
_Q4_LOAD_B = """
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
"""
_MMA_SOURCE = MMA_TEMPLATE.replace("MMA_LOAD_B\n", _Q4_LOAD_B.lstrip("\n"))
MMA_PASS_TILES = 4  # 16-row tiles per pass at most (64 rows), sharing each B fragment
# the block's shape, (warps splitting K, tiles of 8 output features per warp). "narrow"
# (4, 1): a 64-row step's 4096-wide calls took 65 us each, every block reading all of x
# from L2 (512 KB at 64 rows; 512 blocks), ~270 MB per call. "wide" (8, 2) reads x once
# per 16 features, with as many warps in flight: on an H200, a 64-row step of the 8B
# shape 14.6 -> 11.3 ms, its 4096-wide calls 12.6 -> 8.1 ms (session9/a-kernels)
MMA_SHAPES = {"narrow": (4, 1), "wide": (8, 2)}
MMA_SHAPE = "wide"
GEMV_ROWS = 8  # with both kernels on, the GEMV keeps steps of up to this many rows


def mma_launch(rows: int, n: int, k: int, group_size: int, split: bool = False) -> tuple[dict[str, int], int]:
    """The tensor-core kernel's template parameters and block count for x [rows, k]
    against n output features: 16-row tiles per pass 1, 2 or 4, the block's shape
    (MMA_SHAPE); `split`: the weights in two bf16 halves."""
    tiles = 1 << (min(-(-rows // 16), MMA_PASS_TILES) - 1).bit_length()
    warps, n_tiles = MMA_SHAPES[MMA_SHAPE]
    constants = {"K": k, "GS": group_size, "RT": tiles, "NT": n_tiles, "MMA_W": warps, "SPLIT": int(split)}
    return constants, -(-rows // (16 * tiles)) * (n // (8 * n_tiles))


def mma_applies(layer: nn.Module, x: mx.array) -> bool:
    """What the tensor-core kernel takes: those of _affine_4bit, output features a
    multiple of the block's (8 per tile), k a multiple of 64, bfloat16 rows."""
    return (_affine_4bit(layer, x, 8 * MMA_SHAPES[MMA_SHAPE][1]) and x.shape[-1] % 64 == 0
            and x.dtype == mx.bfloat16)


def mma(x: mx.array, w: mx.array, scales: mx.array, biases: mx.array, group_size: int,
        split: bool = False) -> mx.array:
    """x @ dequantize(w)^T through the tensor-core kernel: x [..., K] -> [..., N]; `split`:
    float32-exact weights through two MMAs."""
    launch = functools.partial(mma_launch, split=split)
    return _run_kernel("unikern_q4_mma", _MMA_SOURCE, MMA_HEADER, launch, MMA_SHAPES[MMA_SHAPE][0], x, w, scales,
                       biases, group_size)


def _matmul(layer: nn.Module, x: mx.array) -> mx.array:
    """x @ layer's weights^T, without its bias. Below `layer.dequantize_rows` rows: the
    tensor-core kernel above GEMV_ROWS rows when `layer.mma`, else the GEMV when
    `layer.gemv`, else MLX's quantized kernel (each where it applies); from there, the
    dequantized weights (in x's dtype, a transient array) where x's dtype is one of
    `layer.dequantize_dtypes` (None: any), else MLX's kernel too."""
    rows = x.size // x.shape[-1] if x.ndim else 1
    w, scales, biases = layer["weight"], layer["scales"], layer.get("biases")
    dtypes = layer.dequantize_dtypes
    if rows < layer.dequantize_rows or (dtypes is not None and x.dtype not in dtypes):
        if layer.mma and rows > GEMV_ROWS and mma_applies(layer, x):
            return mma(x, w, scales, biases, layer.group_size, split=layer.mma_split)
        if takes_gemv(layer, x):
            return gemv(x, w, scales, biases, layer.group_size)
        return mx.quantized_matmul(x, w, scales=scales, biases=biases, transpose=True, group_size=layer.group_size,
                                   bits=layer.bits, mode=layer.mode)
    return x @ mx.dequantize(w, scales, biases, group_size=layer.group_size, bits=layer.bits, mode=layer.mode,
                             dtype=x.dtype).T


class RowRouting:
    """The settings route_quantized_layers gives each routed layer (read by _matmul)."""

    dequantize_rows: int
    # the activations' dtypes dequantized (None: any); a frozenset, since nn.Module keeps
    # tuples among its parameters
    dequantize_dtypes: frozenset[mx.Dtype] | None = None
    gemv: bool = False  # steps of few rows through the GEMV kernel above
    mma: bool = False  # and of more than GEMV_ROWS through the tensor-core kernel
    mma_split: bool = False  # its weights as two bf16 halves each (float32-exact)


class RowRoutedQuantizedLinear(RowRouting, nn.QuantizedLinear):
    """An affine `nn.QuantizedLinear` that, for inputs of at least `dequantize_rows` rows,
    expands its weights to the activations' dtype (a transient array, one layer at a
    time) and runs a plain matmul; fewer rows keep MLX's quantized kernel. The parameters
    are the same arrays, so pinning, identity and memory use do not change."""

    def __call__(self, x: mx.array) -> mx.array:
        y = _matmul(self, x)
        return y + self["bias"] if "bias" in self else y

    def plus(self, x: mx.array, res: mx.array) -> mx.array:
        """res + self(x), the same values: inside the GEMV kernel where it takes the step
        (GEMV_RESIDUAL, no bias, res of x's rows and dtype), else the add after it."""
        if (GEMV_RESIDUAL and "bias" not in self and takes_gemv(self, x)
                and res.dtype == x.dtype and res.size == x.size // x.shape[-1] * self["weight"].shape[0]):
            return gemv(x, self["weight"], self["scales"], self.get("biases"), self.group_size, res=res)
        return res + self(x)


class RowRoutedAllToSharded(RowRouting, QuantizedAllToShardedLinear):
    """mlx-lm's tensor-parallel shard of a quantized layer (columns), routed the same way."""

    def __call__(self, x: mx.array) -> mx.array:
        y = _matmul(self, sum_gradients(self.group)(x))
        return y + self["bias"] if "bias" in self else y


class RowRoutedShardedToAll(RowRouting, QuantizedShardedToAllLinear):
    """mlx-lm's tensor-parallel shard of a quantized layer (rows, summed across ranks)."""

    def __call__(self, x: mx.array) -> mx.array:
        y = mx.distributed.all_sum(_matmul(self, x), group=self.group)
        return y + self["bias"] if "bias" in self else y


ROUTED = {nn.QuantizedLinear: RowRoutedQuantizedLinear, QuantizedAllToShardedLinear: RowRoutedAllToSharded,
          QuantizedShardedToAllLinear: RowRoutedShardedToAll}


def route_quantized_layers(model: Any, rows: int | None, gemv: bool = False, mma: bool = False,
                           mma_split: bool = False, dtypes: tuple[str, ...] | None = None) -> int:
    """Give every affine quantized linear layer of `model` (plain, or a tensor-parallel
    shard) the row-routed call: dequantized weights from `rows` rows (None: never) for
    activations of `dtypes` (names, as AUTO_DTYPES; None: any), and below that the GEMV
    kernel (`gemv`) and the tensor-core kernel (`mma`, with the weights in two bf16
    halves when `mma_split`) where they apply. Returns how many layers were routed (0
    when nothing is asked for or the model is not quantized)."""
    if rows is None and not gemv and not mma:
        return 0
    routed = 0
    for _, module in model.named_modules():
        if type(module) in ROUTED and module.mode == "affine":
            module.__class__ = ROUTED[type(module)]
        if type(module) in ROUTED.values():  # routed now, or by an earlier call
            module.dequantize_rows = rows if rows is not None else 1 << 62
            module.dequantize_dtypes = None if dtypes is None else frozenset(getattr(mx, name) for name in dtypes)
            module.gemv, module.mma, module.mma_split = gemv, mma, mma_split
            routed += 1
    return routed
