"""A decoder block's decode step of few rows as four GEMV kernels (execute.fuse_blocks).

One token of the 1B shape on an H200 ran 242 kernels, 14 per block: the input norm, the
q/k/v GEMV, RoPE twice, two pool writes, the attention, the output GEMV, the residual
add, the second norm, the gate/up GEMV, SwiGLU, the down GEMV and the second add. MLX's
replay of the traced step costs the host about 7 us per kernel, so at one stream the
host, not the GPU, paced the token (1.69 ms against 1.20 ms of GPU time;
tools/results/gpu/H200-issue17.md, session 9). Here the block's steps of up to MAX_ROWS
rows and one token each run as

  1. RMS norm -> q/k/v GEMV -> RoPE on q and k   (one kernel; v as it comes)
  2. the pool writes and the decode attention     (the cache's own, unchanged)
  3. output GEMV -> + residual                    (one kernel)
  4. RMS norm -> gate/up GEMV -> SwiGLU           (one kernel)
  5. down GEMV -> + residual                      (one kernel)

so 7 kernels per block instead of 14. Each kernel gives one warp (or SPLIT warps, each
a share of the row) a pair of output features: two neighbours, or the two halves of a
RoPE rotation (features i and i + D/2 of a head, or 2i and 2i + 1 for the traditional
layout), or a gate feature and its up feature, so the epilogue has both values it
needs. The lanes stride over the row with 16-byte loads of both weight rows, issued
UNROLL at a time before any is used. Rounding follows MLX's ops: the matmul's output
rounded to the model's dtype before the epilogue, the norm's normalized value rounded
before its weight, each SwiGLU op rounded as mlx-lm's compiled `swiglu` rounds it.

Measured on an H200 (1B shape, one row; tools/results/gpu/session11/c-blocks-v2), the
first version took a token from 242 kernels to 134 but its GPU time from 1.17 to 1.62
ms: its GEMVs ran at half the speed of MLX's (see _SOURCE), so the option is off by
default; the kernel below is the second version, not yet measured.

Elsewhere (`use_kernel` False: MLX's CPU backend, the tests) the same five steps run as
the family's own ops (`mx.fast.rms_norm`, matmuls through the fused projections'
weights, the attention module's RoPE, mlx-lm's `swiglu`), so on a CPU a fused block
computes what the family's code does. Steps of more rows, or of several tokens
(prefill), run the family's own `__call__`. Families: BLOCKS (their attention and MLP
code is what the steps above repeat; tests/test_decode_blocks.py holds mlx-lm's source
to it), with q/k/v and gate/up fused (execute.fuse_projections), unquantized layers,
RoPE over the whole head (nn.RoPE or Llama3RoPE), one rank."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.activations import swiglu

from unikern.platform import cuda_is_default
from unikern.platform.kernel_cache import cuda_kernel
from unikern.stages.execute.routing import SDPA_NAME, layers_of, sdpa_module

# block classes (module, name) whose attention and MLP run as the steps above
BLOCKS = {
    ("mlx_lm.models.llama", "TransformerBlock"),
    ("mlx_lm.models.qwen2", "TransformerBlock"),
}

WARPS = 8  # per block of the kernel: WARPS / SPLIT output pairs (split_for)
UNROLL = 2  # 16-byte chunks per lane in flight per weight row and pass: 40-48 registers, many warps per SM
MAX_ROWS = 4  # steps of more rows run the family's own code (MLX's GEMM)
# warps per output pair (split_for): more while the grid has fewer blocks than this (two
# per SM of an H200) and each lane keeps at least MIN_LOADS chunks per row. (MLX's own
# GEMV gives a warp one row and keeps few loads in flight per lane, 8 bytes each, with
# many warps per SM; UNROLL = 1 comes nearest that: tools/probe_cuda.py's
# engine-paged-blocks-u1.)
TARGET_BLOCKS = 264
MIN_LOADS = 4

ITEMSIZE = {mx.float32: 4, mx.bfloat16: 2, mx.float16: 2}
# epilogues
PLAIN, RESIDUAL, ROPE, SWIGLU = 0, 1, 2, 3

# 16 bytes of a row as floats, by the row's dtype (MLX's custom kernels give T as
# float, __nv_bfloat16 or __half)
_HEADER = """
template <typename U> __device__ inline void unikern_unpack(const uint4& v, float* o);
template <> __device__ inline void unikern_unpack<float>(const uint4& v, float* o) {
    o[0] = __uint_as_float(v.x); o[1] = __uint_as_float(v.y);
    o[2] = __uint_as_float(v.z); o[3] = __uint_as_float(v.w);
}
template <> __device__ inline void unikern_unpack<__nv_bfloat16>(const uint4& v, float* o) {
    const __nv_bfloat162* h = reinterpret_cast<const __nv_bfloat162*>(&v);
    for (int i = 0; i < 4; ++i) {
        const float2 f = __bfloat1622float2(h[i]);
        o[2 * i] = f.x; o[2 * i + 1] = f.y;
    }
}
template <> __device__ inline void unikern_unpack<__half>(const uint4& v, float* o) {
    const __half2* h = reinterpret_cast<const __half2*>(&v);
    for (int i = 0; i < 4; ++i) {
        const float2 f = __half22float2(h[i]);
        o[2 * i] = f.x; o[2 * i + 1] = f.y;
    }
}
"""

# x [rows, K] (rows <= ROWS) against w [N, K]: out [rows, NOUT] (NOUT = N, or N / 2 for
# SWIGLU). NORM: x goes through the RMS norm (norm_w, eps) first. BIAS: w's bias. MODE:
# the epilogue (PLAIN, RESIDUAL: + res [rows, NOUT], ROPE: the first ROPE_PAIRS pairs
# rotated by pi * pos [rows] * freq_pi [HD / 2], and the features in three outputs:
# out [rows, QN] (q), out_k and out_v [rows, (N - QN) / 2], so each is contiguous;
# SWIGLU: silu(gate) * up, gate = features [0, N / 2), up = [N / 2, N)). A pair's K is
# split over SPLIT warps of the block, whose sums meet in shared memory. Each warp issues
# its first pass' weight loads first; with NORM it then sums the squares of the whole
# row itself (the row is a few KB, read from L2 by every warp) while they are in flight,
# and normalizes each 16 bytes of x as it multiplies them: no block-wide barrier before
# the multiply. (The first version staged the normalized rows in shared memory, with two
# barriers per block: on an H200 its q/k/v GEMV ran at 0.55 TB/s and its gate/up at
# 1.8, against MLX's GEMV's 3.2 over the token; tools/results/gpu/session11/c-blocks-v2.)
_SOURCE = """
    constexpr int PACK = 16 / sizeof(T);  // elements per 16-byte load
    constexpr int C = K / PACK;  // 16-byte chunks per row of w
    constexpr int PER = (C + SPLIT - 1) / SPLIT;  // chunks per warp of a pair
    const int warp = threadIdx.x / 32;
    const int lane = threadIdx.x % 32;
    const int rows = x_shape[0];
    const int p = blockIdx.x * (WARPS / SPLIT) + warp / SPLIT;  // this warp's pair of output features
    const bool live = p < N / 2;  // (no return before the block's barrier)
    int f0 = 2 * p, f1 = 2 * p + 1;
    if (MODE == 3) {
        f0 = p;
        f1 = p + N / 2;
    }
    if (MODE == 2 && p < ROPE_PAIRS) {
        const int head = p / (HD / 2), i = p % (HD / 2);
        f0 = TRAD ? head * HD + 2 * i : head * HD + i;
        f1 = TRAD ? f0 + 1 : f0 + HD / 2;
    }
    if (!live) f0 = f1 = 0;
    const uint4* w0 = reinterpret_cast<const uint4*>(w + (size_t)f0 * K);
    const uint4* w1 = reinterpret_cast<const uint4*>(w + (size_t)f1 * K);
    const int lo = (warp % SPLIT) * PER;
    const int hi = min(C, lo + PER);
    uint4 a[U], b[U];
    #pragma unroll
    for (int u = 0; u < U; ++u) {  // the first pass' loads, before anything waits
        const int c = lo + u * 32 + lane;
        if (live && c < hi) {
            a[u] = w0[c];
            b[u] = w1[c];
        }
    }
    float inv[ROWS];  // each row's 1 / rms (NORM)
    #pragma unroll
    for (int r = 0; r < ROWS; ++r) {
        float s = 0.f;
        if (NORM && live && r < rows) {
            const uint4* xr = reinterpret_cast<const uint4*>(x + (size_t)r * K);
            #pragma unroll 8
            for (int c = lane; c < C; c += 32) {
                float v[PACK];
                unikern_unpack<T>(xr[c], v);
                #pragma unroll
                for (int e = 0; e < PACK; ++e) s += v[e] * v[e];
            }
            for (int o = 16; o > 0; o >>= 1) s += __shfl_xor_sync(0xffffffff, s, o);
        }
        inv[r] = rsqrtf(s / K + eps[0]);
    }
    float acc0[ROWS], acc1[ROWS];
    for (int r = 0; r < ROWS; ++r) {
        acc0[r] = 0.f;
        acc1[r] = 0.f;
    }
    for (int c0 = lo; live && c0 < hi; c0 += 32 * U) {
        if (c0 != lo) {
            #pragma unroll
            for (int u = 0; u < U; ++u) {
                const int c = c0 + u * 32 + lane;
                if (c < hi) {
                    a[u] = w0[c];
                    b[u] = w1[c];
                }
            }
        }
        #pragma unroll
        for (int u = 0; u < U; ++u) {
            const int c = c0 + u * 32 + lane;
            if (c < hi) {
                float wa[PACK], wb[PACK], nw[PACK];
                unikern_unpack<T>(a[u], wa);
                unikern_unpack<T>(b[u], wb);
                if (NORM) unikern_unpack<T>(reinterpret_cast<const uint4*>(norm_w)[c], nw);
                #pragma unroll
                for (int r = 0; r < ROWS; ++r) {
                    if (r < rows) {
                        float xv[PACK];
                        unikern_unpack<T>(reinterpret_cast<const uint4*>(x + (size_t)r * K)[c], xv);
                        #pragma unroll
                        for (int e = 0; e < PACK; ++e) {
                            // as MLX's rms_norm: the normalized value rounded, times the weight rounded
                            const float xe = NORM ? static_cast<float>(static_cast<T>(
                                nw[e] * static_cast<float>(static_cast<T>(xv[e] * inv[r])))) : xv[e];
                            acc0[r] += xe * wa[e];
                            acc1[r] += xe * wb[e];
                        }
                    }
                }
            }
        }
    }
    #pragma unroll
    for (int r = 0; r < ROWS; ++r) {
        for (int o = 16; o > 0; o >>= 1) {
            acc0[r] += __shfl_xor_sync(0xffffffff, acc0[r], o);
            acc1[r] += __shfl_xor_sync(0xffffffff, acc1[r], o);
        }
    }
    if (SPLIT > 1) {  // the pair's other warps hand their sums to its first
        __shared__ float sums[WARPS][2 * ROWS];
        if (lane == 0)
            for (int r = 0; r < ROWS; ++r) {
                sums[warp][2 * r] = acc0[r];
                sums[warp][2 * r + 1] = acc1[r];
            }
        __syncthreads();
        if (warp % SPLIT != 0) return;
        for (int r = 0; r < ROWS; ++r)
            for (int q = 1; q < SPLIT; ++q) {
                acc0[r] += sums[warp + q][2 * r];
                acc1[r] += sums[warp + q][2 * r + 1];
            }
    }
    if (!live || lane != 0) return;
    T* dst = out;  // and the columns and width of the output the pair belongs to
    int c0 = f0, c1 = f1, width = NOUT;
    if (MODE == 2 && f0 >= QN) {
        const int kn = (N - QN) / 2;
        const bool is_v = f0 >= QN + kn;
        dst = is_v ? out_v : out_k;
        c0 -= is_v ? QN + kn : QN;
        c1 -= is_v ? QN + kn : QN;
        width = kn;
    }
    for (int r = 0; r < rows; ++r) {
        float s0 = acc0[r], s1 = acc1[r];
        if (BIAS) {
            s0 += static_cast<float>(bias[f0]);
            s1 += static_cast<float>(bias[f1]);
        }
        const float y0 = static_cast<float>(static_cast<T>(s0));  // the matmul's output, rounded
        const float y1 = static_cast<float>(static_cast<T>(s1));
        T* o = dst + (size_t)r * width;
        if (MODE == 1) {
            o[c0] = static_cast<T>(y0 + static_cast<float>(res[(size_t)r * NOUT + f0]));
            o[c1] = static_cast<T>(y1 + static_cast<float>(res[(size_t)r * NOUT + f1]));
        } else if (MODE == 2 && p < ROPE_PAIRS) {
            float s, c;  // the angle in units of pi: an exact range reduction, no slow path
            sincospif(static_cast<float>(pos[r]) * freq_pi[p % (HD / 2)], &s, &c);
            o[c0] = static_cast<T>(y0 * c - y1 * s);
            o[c1] = static_cast<T>(y1 * c + y0 * s);
        } else if (MODE == 3) {
            const float sig = static_cast<float>(static_cast<T>(1.f / (1.f + expf(-y0))));
            const float act = static_cast<float>(static_cast<T>(y0 * sig));
            o[p] = static_cast<T>(act * y1);
        } else {
            o[c0] = static_cast<T>(y0);
            o[c1] = static_cast<T>(y1);
        }
    }
