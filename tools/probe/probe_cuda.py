"""Where one decode token's time goes under MLX's CUDA backend: host time building the
graph (Python), host time encoding it (`mx.async_eval`: MLX's primitives, CUDA graph
capture and launch), time waiting for the GPU, and the GPU's own kernel time (CUPTI,
through PyTorch's profiler in the same process), for variants of the run each in a
process of its own (MLX reads its CUDA settings once per process).

    python -m tools.probe.probe_cuda --model DIR [--variants default nographs ...] [--json out.json]

Variants:
  default      mlx-lm's model and KVCache, greedy, as generate_step runs them
  nographs     MLX_USE_CUDA_GRAPHS=0: kernels launched one by one, no graph capture
  ops400       MLX_MAX_OPS_PER_BUFFER=400: one CUDA graph per token instead of ~4
  fused        q/k/v and gate/up through one weight each (stages/execute/fused.py; unquantized
               layers, as execute.fuse_projections=auto does)
  fused-nographs  both
  compiled     each layer's MLP half (norm, SwiGLU, residual add) an mx.compile'd function
  engine       unikern's ModelRunner on lookahead windows of 32 (as the engine decodes one
               request), projections fused as execute.fuse_projections=auto does on CUDA:
               wall and GPU time per token (its graph build and encode are not split)
  engine-paged the same with execute.paged_attention (one kernel reads the pool) and the
               one-row window a traced step (execute.compile_one_row)
  engine-paged-eager  paged attention, the one-row window built op by op
  engine-paged-group  engine-paged with paged_attention.KERNEL = "group" (a block per row
               and KV head instead of per row and query head)
  engine-paged-head   engine-paged with paged_attention.KERNEL = "head" (the default is
               "group")
  qgemv        4-bit models: mlx-lm's loop with the quantized layers through unikern's GEMV
               kernel (execute.quantized_gemv) instead of MLX's quantized matmul; the
               qgemv and qmma variants below run the first version's 4-byte loads and narrow
               tensor-core blocks unless named -wide (the defaults since 2026-12-01)
  engine-paged-qgemv  engine-paged with that GEMV (steps of fewer than 8 rows, as
               execute.dequantize_rows=auto leaves it)
  engine-paged-qgemv-all  the GEMV for every step of up to 64 rows (dequantize_rows=65)
  engine-paged-qmma  the GEMV up to 8 rows, the tensor-core kernel (execute.quantized_mma)
               from 9 to 64 rows
  engine-paged-qmma-split  the same, the tensor-core kernel's weights as two bf16 halves
               (execute.quantized_mma_weights=split)
  qgemv-wide, engine-paged-qgemv-wide  qgemv and engine-paged-qgemv with the GEMV's
               16-byte weight loads (q4_gemv.GEMV_WIDE_LOADS)
  engine-paged-qmma-wide  engine-paged-qmma with the tensor-core kernel's wide blocks
               (q4_mma.MMA_SHAPE = "wide": 8 warps, 16 features per warp)
  engine-paged-q  4-bit models as the engine runs them on CUDA: the GEMV
               (16-byte loads) to 8 rows, the wide tensor-core kernel to 64, quantized
               q/k/v and gate/up fused (execute.fuse_projections=auto with those kernels)
  engine-paged-q-unfused  the same, quantized projections separate
  engine-paged-8warps  engine-paged with 8 warps per paged-attention block at any row
               count (paged_attention.FEW_BLOCKS = 0; 16 below 128 blocks by default)
  engine-paged-nosplit  engine-paged with each row's positions in one block per KV head
               (paged_attention.SPLIT_BLOCKS = 0: the first paged kernel; the default splits
               long tables at few rows over several blocks and merges them)
  engine-paged-split512, engine-paged-split1024  the split aiming at 512 blocks of at
               least 128 table positions, or 1,024 of at least 64 (SPLIT_BLOCKS and
               SPLIT_MIN_POSITIONS; the defaults are 256 and 256)
  engine-paged-u4, engine-paged-u8  engine-paged with each warp of the group kernel loading
               4 or 8 positions' keys and values before using any
               (paged_attention.POSITIONS_IN_FLIGHT; 2 by default)
  engine-paged-norms, engine-paged-q-norms  engine-paged and engine-paged-q with each
               block's residual adds run with the norms after them (execute.fuse_norms:
               stages/execute/residual.py)
  engine-paged-blocks  engine-paged with each block's decode steps of up to 4 rows as four
               GEMV kernels (execute.fuse_blocks: stages/execute/blocks.py)
  engine-paged-blocks-one  the same, a one-row step's block as one kernel (execute.block_kernel:
               stages/execute/cuda/block_kernel.py); -u2: 2 chunks per lane and weight row in flight
               (block_kernel.UNROLL, 4 by default); -g264: 264 blocks of 8 warps (two per SM)
               instead of 132 of 16; -split: the attention phase over several blocks per KV
               head (ATTN_SPLIT = 1, the default, so the same as the plain
               variant now); -nosplit: one block per KV head (ATTN_SPLIT = 0); -preload: each
               phase's first weight loads before its barrier (PRELOAD = 1)
  engine-paged-blocks-u1, -u4, -u8  the same, each lane with 1, 4 or 8 of a weight row's
               16-byte chunks in flight per pass (block_gemv.UNROLL; 2 by default): 1 gives
               few registers and many warps per SM, as MLX's own GEMV
  engine-paged-blocks-wide  engine-paged-blocks with one warp per output pair
               (block_gemv.TARGET_BLOCKS = 0)
  engine-paged-blocks-mlxnorm, -mlxrope, -mlxboth  engine-paged-blocks with the norms,
               the RoPE or both run by MLX's own kernels around plain GEMVs
               (blocks.KERNEL_NORM, blocks.KERNEL_ROPE = 0; the norms were MLX's by
               default for a while on 2026-12-01)
  engine-paged-blocks-kernelnorm  engine-paged-blocks with the norms inside the GEMV
               kernels (blocks.KERNEL_NORM = 1: the first default)
  engine-paged-blocks-handnorm  engine-paged-blocks with the norms inside the GEMV kernels
               from the sums of squares the residual kernels hand over (KERNEL_NORM = 2,
               the default)
  engine-paged-nographs, engine-paged-blocks-nographs, engine-paged-q-nographs  those
               with MLX_USE_CUDA_GRAPHS=0 (each kernel launched as MLX encodes it)
  engine-paged-ops50, engine-paged-ops300  engine-paged with MLX_MAX_OPS_PER_BUFFER at 50
               or 300 (100 on an H200): CUDA graphs of fewer or more kernels
  engine-paged-blocks-ops  engine-paged-blocks with steps of 5-64 rows through the fused
               block's MLX ops instead of the family's code (execute.fuse_blocks_ops_rows=64)
  engine-paged-blocks-ops-rw  engine-paged-blocks-ops with RoPE and the pool write of
               those steps in one kernel after the q/k/v matmul (blocks.OPS_ROPE_WRITE = 1)
  engine-paged-blocks-scatter  engine-paged-blocks with the keys and values written into
               the pool by the cache's two scatters per layer, as at first, not in
               place by the q/k/v kernel (PagedLayerCache._kernel_reads off)
  engine-paged-write  engine-paged with steps the blocks do not take (more than 4 rows)
               writing the pool through one in-place kernel instead of two scatters per
               layer (paged_cache.WRITE_IN_PLACE = 1; the default)
  engine-paged-q-blocks  engine-paged-q with the 4-bit blocks' steps of up to 4 rows through
               the fused block's MLX ops (the default)
  engine-paged-q-blocks-res, -write, -res-write  engine-paged-q-blocks with the residual
               adds inside the 4-bit GEMV (quantized.GEMV_RESIDUAL = 1), the pool writes
               through one in-place kernel (paged_cache.WRITE_IN_PLACE = 1), or both
               (both are the defaults)
  engine-paged-q-blocks-s16  engine-paged-q-blocks as first written: the residual
               adds and the pool's scatters outside the GEMV (q-res=0, pool-write=0)
  engine-paged-q-blocks-rope  engine-paged-q-blocks with q and k rotated inside the 4-bit
               q/k/v GEMV and k and v written into the pool by it (quantized.GEMV_ROPE = 1)
  engine-paged-q-blocks-swiglu, -epi  with silu(gate) * up inside the gate/up GEMV
               (quantized.GEMV_SWIGLU = 1), or both that and -rope (both are the defaults
               now)
  engine-paged-q-blocks-s17  engine-paged-q-blocks before the epilogues: RoPE, the pool
               write and SwiGLU outside the 4-bit GEMVs (q-rope=0, q-swiglu=0)
  engine-paged-q-blocks-magic  engine-paged-q-blocks with the 4-bit GEMV's nibbles made
               floats by the bits of 2^23 + q, not I2F (q4_gemv.GEMV_MAGIC_NIBBLES = 1)
  engine-paged-q-blocks-magic-f8, -magic-w8  that with 8 output features per block
               (q4_gemv.GEMV_FEATURES = 8: each thread 8 weight loads in flight), or 8
               warps per block (GEMV_WARPS = 8)
  engine-paged-q-blocks-w1, -w2, -f2, -w2-f8  the 4-bit GEMV's blocks of 1 or 2 warps
               (each thread then loops over 4 or 2 of a K = 4096 row's 16-byte loads per
               feature, where 4 warps give it one), of 2 features, or 2 warps of 8;
               -w1-u4, -w2-u2: 1 or 2 warps with that loop unrolled (GEMV_UNROLL)
  engine-paged-blocks-smallpool, engine-paged-q-blocks-smallpool  those with a decode
               window's per-row arrays of one row in MLX's pool of small arrays, as up to
               2026-12-02 (layouts.PAD_STEP_ROWS = 0)
  engine-paged-q-blocks-ops  engine-paged-q with every step of up to 64 rows through the
               fused block's MLX ops (4-bit blocks: execute.fuse_blocks_ops_rows=64)
  engine-paged-dmma  engine-paged with plain bf16 layers' steps of 5-64 rows through
               unikern's tensor-core kernel (execute.dense_mma: stages/execute/dense_mma.py)
The engine variants split the host's time per token: build (the traced step's replay),
submit (`mx.async_eval`: MLX's encoding and launch), wait (the window's last `mx.eval`)
and other (the runner's own Python: sampling, tables).
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import statistics
import subprocess
import sys
import time

# the 8B 4-bit model's engine path with its fused blocks, as the engine runs it on CUDA
Q_BLOCKS = ["fused", "fused-q", "engine", "paged", "traced", "qgemv", "gemv-to-64", "qmma", "wide", "mma-wide", "blocks"]
VARIANTS = {
    "default": ({}, []),
    "nographs": ({"MLX_USE_CUDA_GRAPHS": "0"}, []),
    "ops400": ({"MLX_MAX_OPS_PER_BUFFER": "400"}, []),
    "ops50": ({"MLX_MAX_OPS_PER_BUFFER": "50"}, []),
    "fused": ({}, ["fused"]),
    "fused-nographs": ({"MLX_USE_CUDA_GRAPHS": "0"}, ["fused"]),
    "compiled": ({}, ["compiled"]),
    "compiled-fused-nographs": ({"MLX_USE_CUDA_GRAPHS": "0"}, ["fused", "compiled"]),
    "engine": ({}, ["fused", "engine"]),
    "engine-paged": ({}, ["fused", "engine", "paged", "traced"]),
    "engine-paged-eager": ({}, ["fused", "engine", "paged"]),
    "engine-paged-group": ({}, ["fused", "engine", "paged", "traced", "group"]),
    "engine-paged-head": ({}, ["fused", "engine", "paged", "traced", "head"]),
    "qgemv": ({}, ["qgemv"]),
    "engine-paged-qgemv": ({}, ["fused", "engine", "paged", "traced", "qgemv"]),
    "engine-paged-qgemv-all": ({}, ["fused", "engine", "paged", "traced", "qgemv", "gemv-to-64"]),
    "engine-paged-qmma": ({}, ["fused", "engine", "paged", "traced", "qgemv", "gemv-to-64", "qmma"]),
    "engine-paged-qmma-split": ({}, ["fused", "engine", "paged", "traced", "qgemv", "gemv-to-64", "qmma", "split"]),
    "qgemv-wide": ({}, ["qgemv", "wide"]),
    "engine-paged-qgemv-wide": ({}, ["fused", "engine", "paged", "traced", "qgemv", "wide"]),
    "engine-paged-qmma-wide": ({}, ["fused", "engine", "paged", "traced", "qgemv", "gemv-to-64", "qmma", "mma-wide"]),
    "engine-paged-q": ({}, ["fused", "fused-q", "engine", "paged", "traced", "qgemv", "gemv-to-64", "qmma", "wide",
                            "mma-wide"]),
    "engine-paged-q-unfused": ({}, ["fused", "engine", "paged", "traced", "qgemv", "gemv-to-64", "qmma", "wide",
                                    "mma-wide"]),
    "engine-paged-8warps": ({}, ["fused", "engine", "paged", "traced", "few-blocks=0"]),
    "engine-paged-nosplit": ({}, ["fused", "engine", "paged", "traced", "split-blocks=0"]),
    "engine-paged-split512": ({}, ["fused", "engine", "paged", "traced", "split-blocks=512", "split-min=128"]),
    "engine-paged-split1024": ({}, ["fused", "engine", "paged", "traced", "split-blocks=1024", "split-min=64"]),
    "engine-paged-norms": ({}, ["fused", "engine", "paged", "traced", "norms"]),
    "engine-paged-blocks": ({}, ["fused", "engine", "paged", "traced", "blocks"]),
    "engine-paged-blocks-one": ({}, ["fused", "engine", "paged", "traced", "blocks", "blocks-one"]),
    "engine-paged-blocks-one-u2": ({}, ["fused", "engine", "paged", "traced", "blocks", "blocks-one",
                                        "block-unroll=2"]),
    "engine-paged-blocks-one-g264": ({}, ["fused", "engine", "paged", "traced", "blocks", "blocks-one",
                                          "block-grid=264", "block-warps=8"]),
    "engine-paged-blocks-one-split": ({}, ["fused", "engine", "paged", "traced", "blocks", "blocks-one",
                                           "block-attn-split=1"]),
    "engine-paged-blocks-one-nosplit": ({}, ["fused", "engine", "paged", "traced", "blocks", "blocks-one",
                                             "block-attn-split=0"]),
    "engine-paged-blocks-one-preload": ({}, ["fused", "engine", "paged", "traced", "blocks", "blocks-one",
                                             "block-preload=1"]),
    "engine-paged-blocks-one-split-preload": ({}, ["fused", "engine", "paged", "traced", "blocks", "blocks-one",
                                                   "block-attn-split=1", "block-preload=1"]),
    "engine-paged-blocks-u4": ({}, ["fused", "engine", "paged", "traced", "blocks", "blocks-unroll=4"]),
    "engine-paged-blocks-u1": ({}, ["fused", "engine", "paged", "traced", "blocks", "blocks-unroll=1"]),
    "engine-paged-blocks-u8": ({}, ["fused", "engine", "paged", "traced", "blocks", "blocks-unroll=8"]),
    "engine-paged-blocks-wide": ({}, ["fused", "engine", "paged", "traced", "blocks", "blocks-target=0"]),
    "engine-paged-blocks-mlxnorm": ({}, ["fused", "engine", "paged", "traced", "blocks", "blocks-norm=0"]),
    "engine-paged-blocks-mlxrope": ({}, ["fused", "engine", "paged", "traced", "blocks", "blocks-rope=0"]),
    "engine-paged-blocks-mlxboth": ({}, ["fused", "engine", "paged", "traced", "blocks", "blocks-norm=0",
                                         "blocks-rope=0"]),
    "engine-paged-blocks-kernelnorm": ({}, ["fused", "engine", "paged", "traced", "blocks", "blocks-norm=1"]),
    "engine-paged-blocks-handnorm": ({}, ["fused", "engine", "paged", "traced", "blocks", "blocks-norm=2"]),
    "engine-paged-dmma": ({}, ["fused", "engine", "paged", "traced", "dmma"]),
    "engine-paged-blocks-ops": ({}, ["fused", "engine", "paged", "traced", "blocks", "blocks-ops"]),
    "engine-paged-blocks-ops-rw": ({}, ["fused", "engine", "paged", "traced", "blocks", "blocks-ops", "ops-rw=1"]),
    "engine-paged-blocks-scatter": ({}, ["fused", "engine", "paged", "traced", "blocks", "pool-scatter"]),
    "engine-paged-write": ({}, ["fused", "engine", "paged", "traced", "pool-write=1"]),
    "engine-paged-q-blocks-ops": ({}, ["fused", "fused-q", "engine", "paged", "traced", "qgemv", "gemv-to-64",
                                       "qmma", "wide", "mma-wide", "blocks", "blocks-ops"]),
    "engine-paged-blocks-smallpool": ({}, ["fused", "engine", "paged", "traced", "blocks", "step-pad=0"]),
    "engine-paged-q-blocks": ({}, Q_BLOCKS),
    **{f"engine-paged-q-blocks-{suffix}": ({}, Q_BLOCKS + extra) for suffix, extra in [
        ("res", ["q-res=1"]), ("write", ["pool-write=1"]), ("res-write", ["q-res=1", "pool-write=1"]),
        ("s16", ["q-res=0", "pool-write=0"]), ("rope", ["q-rope=1"]), ("swiglu", ["q-swiglu=1"]),
        ("epi", ["q-rope=1", "q-swiglu=1"]), ("s17", ["q-rope=0", "q-swiglu=0"]),
        ("smallpool", ["step-pad=0"]), ("magic", ["q-magic=1"]), ("magic-f8", ["q-magic=1", "q-features=8"]),
        ("magic-w8", ["q-magic=1", "q-warps=8"]), ("w1", ["q-warps=1"]), ("w2", ["q-warps=2"]),
        ("f2", ["q-features=2"]), ("w2-f8", ["q-warps=2", "q-features=8"]),
        ("w1-u4", ["q-warps=1", "q-unroll=4"]), ("w2-u2", ["q-warps=2", "q-unroll=2"])]},
    "engine-paged-nographs": ({"MLX_USE_CUDA_GRAPHS": "0"}, ["fused", "engine", "paged", "traced"]),
    "engine-paged-ops50": ({"MLX_MAX_OPS_PER_BUFFER": "50"}, ["fused", "engine", "paged", "traced"]),
    "engine-paged-ops300": ({"MLX_MAX_OPS_PER_BUFFER": "300"}, ["fused", "engine", "paged", "traced"]),
    "engine-paged-blocks-nographs": ({"MLX_USE_CUDA_GRAPHS": "0"}, ["fused", "engine", "paged", "traced", "blocks"]),
    "engine-paged-q-nographs": ({"MLX_USE_CUDA_GRAPHS": "0"}, ["fused", "fused-q", "engine", "paged", "traced",
                                                              "qgemv", "gemv-to-64", "qmma", "wide", "mma-wide"]),
    "engine-paged-u4": ({}, ["fused", "engine", "paged", "traced", "in-flight=4"]),
    "engine-paged-u8": ({}, ["fused", "engine", "paged", "traced", "in-flight=8"]),
    "engine-paged-q-norms": ({}, ["fused", "fused-q", "engine", "paged", "traced", "qgemv", "gemv-to-64", "qmma",
                                  "wide", "mma-wide", "norms"]),
}


# features "name=value" set these module constants (module under unikern.stages.execute, name)
SETTINGS = {"few-blocks": ("cuda.paged_attention", "FEW_BLOCKS"),
            "split-blocks": ("cuda.paged_attention", "SPLIT_BLOCKS"),
            "split-min": ("cuda.paged_attention", "SPLIT_MIN_POSITIONS"),
            "in-flight": ("cuda.paged_attention", "POSITIONS_IN_FLIGHT"),
            "blocks-unroll": ("cuda.block_gemv", "UNROLL"), "blocks-target": ("cuda.block_gemv", "TARGET_BLOCKS"),
            "blocks-norm": ("blocks", "KERNEL_NORM"), "blocks-rope": ("blocks", "KERNEL_ROPE"),
            "pool-write": ("paged_cache", "WRITE_IN_PLACE"), "q-res": ("quantized", "GEMV_RESIDUAL"),
            "q-rope": ("quantized", "GEMV_ROPE"), "q-swiglu": ("quantized", "GEMV_SWIGLU"),
            "step-pad": ("layouts", "PAD_STEP_ROWS"), "ops-rw": ("blocks", "OPS_ROPE_WRITE"),
            "q-magic": ("cuda.q4_gemv", "GEMV_MAGIC_NIBBLES"), "q-features": ("cuda.q4_gemv", "GEMV_FEATURES"),
            "q-warps": ("cuda.q4_gemv", "GEMV_WARPS"), "q-unroll": ("cuda.q4_gemv", "GEMV_UNROLL"),
            "block-unroll": ("cuda.block_kernel", "UNROLL"),
            "block-grid": ("cuda.block_kernel", "GRID_BLOCKS"), "block-warps": ("cuda.block_kernel", "WARPS"),
            "block-attn-split": ("cuda.block_kernel", "ATTN_SPLIT"), "block-preload": ("cuda.block_kernel", "PRELOAD")}


def compile_mlp_halves(model) -> int:
    import mlx.core as mx

    from unikern.stages.execute.routing import layers_of

    layers = layers_of(model)
    for layer in layers:
        mlp, norm = layer.mlp, layer.post_attention_layernorm

        def half(h, mlp=mlp, norm=norm):
            return h + mlp(norm(h))

        layer._half = mx.compile(half)
        attn, in_norm = layer.self_attn, layer.input_layernorm

        def call(x, mask=None, cache=None, layer=layer, attn=attn, in_norm=in_norm):
            return layer._half(x + attn(in_norm(x), mask, cache))

        layer.__call__ = call  # instance attribute: the model calls layer(...) below
    return len(layers)


def child(args) -> None:
    importlib.import_module("unikern")  # first: MLX's kernel cache where the engine keeps it
    import mlx.core as mx
    from mlx_lm import load
    from mlx_lm.models.cache import make_prompt_cache

    from unikern.stages.execute.routing import layers_of

    model, _ = load(args.model)
    features = args.features.split(",") if args.features else []
    for f in features:  # "name=value": one of SETTINGS
        key, _, value = f.partition("=")
        if key in SETTINGS:
            module, name = SETTINGS[key]
            setattr(importlib.import_module(f"unikern.stages.execute.{module}"), name, int(value))
    notes = {}
    if "fused" in features:  # the engine's own (execute.fuse_projections)
        from unikern.stages.execute.fused import fuse_projections

        # as "auto" does: quantized layers too where unikern's 4-bit kernels run them
        notes["fused_groups"] = fuse_projections(model, quantized="fused-q" in features)
    if "dmma" in features:  # execute.dense_mma=always
        from unikern.stages.execute.dense_mma import route_dense_layers

        notes["dense_mma_layers"] = route_dense_layers(model)
    if "norms" in features:  # execute.fuse_norms=always
        from unikern.stages.execute.residual import fuse_residual_norms

        notes["norm_blocks"] = fuse_residual_norms(model)
    if "blocks" in features:  # execute.fuse_blocks=always
        from unikern.stages.execute import blocks

        # blocks-ops: steps of more rows through MLX's ops (execute.fuse_blocks_ops_rows=64)
        notes["decode_blocks"] = blocks.fuse_decode_blocks(model, ops_rows=64 if "blocks-ops" in features else 0,
                                                           one_kernel="blocks-one" in features)
    if "pool-scatter" in features:  # the pool writes by the cache's two scatters per layer, as before
        from unikern.stages.execute.paged_cache import PagedLayerCache

        PagedLayerCache._kernel_reads = lambda *_: False
    if "qgemv" in features:  # as execute.quantized_gemv does, with dequantize_rows' 8 (or 65)
        from unikern.stages.execute.cuda import q4_gemv, q4_mma
        from unikern.stages.execute.quantized import route_quantized_layers

        q4_gemv.GEMV_WIDE_LOADS = "wide" in features
        q4_mma.MMA_SHAPE = "wide" if "mma-wide" in features else "narrow"

        notes["qgemv_layers"] = route_quantized_layers(model, 65 if "gemv-to-64" in features else 8, gemv=True,
                                                       mma="qmma" in features, mma_split="split" in features)
    layers = layers_of(model)
    if "compiled" in features:
        compile_mlp_halves(model)
        # nn.Module.__call__ is looked up on the type: route through the instance's
        for layer in layers:
            layer.__class__ = type("Compiled" + type(layer).__name__, (type(layer),),
                                   {"__call__": lambda self, *a, **k: self.__dict__["__call__"](*a, **k)})
        notes["compiled_layers"] = len(layers)
    prompt = mx.array([(7 * j) % 1000 + 5 for j in range(args.prompt)])

    def run_mlx_lm(n: int, profile=None) -> dict:
        cache = make_prompt_cache(model)
        logits = model(prompt[None], cache=cache)[:, -1, :]
        y = mx.argmax(logits, axis=-1)
        mx.eval(y)
        build = submit = wait = 0.0
        tokens = []
        start = time.perf_counter()
        for _ in range(n):
            t0 = time.perf_counter()
            nxt = mx.argmax(model(y[:, None], cache=cache)[:, -1, :], axis=-1)
            t1 = time.perf_counter()
            mx.async_eval(nxt)
            t2 = time.perf_counter()
            tokens.append(y.item())
            t3 = time.perf_counter()
            build, submit, wait = build + t1 - t0, submit + t2 - t1, wait + t3 - t2
            y = nxt
            if profile is not None:
                profile.step()
        y.item()
        wall = time.perf_counter() - start
        ms = 1e3 / n
        return {"tokens": tokens, "ms_per_token": wall * ms, "build_ms": build * ms, "submit_ms": submit * ms, "wait_ms": wait * ms}

    run = engine_run(model, args, features, notes) if "engine" in features else run_mlx_lm
    run(8)  # kernels built, graphs cached
    rows = [run(args.tokens) for _ in range(args.repeats)]
    out = {k: statistics.median(r[k] for r in rows) for k in rows[0] if k not in ("tokens", "decoded")}
    out["tokens"] = rows[0]["tokens"][:32]
    out.update(notes)
    try:
        out.update(kernel_profile(run))
    except Exception as exc:  # a profile is a bonus: the timings above stand without it
        out["profile_error"] = f"{type(exc).__name__}: {exc}"[:300]
    print("PROBE " + json.dumps(out))


def engine_run(model, args, features: list[str], notes: dict):
    """A run(n) over unikern's ModelRunner: a prefill, then lookahead windows of 32, for
    --rows requests decoding together (ms_per_token is per step: a token of every row)."""
    import mlx.core as mx

    from unikern import messages as m
    from unikern.stages.execute.cuda import paged_attention
    from unikern.stages.execute.model import ModelGeometry
    from unikern.stages.execute.runner import ModelRunner
    from unikern.stages.kv.pool import KVPool

    if "group" in features or "head" in features:
        paged_attention.KERNEL = "group" if "group" in features else "head"
    geo = ModelGeometry(model)
    block_size, window = 16, 32
    blocks = -(-(args.prompt + args.tokens + window + 1) // block_size)
    pool = KVPool(num_layers=geo.num_layers, num_kv_heads=geo.num_kv_heads, head_dim=geo.head_dim,
                  dtype=geo.dtype, block_size=block_size, kernel_block_size=block_size,
                  num_blocks=args.rows * blocks + 2, slab_blocks=args.rows * blocks + 2)
    runner = ModelRunner(model, pool, None, cpu_kernels=False, compile_decode=True, geometry=geo,
                         paged_attention="paged" in features, compile_one_row="traced" in features)
    notes["paged"] = runner.paged_report
    notes["one_row_traced"] = runner.compile_one_row
    rows = args.rows
    tables = [tuple(range(2 + r * blocks, 2 + (r + 1) * blocks)) for r in range(rows)]
    params = m.SamplingParams(max_tokens=args.tokens + window)
    # distinct prompts: the rows' tokens differ, as a server's do
    prompts = [tuple((7 * j + 13 * r) % 1000 + 5 for j in range(args.prompt)) for r in range(rows)]

    # the host's time per step, split: the traced forward's replay (Python and MLX's graph
    # copy), MLX's encoding and launch (`mx.async_eval`), the window's last wait (`mx.eval`);
    # the rest of the wall time is the runner's own Python (sampling, tables)
    spent = {"build": 0.0, "submit": 0.0, "wait": 0.0}
    timed(mx, "async_eval", spent, "submit")
    timed(mx, "eval", spent, "wait")
    if runner.compiled is not None:
        timed(runner, "compiled", spent, "build")

    def run(n: int, profile=None) -> dict:
        out = runner.run(m.Step(1, tuple(m.SeqWork(f"r{r}", prompts[r], 0, tables[r], True, params)
                                         for r in range(rows)), 1), {})
        tokens, pos = {k: [v[-1]] for k, v in out.items()}, len(prompts[0])
        if "census" not in notes:  # once the pool holds the rows' blocks (it grows as used)
            notes["census"] = graph_census(runner, pool, [(t, pos) for t in tables], window)
        spent.update(build=0.0, submit=0.0, wait=0.0)
        start = time.perf_counter()
        while len(tokens["r0"]) <= n:
            work = tuple(m.SeqWork(f"r{r}", (tokens[f"r{r}"][-1],), pos, tables[r], True, params,
                                   num_generated=len(tokens["r0"])) for r in range(rows))
            for k, v in runner.run(m.Step(2, work, window), {}).items():
                tokens[k] += v
            pos += window
            if profile is not None:
                profile.step()
        wall = time.perf_counter() - start
        done = len(tokens["r0"]) - 1
        ms = 1e3 / done
        return {"tokens": tokens["r0"][:n], "decoded": done, "ms_per_token": wall * ms,
                **{f"{k}_ms": v * ms for k, v in spent.items()},
                "other_ms": (wall - sum(spent.values())) * ms}

    return run


def graph_census(runner, pool, rows, window: int) -> dict:
    """The primitives of one traced decode step's graph (what MLX's eval walks per
    token), counted by type from `mx.export_to_dot`, before any of it is evaluated."""
    import re
    import tempfile

    import mlx.core as mx

    from unikern.stages.execute.layouts import DecodeWindow

    if runner.compiled is None:
        return {}
    layout = DecodeWindow(pool, rows, window, bucketed=True)
    logits = runner.compiled(pool, layout, mx.zeros((layout.rows_run,), dtype=mx.uint32), 0)
    token = mx.argmax(logits, axis=-1)
    with tempfile.NamedTemporaryFile("r", suffix=".dot") as f:
        mx.export_to_dot(f.name, token, *pool.keys, *pool.values)
        labels = re.findall(r'label ="([^"]+)"', f.read())
    counts: dict[str, int] = {}
    for label in labels:
        counts[label] = counts.get(label, 0) + 1
    mx.eval(token)  # the pool arrays the step wrote are the pool's now
    return {"primitives": len(labels), "by_type": dict(sorted(counts.items(), key=lambda kv: -kv[1]))}


def timed(owner, name: str, spent: dict, key: str, when=None) -> None:
    """Replace owner.name (a callable: a module function or an object) by one that adds
    its calls' time to spent[key]; with `when`, only the calls made while when() holds."""
    inner = getattr(owner, name)

    def call(*args, **kwargs):
        if when is not None and not when():
            return inner(*args, **kwargs)
        t = time.perf_counter()
        try:
            return inner(*args, **kwargs)
        finally:
            spent[key] += time.perf_counter() - t

    setattr(owner, name, call)


