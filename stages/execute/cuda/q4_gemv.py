"""A GEMV for 4-bit affine weights, for steps of few rows (execute.quantized_gemv;
q4_gemv.cu): each weight word read and dequantized once for up to GEMV_PASS_ROWS rows.
Variants in one text: with the residual added (RES), with RoPE on q and k and k and v
written into the pool (ROPE, q4_gemv_rope.cu), with SwiGLU on gate and up (SWIGLU).
quantized.py routes a quantized layer's rows through it."""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn

from unikern.platform.kernel_cache import placeholder
from unikern.stages.execute.cuda import sources
from unikern.stages.execute.cuda.weight_kernels import rows_kernel

SOURCE = sources.fill(sources.text("q4_gemv.cu"), ROPE_EPILOGUE="\n")
# the ROPE build: rope_store.cu, its PAIR (the pair's other value) from the block's sums
ROPE_SOURCE = sources.fill(sources.text("q4_gemv.cu"), ROPE_EPILOGUE=sources.fill(
    sources.text("q4_gemv_rope.cu"), ROPE_STORE=sources.text("rope_store.cu")))
GEMV_WARPS = 4  # warps per block, splitting K between them
# the GEMV's nibbles made floats by the bits of 2^23 + q (MAGIC) instead of I2F, which
# sm_90 runs at 16 per SM and clock against 128 FMAs: at one row each weight costs a
# conversion and two FMAs, so an 8B token's ~7G conversions alone would take ~1.7 ms at
# 1.98 GHz on 132 SMs, where its 4-bit GEMVs took 2.4 ms of GPU time on an H200 (CUPTI,
# tools/probe/probe_cuda.py's engine-paged-q-blocks). 76 registers against 63 at one row
# (tools/device/nvrtc_check.py --ptxas). Slower on an H200 (engine-paged-q-blocks-magic): the 8B
# gate/up GEMV 1,240 against 1,155 us per token, so the conversions are not what bounds
# it: off.
GEMV_MAGIC_NIBBLES = False
# SUMS: a thread's 8 weights of a word summed as s * sum(x q) + b * sum(x) (MLX's Metal
# qmv's order), the nibbles made floats exactly by their bits where that float's ulp is 1
# (an AND/OR and a subtraction; no I2F and no per-weight dequantizing FMA): about 3.5
# instructions a weight at one row against 5 with one of them at an eighth of the FMA rate.
# At the 8B shapes on an H100 no faster in the shape below (a token's one-row GEMVs 3.01
# against 2.95 ms: the kernel waits on its loads), so off here; the one-row shapes take it
GEMV_SUMS = False
GEMV_FEATURES = 4  # output features per block, each weight word read once for all rows
GEMV_PASS_ROWS = 16  # rows per pass at most (registers: a thread keeps rows x features sums)
# iterations of a thread's loop over K per pass, unrolled: with fewer warps per block
# (GEMV_WARPS 1 or 2) a thread walks 4 or 2 of a K = 4096 row's 16-byte loads per
# feature, and unrolled their loads can all be in flight at once, as with 4 warps, without
# the block's shared-memory reduction after every few loads. 1: one iteration per pass
# (the default; one warp unrolled 4 times ran 1.8x slower a token at the 8B shapes, 2 warps
# twice is ONE_ROW_MANY below: q4-gemv-8b-h100-67eae58.json)
GEMV_UNROLL = 1
# each thread's weight loads: 16 bytes (32 weights) per feature and load, or 4 (one word)
# without GEMV_WIDE_LOADS. One 8B-shape 4-bit token on an H200 (CUPTI, the engine's
# runner, tools/probe/probe_cuda.py's engine-paged-qgemv against engine-paged-qgemv-wide): the
# GEMV's 4096-wide calls 2,490 -> 2,162 us, 14336-wide 749 -> 595 us, the token's GPU time
# 5.43 -> 4.96 ms
GEMV_WIDE_LOADS = True
# one-row steps (a lone request's decode) take a block shape by the weight's shape: at the
# 8B shapes on an H100 (tools/probe/bench_q4_gemv.py, q4-gemv-8b-h100-67eae58.json, kernel
# times) down's K of 14,336 ran in 22.7 us with 8 warps and the per-word sums against 26.9
# as above, gate/up's and the output head's N of 28,672 and 128,256 in 36.3 and 130 us with
# 2 warps and the loop unrolled twice against 38.5 and 152; the one-row GEMVs of a token
# 2.71 against 2.95 ms (estimated from those, not yet run through the engine). Steps of
# more rows keep the shape above: at 16 rows every other variant was slower.
GEMV_ONE_ROW_SHAPES = True
ONE_ROW_WIDE_K = 8192  # K from which a one-row step takes ONE_ROW_WIDE
ONE_ROW_MANY_N = 16384  # N from which it takes ONE_ROW_MANY
ONE_ROW_WIDE = {"GEMV_W": 8, "SUMS": 1}
ONE_ROW_MANY = {"GEMV_W": 2, "GEMV_U": 2, "SUMS": 1}


