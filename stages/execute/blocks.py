"""A decoder block's decode step of few rows as four GEMV kernels (execute.fuse_blocks).

One token of the 1B shape on an H200 ran 242 kernels, 14 per block: the input norm, the
q/k/v GEMV, RoPE twice, two pool writes, the attention, the output GEMV, the residual
add, the second norm, the gate/up GEMV, SwiGLU, the down GEMV and the second add. MLX's
replay of the traced step costs the host about 7 us per kernel, so at one stream the
host, not the GPU, paced the token (1.69 ms against 1.20 ms of GPU time;
tools/probe/probe_cuda.py). Here the block's steps of up to MAX_ROWS
rows and one token each run as

  1. RMS norm -> q/k/v GEMV -> RoPE on q and k   (one kernel; v as it comes)
  2. the pool writes and the decode attention     (the cache's own; where the paged
                                                   attention kernel reads the pool, the
                                                   writes are step 1's, in place)
  3. output GEMV -> + residual                    (one kernel)
  4. RMS norm -> gate/up GEMV -> SwiGLU           (one kernel)
  5. down GEMV -> + residual                      (one kernel)

so 5 kernels per block instead of 14 where the q/k/v kernel writes the pool (7 by
default: the RMS norms as MLX's kernels, see KERNEL_NORM; 2 more where the cache
scatters). Each kernel (cuda/block_gemv.py) gives one warp (or SPLIT warps, each
a share of the row) a pair of output features: two neighbours, or the two halves of a
RoPE rotation (features i and i + D/2 of a head, or 2i and 2i + 1 for the traditional
layout), or a gate feature and its up feature, so the epilogue has both values it
needs. The lanes stride over the row with 16-byte loads of both weight rows, issued
UNROLL at a time before any is used. Rounding follows MLX's ops: the matmul's output
rounded to the model's dtype before the epilogue, the norm's normalized value rounded
before its weight, each SwiGLU op rounded as mlx-lm's compiled `swiglu` rounds it.

Measured on an H200 (1B shape, one row; tools/probe/probe_cuda.py's engine-paged-blocks), the
first version took a token from 242 kernels to 134 but its GPU time from 1.17 to 1.62
ms: its GEMVs ran at half the speed of MLX's (see cuda/block_gemv.cu). With MLX's norm
kernels before the q/k/v and gate/up GEMVs (KERNEL_NORM below) a token is 166 kernels and
1.09 ms of GPU time against 242 and 1.18; in one process each, its wall time was 1.62
against 1.43 ms. The host's share of the token was 1.81 against 2.26 ms (tools/bench/bench_ab.py)
and the engine at 4 requests 1.40x faster (12 of 12 repeats): `auto` (CUDA) by default.
With the pool writes in the q/k/v kernel where the paged attention kernel reads the pool,
one 1B token is 133 primitives and 1.81-2.04 ms against 199 and 2.36-2.45 with the
cache's scatters (tools/probe/probe_cuda.py's engine-paged-blocks-scatter).

Elsewhere (`use_kernel` False: MLX's CPU backend, the tests) the same five steps run as
the family's own ops (`mx.fast.rms_norm`, matmuls through the fused projections'
weights, the attention module's RoPE, mlx-lm's `swiglu`), so on a CPU a fused block
computes what the family's code does. Steps of more rows run the same steps through
those ops where `ops_rows` allows (execute.fuse_blocks_ops_rows): 2-D matmuls through the
weights' transposed views, made once, q and k through one RoPE call, no round trips
through the family's [B, heads, L, D] layout, so fewer graph nodes for MLX to encode per
step than the family's code; steps of still more rows, or of several tokens (prefill),
run the family's own `__call__`. Families: BLOCKS (their attention and MLP
code is what the steps above repeat; tests/test_decode_blocks.py holds mlx-lm's source
to it), with q/k/v and gate/up fused (execute.fuse_projections), unquantized layers
(quantized ones through MLX's ops only, their matmuls through the layers' own calls: on
an H200 an 8B 4-bit token took 4.22 against 5.27 ms in the runner, 827 primitives against
1,211, and the engine at one request was 1.16x faster, 6 of 6 repeats;
tools/probe/probe_cuda.py's engine-paged-q-blocks, tools/bench/bench_ab.py), RoPE over the whole head
(nn.RoPE or Llama3RoPE), one rank."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.activations import swiglu

from unikern.platform import cuda_is_default
from unikern.stages.execute import quantized
from unikern.stages.execute.cuda import block_kernel
from unikern.stages.execute.cuda.block_gemv import (
    ITEMSIZE,
    MAX_ROWS,
    PLAIN,
    RESIDUAL,
    ROPE,
    SWIGLU,
    counter,
    gemv,
)
from unikern.stages.execute.cuda.pool_write import rope_write
from unikern.stages.execute.cuda.q4_gemv import gemv_rope, gemv_swiglu
from unikern.stages.execute.quantized import epilogue_gemv_applies
from unikern.stages.execute.ropes import rope_class
from unikern.stages.execute.routing import SDPA_NAME, layers_of, sdpa_module

# block classes (module, name) whose attention and MLP run as the steps above
BLOCKS = {
    ("mlx_lm.models.llama", "TransformerBlock"),
    ("mlx_lm.models.qwen2", "TransformerBlock"),
}

# which of the block's norms and RoPE the GEMV kernels take (1), or MLX's own kernels
# run, around a plain GEMV (0): tools/probe/probe_cuda.py's blocks-norm and blocks-rope. On an
# H200, one 1B token's GPU time (CUPTI, tools/probe/probe_cuda.py) was 1.431 ms
# with both in the kernels (134 kernels: the gate/up GEMV with its norm 520 us, q/k/v
# 344), 1.089 with MLX's norms (166 kernels: gate/up 305 us, q/k/v with RoPE 138), 1.091
# with MLX's norms and RoPE (194 kernels), against MLX's own path's 1.182 (242 kernels).
# Each warp summing the row's squares itself and normalizing as it multiplies costs the
# GEMV more than MLX's norm kernel does (2.2 us per call). 2: the norms in the GEMVs, the
# rows' sums of squares handed over by the residual kernels that wrote the rows
# (block_gemv's hand_ss: every block adds its share, the last block done adds those up),
# so no warp reads the whole row first and 30 of a 1B token's 33 norm kernels go (the
# first block's input norm and the model's last norm stay MLX's). With its counter and
# the sums in MLX's pool of small arrays, across the bus, it took 15.4 ms per 1B token on
# an H200 (kernel_cache.SMALL_POOL_BYTES); in device memory its CUDA tests hold and the
# engine's runner gives the same 64 tokens as with MLX's norms, 99 kernels a 1B token
# against 130, 2.56 ms against 3.54 (GPU 1.06 ms against 0.97: the host is the bound;
# tools/probe/probe_cuda.py's engine-paged-blocks-handnorm). The default.
KERNEL_NORM = 2
KERNEL_ROPE = 1
# steps through MLX's ops (more rows than the kernels take, up to ops_rows) whose attention
# reads the pool: RoPE and the pool write by one kernel after the q/k/v matmul
# (cuda/pool_write.rope_write) instead of MLX's RoPE, the write kernel and six views per
# layer. On an H200 (tools/probe/probe_cuda.py's engine-paged-blocks-ops against -ops-rw) a 1B
# 64-row step went from 373 primitives and 243 kernels to 261 and 211, 2.31 / 2.41 ms to
# 1.63 / 1.80 in two rounds, the same tokens; its CUDA test passed. The default.
OPS_ROPE_WRITE = True
# ops_rows when the caller leaves it to the blocks (execute.fuse_blocks_ops_rows "auto"):
# unquantized blocks through MLX's ops up to 64 rows (on an H200, tools/bench/bench_gpu.py);
# 4-bit blocks only up to the kernels' MAX_ROWS (not measured above it)
AUTO_OPS_ROWS = 64


def inverse_frequencies(rope: Any, head_dim: int) -> tuple[mx.array, bool] | None:
    """RoPE's angle per position for each rotated pair (float32, with nn.RoPE's position
    scale folded in), and whether the layout is the traditional one; None for a RoPE
    the kernel does not take (only part of the head rotated, other classes)."""
    from mlx_lm.models.rope_utils import Llama3RoPE

    kind = rope_class(rope)  # (under ropes.py's split call, where MLX's CUDA RoPE needs it)
    if kind is nn.RoPE and rope.dims == head_dim:
        exponents = mx.arange(0, head_dim, 2, dtype=mx.float32) / head_dim
        return (rope.scale * mx.power(mx.array(rope.base, dtype=mx.float32), -exponents)), rope.traditional
    if kind is Llama3RoPE and rope.dims == head_dim:
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
    eps: tuple[float, float]  # the two norms' eps (the kernels' template arguments)
    sdpa_module: Any  # the module whose `scaled_dot_product_attention` the attention calls
    use_kernel: bool
    # steps of more rows than the kernels take (MAX_ROWS), up to this many, run the same
    # block through MLX's ops (execute.fuse_blocks_ops_rows; 0: the family's own code)
    ops_rows: int = 0
    # the four projections' weights transposed once, evaluated (views of the weights: no
    # copy), so a step's matmuls add no transpose node of their own (keyed by projection)
    transposed: dict | None = None
    # KERNEL_NORM 2: the next fused block's plan (None for the last), the (rows, sums of
    # squares) this block's output handed it in the forward being built, and this block's
    # two counters for the residual kernels' last-block-done (block_gemv.counter)
    next: Any = None
    handed: tuple[mx.array, mx.array] | None = None
    counters: tuple[mx.array, mx.array] | None = None
    steps: int = 0  # fused steps built (a traced step counts once)
    ops_steps: int = 0  # of those, the steps ops_rows added (more than MAX_ROWS rows)
    pool_steps: int = 0  # of those, the steps whose q/k/v kernel wrote k and v into the pool
    # one-row steps as one kernel (cuda/block_kernel.py; execute.block_kernel), its barrier
    one_kernel: bool = False
    bar: mx.array | None = None
    kernel_steps: int = 0  # of the steps, those that ran as one kernel

    @property
    def max_rows(self) -> int:
        """Steps of up to this many rows take the fused steps."""
        return max(MAX_ROWS, self.ops_rows)


def _linear(layer: nn.Linear, x: mx.array, plan: BlockPlan | None = None) -> mx.array:
    """x @ W.T (+ bias) as nn.Linear computes it, through the plan's evaluated transposed
    view of W where it holds one; a quantized layer through its own call."""
    if isinstance(layer, nn.QuantizedLinear):
        return layer(x)
    wt = plan.transposed.get(id(layer)) if plan is not None and plan.transposed else None
    if wt is None:
        wt = layer["weight"].T
    return mx.addmm(layer["bias"], x, wt) if "bias" in layer else x @ wt


def _plus(layer: nn.Linear, x: mx.array, res: mx.array, plan: BlockPlan) -> mx.array:
    """res + layer(x): a routed 4-bit layer adds it inside its GEMV kernel where it can
    (quantized.GEMV_RESIDUAL)."""
    plus = getattr(layer, "plus", None)
    return plus(x, res) if plus is not None else res + _linear(layer, x, plan)


class FusedDecodeBlock:
    """The fused block's __call__, mixed into the family's class (see the module's notes)."""

    def __call__(self, x: mx.array, mask: Any = None, cache: Any = None) -> mx.array:
        plan: BlockPlan = self.__dict__["_block_plan"]
        handed, plan.handed = plan.handed, None  # (only for the very rows it was handed with)
        B, L, width = x.shape
        if L != 1 or B > plan.max_rows or x.dtype != self.input_layernorm["weight"].dtype:
            return super().__call__(x, mask, cache)
        plan.steps += 1
        plan.ops_steps += B > MAX_ROWS
        kernel = plan.use_kernel and B <= MAX_ROWS
        attn, mlp = self.self_attn, self.mlp
        H, D = plan.heads, plan.head_dim
        offset = cache.offset if cache is not None else 0
        # the kernels read rows of any [B, ...] array and write the shapes read next: no
        # reshape nodes (the kernel's outputs are [B, heads, 1, D] already, so the
        # reshapes below return them as they are)
        rows = x if kernel else x.reshape(B, width)
        # the q/k/v kernel writes k and v into the pool itself where the paged attention
        # kernel reads them back (two scatters fewer per layer and token)
        target = None
        q4_rope = not kernel and epilogue_gemv_applies(attn.fused_q_proj, rows, quantized.GEMV_ROPE)
        if (kernel and KERNEL_ROPE or q4_rope or not kernel and OPS_ROPE_WRITE) and hasattr(cache, "pool_target"):
            target = cache.pool_target(H, D, x.dtype)
        if kernel and B == 1 and plan.one_kernel and target is not None:
            out = self._one_kernel(plan, x, offset, cache, target)
            if out is not None:
                return out
        ss = handed[1] if kernel and handed is not None and handed[0] is x else None
        q, k, v = self._qkv(plan, rows, offset, kernel, target, ss, q4_rope)
        if target is not None:
            plan.pool_steps += 1
            cache.written_in_place()
        elif cache is not None:
            k, v = cache.update_and_fetch(k, v)
        sdpa = getattr(plan.sdpa_module, SDPA_NAME)  # the routed one where paged attention is on
        o = sdpa(q, k, v, cache=cache, scale=plan.scale, mask=mask)
        o_proj, gate_up, down = attn.o_proj, mlp.fused_gate_proj, mlp.down_proj
        if kernel:
            h = gemv(o, o_proj["weight"], RESIDUAL, bias=o_proj.get("bias"), res=rows,
                     hand_ss=plan.counters[0] if KERNEL_NORM == 2 else None)
            h, ss = h if KERNEL_NORM == 2 else (h, None)
            x2, norm = self._norm_input(self.post_attention_layernorm, h, plan.eps[1], ss)
            a = gemv(x2, gate_up["weight"], SWIGLU, bias=gate_up.get("bias"), norm=norm, ss=ss)
            hand = KERNEL_NORM == 2 and plan.next is not None
            out = gemv(a, down["weight"], RESIDUAL, bias=down.get("bias"), res=h, out_shape=(B, 1, width),
                       hand_ss=plan.counters[1] if hand else None)
            if hand:
                plan.next.handed = out  # (the next block's rows, their sums of squares)
                out = out[0]
            return out  # [B, 1, width] already: the very array the next block is handed
        else:
            o = o.reshape(B, H * D)
            h = _plus(o_proj, o, rows, plan)
            n = self.post_attention_layernorm(h)
            if epilogue_gemv_applies(gate_up, n, quantized.GEMV_SWIGLU):
                a = gemv_swiglu(n, gate_up)  # silu(gate) * up inside the 4-bit GEMV
            else:
                gate, up = mx.split(_linear(gate_up, n, plan), 2, axis=-1)
                a = swiglu(gate, up)
            out = _plus(down, a, h, plan)
        return out.reshape(B, 1, width)

    def _one_kernel(self, plan: BlockPlan, x: mx.array, offset: Any, cache: Any,
                    target: tuple[mx.array, mx.array, mx.array]) -> mx.array | None:
        """The one-row step as one kernel (cuda/block_kernel.py) where the row's slot table is one
        it takes; None otherwise (nothing built)."""
        attn, mlp = self.self_attn, self.mlp
        H, Hk, D = plan.heads, plan.kv_heads, plan.head_dim
        cache.written_in_place()
        slots, lengths = cache.paged_table()
        down = mlp.down_proj["weight"]
        if not block_kernel.fits(x.shape[-1], down.shape[1], H, Hk, D, x.dtype, slots.shape[1]):
            return None
        plan.pool_steps += 1
        plan.kernel_steps += 1
        fused = attn.fused_q_proj
        return block_kernel.block_step(
            x, fused["weight"], fused.get("bias"), (self.input_layernorm["weight"], plan.eps[0]), attn.o_proj["weight"],
            (self.post_attention_layernorm["weight"], plan.eps[1]), mlp.fused_gate_proj["weight"], down,
            _positions(offset, 1), plan.freq_pi, H, Hk, D, plan.traditional, plan.scale, target, slots, lengths,
            plan.bar)[0]

    def _qkv(self, plan: BlockPlan, rows: mx.array, offset: Any, kernel: bool,
             pool: tuple[mx.array, mx.array, mx.array] | None = None, ss: mx.array | None = None,
             q4_rope: bool = False) -> list[mx.array]:
        """q [B, H, 1, D] and k [B, Hk, 1, D] rotated for their positions, v [B, Hk, 1, D]
        (with `pool`, k and v written into the pool by the kernel: placeholders here). One
        token per row: [B, 1, H, D] transposed to [B, H, 1, D] is a reshape."""
        B = rows.shape[0]
        H, Hk, D = plan.heads, plan.kv_heads, plan.head_dim
        fused = self.self_attn.fused_q_proj
        if kernel:
            x, norm = self._norm_input(self.input_layernorm, rows, plan.eps[0], ss)
            if KERNEL_ROPE:
                pos = _positions(offset, B)
                return gemv(x, fused["weight"], ROPE, bias=fused.get("bias"), norm=norm, pos=pos,
                            freq_pi=plan.freq_pi, head_dim=D, rope_pairs=(H + Hk) * D // 2, q_features=H * D,
                            traditional=plan.traditional, pool=pool, ss=ss)
            y = gemv(x, fused["weight"], PLAIN, bias=fused.get("bias"), norm=norm, ss=ss)
        elif q4_rope:  # q and k rotated inside the 4-bit GEMV (k and v into the pool with `pool`)
            y = gemv_rope(self.input_layernorm(rows), fused, _positions(offset, B), plan.freq_pi, H * D, D,
                          plan.traditional, pool)
            if pool is not None:
                return [y, y, y]  # (k and v: in the pool; the caller reads neither)
        else:
            y = _linear(fused, self.input_layernorm(rows), plan)
            if pool is not None:  # (OPS_ROPE_WRITE) one kernel rotates q and k and writes k and v
                q = rope_write(y, _positions(offset, B), plan.freq_pi, H, D, plan.traditional, pool)
                return [q, q, q]  # (k and v: in the pool; the caller reads neither)
        qk = y[:, : (H + Hk) * D].reshape(B, H + Hk, 1, D)
        if not q4_rope:
            # q's and k's heads side by side through one RoPE (each head rotates alone, so
            # this is the two calls' result): two view nodes and a kernel fewer than
            # rotating each in the family's [B, heads, L, D] layout and back
            qk = plan.rope(qk, offset=offset)
        return [qk[:, :H], qk[:, H:], y[:, (H + Hk) * D :].reshape(B, Hk, 1, D)]

    @staticmethod
    def _norm_input(norm: nn.RMSNorm, x: mx.array, eps: float,
                    ss: mx.array | None = None) -> tuple[mx.array, tuple[mx.array, float] | None]:
        """A kernel's input and its `norm` argument: the norm in the kernel (KERNEL_NORM
        1, or 2 with the rows' sums of squares `ss` handed over), or MLX's RMS norm kernel
        before it."""
        inside = KERNEL_NORM == 1 or (KERNEL_NORM == 2 and ss is not None)
        return (x, (norm["weight"], eps)) if inside else (norm(x), None)


def _positions(offset: Any, rows: int) -> mx.array:
    """Each row's position, int32 [rows], from the cache's offset (an int or per row)."""
    pos = (offset if isinstance(offset, mx.array) else mx.array(offset, dtype=mx.int32)).astype(mx.int32)
    return pos if pos.shape == (rows,) else mx.broadcast_to(pos, (rows,))  # (no node where none is needed)


_CLASSES: dict[type, type] = {}


def _family_class(block: Any) -> type | None:
    return next((c for c in type(block).__mro__ if (c.__module__, c.__name__) in BLOCKS), None)


def _plan(block: Any, use_kernel: bool, ops_rows: int | None = 0) -> BlockPlan | None:
    """The block's plan, or None where it is not one the fused steps take."""
    attn, mlp = block.get("self_attn"), block.get("mlp")
    if attn is None or mlp is None or _family_class(block) is None:
        return None
    linears = [attn.get("fused_q_proj"), attn.get("o_proj"), mlp.get("fused_gate_proj"), mlp.get("down_proj")]
    # quantized projections: MLX's ops only (the kernels read unquantized weights), each
    # matmul through the layer's own call (unikern's 4-bit kernels on CUDA)
    quantized = all(isinstance(layer, nn.QuantizedLinear) for layer in linears)
    if not quantized and any(type(layer) is not nn.Linear for layer in linears):
        return None  # unfused projections, or some quantized and some not
    norms = [block.get("input_layernorm"), block.get("post_attention_layernorm")]
    if any(not isinstance(n, nn.RMSNorm) for n in norms):
        return None
    H, Hk = attn.n_heads, attn.n_kv_heads
    D, odd = divmod(linears[0]["weight"].shape[0], H + 2 * Hk)  # the fused q/k/v's features
    rope = inverse_frequencies(attn.rope, D)
    if rope is None or odd or D % 2:
        return None
    if quantized:
        dtype = linears[0]["scales"].dtype  # the rows'
        if any(layer["scales"].dtype != dtype for layer in linears) or any(n["weight"].dtype != dtype for n in norms):
            return None
    else:
        dtype = linears[0]["weight"].dtype
        if dtype not in ITEMSIZE or any(layer["weight"].shape[1] % (16 // ITEMSIZE[dtype]) for layer in linears):
            return None  # 16-byte loads along every weight row
        parameters = [a for layer in linears for a in (layer["weight"], layer.get("bias")) if a is not None]
        if any(a.dtype != dtype for a in [*parameters, *(n["weight"] for n in norms)]):
            return None  # the kernel reads every weight, bias and norm as the rows' T
    module = sdpa_module(attn)
    if module is None:
        return None
    eps = tuple(float(n.eps) for n in norms)
    transposed = {} if quantized else {id(layer): layer["weight"].T for layer in linears}
    mx.eval(list(transposed.values()))  # views: the weights' own buffers
    if ops_rows is None:
        ops_rows = 0 if quantized else AUTO_OPS_ROWS
    return BlockPlan(H, Hk, D, attn.scale, attn.rope, rope[0] / math.pi, rope[1], eps, module,
                     use_kernel and not quantized, ops_rows, transposed)


def fuse_decode_blocks(model: Any, use_kernel: bool | None = None, ops_rows: int | None = 0,
                       one_kernel: bool = False) -> int:
    """Give every block of `model` that the fused steps take their `__call__`; returns how
    many blocks (0: the model as it was). `use_kernel`: the CUDA kernels (default: where
    MLX's default device is CUDA), for steps of up to MAX_ROWS rows. `ops_rows`: steps of
    more rows, up to this many, run the fused steps through MLX's ops (0: the family's
    own code; None: AUTO_OPS_ROWS for unquantized blocks, 0 for 4-bit ones). `one_kernel`:
    one-row steps with the kernels as one kernel per block where they fit (cuda/block_kernel.py)."""
    use_kernel = cuda_is_default() if use_kernel is None else use_kernel
    layers = layers_of(model)
    plans = [_plan(block, use_kernel, ops_rows) for block in layers]
    if not layers or any(p is None for p in plans):
        return 0
    for block, plan, after in zip(layers, plans, [*plans[1:], None], strict=True):
        plan.next = after
        plan.counters = (counter(), counter())
        # one-row steps as one kernel: unquantized blocks (the kernels') with no bias but q/k/v's
        plan.one_kernel = one_kernel and plan.use_kernel and not any(
            "bias" in layer for layer in (block.self_attn.o_proj, block.mlp.fused_gate_proj, block.mlp.down_proj))
        plan.bar = block_kernel.barrier(plan.kv_heads) if plan.one_kernel else None
    mx.eval([c for p in plans for c in (*p.counters, *([p.bar] if p.bar is not None else []))])
    for block, plan in zip(layers, plans, strict=True):
        cls = type(block)
        if not isinstance(block, FusedDecodeBlock):  # (a fused block again: a new plan only)
            if cls not in _CLASSES:
                _CLASSES[cls] = type(f"FusedDecode{cls.__name__}", (FusedDecodeBlock, cls), {})
            block.__class__ = _CLASSES[cls]
        block.__dict__["_block_plan"] = plan
    return len(layers)


def fused_rows(model: Any) -> int:
    """Steps of up to this many rows take every block's fused steps (0: a block does not)."""
    plans = [b.__dict__.get("_block_plan") for b in layers_of(model)]
    return min((p.max_rows for p in plans), default=0) if plans and None not in plans else 0


def fused_steps(model: Any, field: str = "steps") -> int:
    """How many block steps took the fused path (a traced step counts once); `ops_steps`:
    how many of them only fuse_blocks_ops_rows sent there (more rows than the kernels
    take); `pool_steps`: how many wrote k and v into the pool from the q/k/v kernel;
    `kernel_steps`: how many ran as one kernel (cuda/block_kernel.py)."""
    return sum(getattr(p, field) for b in layers_of(model) if (p := b.__dict__.get("_block_plan")) is not None)