def kernel_profile(run) -> dict:
    """GPU kernel time per token from CUPTI (PyTorch's profiler sees every kernel of the
    process, MLX's included), grouped by kernel name."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.init()
    n = 16
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        n = run(n).get("decoded", n)  # the engine decodes whole windows
    kernels: dict[str, list[float]] = {}
    for e in prof.events():
        if e.device_type.name == "CUDA" or getattr(e, "device_time", 0):
            us = getattr(e, "device_time", None) or getattr(e, "cuda_time", 0)
            kernels.setdefault(e.name, []).append(us)
    total = sum(sum(v) for v in kernels.values())
    count = sum(len(v) for v in kernels.values())
    top = sorted(kernels.items(), key=lambda kv: -sum(kv[1]))[:14]
    # the prefill of run() is in the window too: per-token figures are upper bounds
    return {
        "gpu_ms_per_token": total / 1e3 / n,
        "kernels_per_token": count / n,
        "top_kernels": [{"name": k[:90], "count_per_token": len(v) / n, "us_per_token": sum(v) / n}
                        for k, v in top],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", required=True)
    parser.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=VARIANTS)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--prompt", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--rows", type=int, default=1, help="engine variants: requests decoding together")
    parser.add_argument("--timeout", type=int, default=240)
    parser.add_argument("--rounds", type=int, default=1,
                        help="run the variant list this many times, interleaved, each variant in a fresh process "
                             "every round: the host's speed moves between processes by more than some variants "
                             "differ (one H200, 2026-12-01)")
    parser.add_argument("--json")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--features", default="", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        return child(args)
    results = {}
    for round_, name in ((r, n) for r in range(args.rounds) for n in args.variants):
        env, features = VARIANTS[name]
        cmd = [sys.executable, "-m", __spec__.name, "--child", "--model", args.model, "--tokens", str(args.tokens),
               "--prompt", str(args.prompt), "--repeats", str(args.repeats), "--rows", str(args.rows), "--features", ",".join(features)]
        try:
            done = subprocess.run(cmd, env={**os.environ, **env}, capture_output=True, text=True,
                                  timeout=args.timeout)
            line = next((x for x in done.stdout.splitlines() if x.startswith("PROBE ")), None)
            r = json.loads(line[6:]) if line else {"error": done.stderr[-1500:]}
        except subprocess.TimeoutExpired:
            r = {"error": f"timed out after {args.timeout} s"}
        if round_ == 0:
            results[name] = r
        elif "error" not in r:  # later rounds: their timings beside the first round's figures
            results[name].setdefault("rounds", [results[name].get("ms_per_token")]).append(r["ms_per_token"])
            results[name].setdefault("gpu_rounds", [results[name].get("gpu_ms_per_token")]).append(
                r.get("gpu_ms_per_token"))
        first = results[args.variants[0]]
        if "error" not in r and name != args.variants[0] and "tokens" in first:
            r["same_tokens_as_first"] = r["tokens"] == first["tokens"]
        if "error" in r:
            print(f"{name:24s} ERROR {r['error'][-600:]}", flush=True)
            continue
        if round_ > 0:
            print(f"{name:24s} {r['ms_per_token']:6.3f} ms/token  gpu {r.get('gpu_ms_per_token', float('nan')):.3f}"
                  f"  (round {round_ + 1}) same tokens {r.get('same_tokens_as_first', '-')}", flush=True)
            continue
        print(f"{name:24s} {r['ms_per_token']:6.3f} ms/token  build {r['build_ms']:.3f}  submit "
              f"{r['submit_ms']:.3f}  wait {r['wait_ms']:.3f}  other {r.get('other_ms', float('nan')):.3f}  gpu {r.get('gpu_ms_per_token', float('nan')):.3f} "
              f"({r.get('kernels_per_token', 0):.0f} kernels) same tokens {r.get('same_tokens_as_first', '-')} "
              f"{r.get('profile_error', '')}", flush=True)
        if r.get("census"):
            print(f"    graph of one step: {r['census']['primitives']} primitives: "
                  + ", ".join(f"{k} {v}" for k, v in list(r["census"]["by_type"].items())[:14]), flush=True)
        for k in r.get("top_kernels", [])[:8]:
            print(f"    {k['us_per_token']:8.1f} us  x{k['count_per_token']:5.1f}  {k['name']}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"model": args.model, "tokens": args.tokens, "variants": results}, f, indent=1)


if __name__ == "__main__":
    main()