"""
_INPUTS = ("x", "w", "bias", "norm_w", "eps", "res", "pos", "freq_pi")
_placeholders: dict[Any, mx.array] = {}


def _placeholder(dtype: mx.Dtype) -> mx.array:
    """A one-element input for the kernel's unused inputs (one per dtype, made once)."""
    if dtype not in _placeholders:
        _placeholders[dtype] = mx.zeros((1,), dtype=dtype)
    return _placeholders[dtype]


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
         rope_pairs: int = 0, q_features: int = 0, traditional: bool = False) -> mx.array | list[mx.array]:
    """The kernel over x [rows, K] and w [N, K] (see _SOURCE): its output, or for ROPE
    [q, k, v] (q_features of q, the rest halved between k and v). norm: (weight, eps as
    a float32 [1] array); freq_pi: RoPE's inverse frequencies over pi."""
    rows, K = x.shape
    if rows > MAX_ROWS:
        raise ValueError(f"the block kernel takes up to {MAX_ROWS} rows, not {rows}")
    N = w.shape[0]
    f32 = _placeholder(mx.float32)
    nout = N // 2 if mode == SWIGLU else q_features if mode == ROPE else N
    split = split_for(K, N, x.dtype)
    template = [("T", x.dtype), ("K", K), ("N", N), ("NOUT", nout), ("ROWS", 1 << (rows - 1).bit_length()),
                ("WARPS", WARPS), ("SPLIT", split), ("U", UNROLL), ("NORM", int(norm is not None)),
                ("BIAS", int(bias is not None)), ("MODE", mode), ("HD", head_dim or 2), ("ROPE_PAIRS", rope_pairs),
                ("QN", q_features if mode == ROPE else N), ("TRAD", int(traditional))]
    inputs = [x, w, bias if bias is not None else _placeholder(x.dtype),
              norm[0] if norm else _placeholder(x.dtype), norm[1] if norm else f32,
              res if res is not None else _placeholder(x.dtype),
              pos if pos is not None else _placeholder(mx.int32), freq_pi if freq_pi is not None else f32]
    kv = (N - q_features) // 2
    shapes = [(rows, nout), (rows, kv), (rows, kv)] if mode == ROPE else [(rows, nout), (1,), (1,)]
    kernel = cuda_kernel("unikern_block_gemv", _INPUTS, _SOURCE, _HEADER, ("out", "out_k", "out_v"))
    outs = kernel(inputs=inputs, template=template, grid=(-(-(N // 2) // (WARPS // split)) * WARPS * 32, 1, 1),
                  threadgroup=(WARPS * 32, 1, 1), output_shapes=shapes, output_dtypes=[x.dtype] * 3)
    return list(outs) if mode == ROPE else outs[0]


def inverse_frequencies(rope: Any, head_dim: int) -> tuple[mx.array, bool] | None:
    """RoPE's angle per position for each rotated pair (float32, with nn.RoPE's position
    scale folded in), and whether the layout is the traditional one; None for a RoPE
    the kernel does not take (only part of the head rotated, other classes)."""
    from mlx_lm.models.rope_utils import Llama3RoPE

    if type(rope) is nn.RoPE and rope.dims == head_dim:
        exponents = mx.arange(0, head_dim, 2, dtype=mx.float32) / head_dim
        return (rope.scale * mx.power(mx.array(rope.base, dtype=mx.float32), -exponents)), rope.traditional
    if type(rope) is Llama3RoPE and rope.dims == head_dim:
        return (1.0 / rope._freqs).astype(mx.float32), rope.traditional
    return None


@dataclass
class BlockPlan:
    """What a fused block's steps read, gathered once at start."""

    heads: int
    kv_heads: int
    head_dim: int
    scale: float
    rope: Any  # the attention's RoPE module (the reference path)
    freq_pi: mx.array  # RoPE's inverse frequencies over pi (the kernel's sincospif)
    traditional: bool
    eps: tuple[mx.array, mx.array]  # the two norms' eps, float32 [1]
    sdpa_module: Any  # the module whose `scaled_dot_product_attention` the attention calls
    use_kernel: bool
    steps: int = 0  # fused steps built (a traced step counts once)


def _linear(layer: nn.Linear, x: mx.array) -> mx.array:
    return mx.addmm(layer["bias"], x, layer["weight"].T) if "bias" in layer else x @ layer["weight"].T


class FusedDecodeBlock:
    """The fused block's __call__, mixed into the family's class (see the module's notes)."""

    def __call__(self, x: mx.array, mask: Any = None, cache: Any = None) -> mx.array:
        plan: BlockPlan = self.__dict__["_block_plan"]
        B, L, width = x.shape
        if L != 1 or B > MAX_ROWS or x.dtype != self.input_layernorm["weight"].dtype:
            return super().__call__(x, mask, cache)
        plan.steps += 1
        attn, mlp = self.self_attn, self.mlp
        H, D = plan.heads, plan.head_dim
        offset = cache.offset if cache is not None else 0
        rows = x.reshape(B, width)
        # one token per row: [B, 1, H, D] transposed to [B, H, 1, D] is a reshape
        q, k, v = (t.reshape(B, t.shape[1] // D, 1, D) for t in self._qkv(plan, rows, offset))
        if cache is not None:
            k, v = cache.update_and_fetch(k, v)
        sdpa = getattr(plan.sdpa_module, SDPA_NAME)  # the routed one where paged attention is on
        o = sdpa(q, k, v, cache=cache, scale=plan.scale, mask=mask).reshape(B, H * D)
        o_proj, gate_up, down = attn.o_proj, mlp.fused_gate_proj, mlp.down_proj
        if plan.use_kernel:
            h = gemv(o, o_proj["weight"], RESIDUAL, bias=o_proj.get("bias"), res=rows)
            a = gemv(h, gate_up["weight"], SWIGLU, bias=gate_up.get("bias"),
                     norm=(self.post_attention_layernorm["weight"], plan.eps[1]))
            out = gemv(a, down["weight"], RESIDUAL, bias=down.get("bias"), res=h)
        else:
            h = rows + _linear(o_proj, o)
            n = self.post_attention_layernorm(h)
            gate, up = mx.split(_linear(gate_up, n), 2, axis=-1)
            out = h + _linear(down, swiglu(gate, up))
        return out.reshape(B, 1, width)

    def _qkv(self, plan: BlockPlan, rows: mx.array, offset: Any) -> list[mx.array]:
        """q [B, H D] and k [B, Hk D] rotated for their positions, v [B, Hk D]."""
        B = rows.shape[0]
        H, Hk, D = plan.heads, plan.kv_heads, plan.head_dim
        fused = self.self_attn.fused_q_proj
        if plan.use_kernel:
            pos = offset if isinstance(offset, mx.array) else mx.array(offset, dtype=mx.int32)
            pos = mx.broadcast_to(pos.astype(mx.int32), (B,))
            return gemv(rows, fused["weight"], ROPE, bias=fused.get("bias"),
                        norm=(self.input_layernorm["weight"], plan.eps[0]), pos=pos, freq_pi=plan.freq_pi,
                        head_dim=D, rope_pairs=(H + Hk) * D // 2, q_features=H * D, traditional=plan.traditional)
        y = _linear(fused, self.input_layernorm(rows))

        def rotated(part: mx.array, heads: int) -> mx.array:
            t = part.reshape(B, 1, heads, D).transpose(0, 2, 1, 3)
            return plan.rope(t, offset=offset).transpose(0, 2, 1, 3).reshape(B, heads * D)

        return [rotated(y[:, : H * D], H), rotated(y[:, H * D : (H + Hk) * D], Hk), y[:, (H + Hk) * D :]]


_CLASSES: dict[type, type] = {}


def _family_class(block: Any) -> type | None:
    return next((c for c in type(block).__mro__ if (c.__module__, c.__name__) in BLOCKS), None)


def _plan(block: Any, use_kernel: bool) -> BlockPlan | None:
    """The block's plan, or None where it is not one the fused steps take."""
    attn, mlp = block.get("self_attn"), block.get("mlp")
    if attn is None or mlp is None or _family_class(block) is None:
        return None
    linears = [attn.get("fused_q_proj"), attn.get("o_proj"), mlp.get("fused_gate_proj"), mlp.get("down_proj")]
    if any(type(layer) is not nn.Linear for layer in linears):
        return None  # unfused or quantized projections
    norms = [block.get("input_layernorm"), block.get("post_attention_layernorm")]
    if any(not isinstance(n, nn.RMSNorm) for n in norms):
        return None
    H, Hk = attn.n_heads, attn.n_kv_heads
    D = attn.o_proj["weight"].shape[1] // H
    rope = inverse_frequencies(attn.rope, D)
    if rope is None:
        return None
    dtype = linears[0]["weight"].dtype
    if dtype not in ITEMSIZE or any(layer["weight"].shape[1] % (16 // ITEMSIZE[dtype]) for layer in linears):
        return None  # 16-byte loads along every weight row
    parameters = [a for layer in linears for a in (layer["weight"], layer.get("bias")) if a is not None]
    if any(a.dtype != dtype for a in [*parameters, *(n["weight"] for n in norms)]):
        return None  # the kernel reads every weight, bias and norm as the rows' T
    if linears[0]["weight"].shape[0] != (H + 2 * Hk) * D or D % 2:
        return None
    module = sdpa_module(attn)
    if module is None:
        return None
    eps = tuple(mx.array([n.eps], dtype=mx.float32) for n in norms)
    return BlockPlan(H, Hk, D, attn.scale, attn.rope, rope[0] / math.pi, rope[1], eps, module, use_kernel)


def fuse_decode_blocks(model: Any, use_kernel: bool | None = None) -> int:
    """Give every block of `model` that the fused steps take their `__call__`; returns how
    many blocks (0: the model as it was). `use_kernel`: the CUDA kernels (default: where
    MLX's default device is CUDA)."""
    use_kernel = cuda_is_default() if use_kernel is None else use_kernel
    layers = layers_of(model)
    plans = [_plan(block, use_kernel) for block in layers]
    if not layers or any(p is None for p in plans):
        return 0
    for block, plan in zip(layers, plans, strict=True):
        cls = type(block)
        if cls not in _CLASSES:
            _CLASSES[cls] = type(f"FusedDecode{cls.__name__}", (FusedDecodeBlock, cls), {})
        block.__class__ = _CLASSES[cls]
        block.__dict__["_block_plan"] = plan
    return len(layers)


def fused_steps(model: Any) -> int:
    """How many block steps took the fused path (a traced step counts once)."""
    return sum(p.steps for b in layers_of(model) if (p := b.__dict__.get("_block_plan")) is not None)
