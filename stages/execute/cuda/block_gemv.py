"""The GEMV kernel of a fused decoder block's steps (stages/execute/blocks.py;
block_gemv.cu): one output pair per warp (or SPLIT warps), with the RMS norm before it and
the residual add, RoPE or SwiGLU after it, for steps of up to MAX_ROWS rows; its CUDA
source runs in the tests' emulation (tests/test_decode_blocks.py) and compiles for sm_90
with NVRTC (tools/device/nvrtc_check.py)."""

from __future__ import annotations

import mlx.core as mx

from unikern.platform.kernel_cache import cuda_kernel, float_bits, off_small_pool, placeholder
from unikern.stages.execute.cuda import sources

WARPS = 8  # per block of the kernel: WARPS / SPLIT output pairs (split_for)
UNROLL = 2  # 16-byte chunks per lane in flight per weight row and pass: 40-48 registers, many warps per SM
MAX_ROWS = 4  # steps of more rows run the family's own code (MLX's GEMM)
# warps per output pair (split_for): more while the grid has fewer blocks than this (two
# per SM of an H200) and each lane keeps at least MIN_LOADS chunks per row. (MLX's own
# GEMV gives a warp one row and keeps few loads in flight per lane, 8 bytes each, with
# many warps per SM; UNROLL = 1 comes nearest that: tools/probe/probe_cuda.py's
# engine-paged-blocks-u1.)
TARGET_BLOCKS = 264
MIN_LOADS = 4

ITEMSIZE = {mx.float32: 4, mx.bfloat16: 2, mx.float16: 2}
# epilogues
PLAIN, RESIDUAL, ROPE, SWIGLU = 0, 1, 2, 3

# the kernel's loads: 16 bytes of a row as floats (unpack.cuh; for the tests' emulation,
# unpack_emulation.h)
HEADER = sources.text("unpack.cuh")
EMULATED_HEADER = sources.text("unpack_emulation.h")
# Each warp issues its first weight loads, then (with NORM) sums the squares of the whole
# row itself and normalizes x as it multiplies: no block-wide barrier before the multiply.
# (The first version staged the normalized rows in shared memory, with two barriers per
# block: on an H200 its q/k/v GEMV ran at 0.55 TB/s and its gate/up at 1.8, against MLX's
# GEMV's 3.2 over the token; CUPTI, tools/probe/probe_cuda.py's engine-paged-blocks.)
SOURCE = sources.text("block_gemv.cu")
_INPUTS = ("x", "w", "bias", "norm_w", "res", "pos", "freq_pi", "k_pool", "v_pool", "slots", "ss",
           "counter")
_OUTPUTS = ("out", "out_k", "out_v", "out_ss", "out_part")


def counter() -> mx.array:
    """A zero counter for one call site's `hand_ss` (uint32; its first element counts
    the blocks done). In device memory: in MLX's pool of small arrays every block's
    atomic crossed the bus (kernel_cache.SMALL_POOL_BYTES)."""
    return mx.zeros((off_small_pool(1, 4),), dtype=mx.uint32)