def one_row_shape(n: int, k: int) -> dict[str, int]:
    """The template constants a one-row step of an [n, k] weight takes over the defaults."""
    if not GEMV_ONE_ROW_SHAPES:
        return {}
    if k >= ONE_ROW_WIDE_K:
        return ONE_ROW_WIDE
    if n >= ONE_ROW_MANY_N:
        return ONE_ROW_MANY
    return {}


def gemv_launch(rows: int, n: int, k: int, group_size: int, res: bool = False,
                rope: dict[str, int] | None = None) -> tuple[dict[str, int], int]:
    """The GEMV kernel's integer template parameters and block count for x [rows, k]
    against n output features: rows per pass rounded up to a power of two (few builds),
    one-row steps shaped by `one_row_shape`; a block is GEMV_W warps.
    `rope`: ROPE's parameters (ROPE, HD, QN, KN, TRAD, POOL; see q4_gemv.cu)."""
    per_pass = 1 << (min(rows, GEMV_PASS_ROWS) - 1).bit_length()
    constants = {"K": k, "GS": group_size, "MT": per_pass, "GEMV_W": GEMV_WARPS, "GEMV_F": GEMV_FEATURES,
                 "GEMV_U": GEMV_UNROLL, "GEMV_WPL": 4 if GEMV_WIDE_LOADS else 1, "MAGIC": int(GEMV_MAGIC_NIBBLES),
                 "SUMS": int(GEMV_SUMS), "RES": int(res),
                 "SWIGLU": 0, **(rope or {"ROPE": 0, "HD": 2, "QN": 0, "KN": 0, "TRAD": 0, "POOL": 0})}
    if per_pass == 1:
        constants.update(one_row_shape(n, k))
    return constants, -(-rows // per_pass) * -(-n // GEMV_FEATURES)


def affine_4bit(layer: nn.Module, x: mx.array, features_multiple: int) -> bool:
    """What both 4-bit kernels (this and q4_mma's) take: 4-bit affine weights with
    biases, scale groups of a multiple of 32 that divide k, output features a multiple of
    `features_multiple`, x not empty and in the scales' dtype."""
    return (layer.bits == 4 and layer.mode == "affine" and layer.group_size % 32 == 0
            and x.shape[-1] % layer.group_size == 0 and layer["weight"].shape[0] % features_multiple == 0
            and x.size > 0 and x.dtype == layer["scales"].dtype and "biases" in layer)


def gemv_applies(layer: nn.Module, x: mx.array) -> bool:
    """Shapes and formats the GEMV kernel takes: those of affine_4bit, output features a
    multiple of GEMV_FEATURES."""
    return affine_4bit(layer, x, GEMV_FEATURES)


def gemv(x: mx.array, w: mx.array, scales: mx.array, biases: mx.array, group_size: int,
         res: mx.array | None = None) -> mx.array:
    """x @ dequantize(w)^T through the GEMV kernel: x [..., K] -> [..., N]; with `res`
    ([..., N], x's dtype), res + that, the add inside the kernel (one kernel fewer)."""
    constants, blocks = gemv_launch(x.size // x.shape[-1], w.shape[0], x.shape[-1], group_size, res=res is not None)
    return rows_kernel("unikern_q4_gemv", SOURCE, "", constants, blocks, constants["GEMV_W"], x, w, scales=scales,
                       biases=biases, res=res if res is not None else placeholder(x.dtype))


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
    return rows_kernel("unikern_q4_gemv", ROPE_SOURCE, "", constants, blocks, constants["GEMV_W"], x, layer["weight"],
                       scales=layer["scales"], biases=layer["biases"], out_shape=shape, res=placeholder(x.dtype),
                       pos=pos, freq_pi=freq_pi, k_pool=k_pool, v_pool=v_pool, slots=slots)


def gemv_swiglu(x: mx.array, layer: nn.Module) -> mx.array:
    """A 4-bit gate/up projection (w's rows gate, then up) with SwiGLU in the GEMV: x
    [rows, K] -> silu(gate) * up, [rows, N / 2], one kernel."""
    rows, k, n = x.shape[0], x.shape[-1], layer["weight"].shape[0]
    constants, blocks = gemv_launch(rows, n, k, layer.group_size)
    constants["SWIGLU"] = 1
    return rows_kernel("unikern_q4_gemv", SOURCE, "", constants, blocks, constants["GEMV_W"], x, layer["weight"],
                       scales=layer["scales"], biases=layer["biases"], out_shape=(rows, n // 2),
                       res=placeholder(x.dtype))