def split_for(K: int, N: int, dtype: mx.Dtype) -> int:
    """Warps per output pair of the kernel over w [N, K] (see TARGET_BLOCKS): a power of
    two, at most WARPS."""
    chunks = K * ITEMSIZE[dtype] // 16
    split = 1
    while (split < WARPS and (N // 2) * split < TARGET_BLOCKS * WARPS
           and chunks // (2 * split) >= 32 * MIN_LOADS):
        split *= 2
    return split


def gemv(x: mx.array, w: mx.array, mode: int, bias: mx.array | None = None,
         norm: tuple[mx.array, mx.array] | None = None, res: mx.array | None = None,
         pos: mx.array | None = None, freq_pi: mx.array | None = None, head_dim: int = 0,
         rope_pairs: int = 0, q_features: int = 0, traditional: bool = False,
         out_shape: tuple[int, ...] | None = None,
         pool: tuple[mx.array, mx.array, mx.array] | None = None, ss: mx.array | None = None,
         hand_ss: mx.array | None = None) -> mx.array | list[mx.array] | tuple[mx.array, mx.array]:
    """The kernel over x [rows, K] and w [N, K] (see block_gemv.cu): its output, or for ROPE [q, k,
    v] (q_features of q, the rest halved between k and v). norm: (weight, eps, a float: a
    template argument, not an array read by every warp); freq_pi: RoPE's inverse frequencies
    over pi. x may be any contiguous [rows, ...] array of rows x K elements, and the output
    is given the shape the caller reads it in (`out_shape`; for ROPE, [rows, heads, 1,
    head_dim] each): the kernel reads and writes flat rows, so no reshape node is added on
    either side (each costs the host about 1 us per token and layer on an H200:
    tools/probe/probe_ops.py).
    pool (ROPE): (k_pool, v_pool, slots), a layer's pool arrays [kv heads, slots, head_dim]
    and each row's slot (int32 [rows]): k and v are written there in place, not returned
    (their outputs are placeholders), in place of two scatters per layer. The arrays must be
    the pool's own contiguous ones (the kernel writes into their buffers; MLX would copy a
    strided input and the write would go to the copy), and whatever reads them back must
    depend on q (the paged attention kernel takes q) so MLX orders it after this kernel.
    hand_ss (RESIDUAL): a uint32 counter (`counter()`), zero, kept for this call site (the
    kernel leaves it zero): returns (out, ss), ss the rows' sums of squares of the outputs
    as rounded (float32, its first `rows` elements; longer where one row's would lie in
    MLX's pool of small arrays, kernel_cache.SMALL_POOL_BYTES), added in a fixed order, so
    the same every run, for the next kernel's norm. ss (with norm): those sums, so the
    kernel does not add the row's squares itself: the RMS norm of x with no kernel of its
    own and no warp reading the whole row first (execute.fuse_blocks' KERNEL_NORM = 2)."""
    rows, K = x.shape[0], w.shape[1]
    if x.size != rows * K:
        raise ValueError(f"the block kernel's input must hold {rows} rows of {K}, not shape {x.shape}")
    if rows > MAX_ROWS:
        raise ValueError(f"the block kernel takes up to {MAX_ROWS} rows, not {rows}")
    N = w.shape[0]
    f32 = placeholder(mx.float32)
    nout = N // 2 if mode == SWIGLU else q_features if mode == ROPE else N
    split = split_for(K, N, x.dtype)
    template = [("T", x.dtype), ("K", K), ("N", N), ("NOUT", nout), ("ROWS", 1 << (rows - 1).bit_length()),
                ("WARPS", WARPS), ("SPLIT", split), ("U", UNROLL), ("NORM", int(norm is not None)),
                ("BIAS", int(bias is not None)), ("MODE", mode), ("HD", head_dim or 2), ("ROPE_PAIRS", rope_pairs),
                ("QN", q_features if mode == ROPE else N), ("TRAD", int(traditional)), ("POOL", int(pool is not None)),
                ("SSI", int(ss is not None)), ("SSO", int(hand_ss is not None)),
                ("EPS", float_bits(norm[1]) if norm else 0)]
    inputs = [x, w, bias if bias is not None else placeholder(x.dtype),
              norm[0] if norm else placeholder(x.dtype),
              res if res is not None else placeholder(x.dtype),
              pos if pos is not None else placeholder(mx.int32), freq_pi if freq_pi is not None else f32,
              *(pool if pool is not None else (placeholder(x.dtype), placeholder(x.dtype), placeholder(mx.int32))),
              ss if ss is not None else f32, hand_ss if hand_ss is not None else placeholder(mx.uint32)]
    if (ss is not None and norm is None) or (hand_ss is not None and mode != RESIDUAL):
        raise ValueError("the block kernel takes handed sums of squares with a norm, and hands them from RESIDUAL "
                         f"steps (mode {mode}, norm {norm is not None}, ss {ss is not None}, hand_ss "
                         f"{hand_ss is not None})")
    if pool is not None and (mode != ROPE or pool[0].dtype != x.dtype or pool[0].shape[-1] != head_dim):
        raise ValueError(f"the block kernel writes the pool from ROPE steps of its dtype and head_dim only: mode "
                         f"{mode}, pool {pool[0].dtype} {pool[0].shape}, input {x.dtype}, head_dim {head_dim}")
    kv = (N - q_features) // 2
    if mode == ROPE:
        shapes = [(rows, nout // head_dim, 1, head_dim)] + [(1,) if pool else (rows, kv // head_dim, 1, head_dim)] * 2
    else:
        shapes = [out_shape or (rows, nout), (1,), (1,)]
    blocks = -(-(N // 2) // (WARPS // split))
    shapes += [(off_small_pool(rows, 4),), (rows, blocks)] if hand_ss is not None else [(1,), (1,)]
    kernel = cuda_kernel("unikern_block_gemv", _INPUTS, SOURCE, HEADER, _OUTPUTS)
    outs = kernel(inputs=inputs, template=template, grid=(blocks * WARPS * 32, 1, 1), threadgroup=(WARPS * 32, 1, 1),
                  output_shapes=shapes, output_dtypes=[x.dtype] * 3 + [mx.float32] * 2)
    if hand_ss is not None:
        return outs[0], outs[3]
    return list(outs[:3]) if mode == ROPE else outs[0]
