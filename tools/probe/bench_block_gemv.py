"""The fused block's GEMV kernel (stages/execute/cuda/block_gemv.py) variant by variant, against
MLX's own matmul of the same weights: which prologue or epilogue makes a kernel slow.
Needs CUDA (PyTorch's profiler reads the kernels' GPU time through CUPTI).

    python -m tools.probe.bench_block_gemv [--hidden 2048 --heads 32 --kv-heads 8 --mlp 8192]
        [--layers 16] [--rows 1] [--dtype bfloat16] [--set UNROLL=1] [--json out.json]

Each variant runs over `--layers` distinct weight matrices (as many as the model has, so
the weights come from HBM, not from L2) `--repeats` times; per variant it prints the
kernel's GPU time per call (probe_cuda.kernel_profile's CUPTI figures) and the weight bytes it read per second. The block's four
kernels are the variants named qkv-rope-norm, out-residual, gateup-swiglu-norm and
down-residual; the others take one feature away (the norm, the RoPE epilogue and its
three outputs, the SwiGLU epilogue) to show what it costs.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path


def shape_arguments(parser: argparse.ArgumentParser) -> None:
    """The decoder block's shape (the 1B Llama's by default) and how many distinct blocks."""
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--heads", type=int, default=32)
    parser.add_argument("--kv-heads", type=int, default=8)
    parser.add_argument("--mlp", type=int, default=8192)
    parser.add_argument("--layers", type=int, default=16)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    shape_arguments(parser)
    parser.add_argument("--rows", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    parser.add_argument("--set", dest="settings", action="append", default=[],
                        help="a block_gemv module constant, e.g. UNROLL=1 or TARGET_BLOCKS=528")
    parser.add_argument("--json")
    args = parser.parse_args()

    import mlx.core as mx

    if not mx.cuda.is_available():
        sys.exit("bench_block_gemv: needs MLX's CUDA backend (the kernel is CUDA source)")
    from unikern.stages.execute.cuda import block_gemv as bg

    for setting in args.settings:
        name, value = setting.split("=", 1)
        if not hasattr(bg, name):
            sys.exit(f"bench_block_gemv: block_gemv has no constant {name!r}")
        setattr(bg, name, int(value))

    H, Hk, D, E, F = args.heads, args.kv_heads, args.hidden // args.heads, args.hidden, args.mlp
    dt = getattr(mx, args.dtype)
    mx.random.seed(0)

    def weights(n: int, k: int) -> list[mx.array]:
        return [(mx.random.normal((n, k)) * 0.02).astype(dt) for _ in range(args.layers)]

    qkv, out_w, gate_up, down = weights((H + 2 * Hk) * D, E), weights(E, H * D), weights(2 * F, E), weights(E, F)
    x = mx.random.normal((args.rows, E)).astype(dt)
    a = mx.random.normal((args.rows, F)).astype(dt)
    norm = (mx.ones((E,), dtype=dt), 1e-5)
    pos = mx.full((args.rows,), 100, dtype=mx.int32)
    freq_pi = (1.0 / (10000 ** (mx.arange(0, D, 2, dtype=mx.float32) / D))) / math.pi
    rope = dict(pos=pos, freq_pi=freq_pi, head_dim=D, rope_pairs=(H + Hk) * D // 2, q_features=H * D)
    mx.eval(qkv, out_w, gate_up, down, x, a, norm[0], pos, freq_pi)

    variants = {  # name: (weights, kernel call or MLX's matmul)
        "qkv-rope-norm": (qkv, lambda w: bg.gemv(x, w, bg.ROPE, norm=norm, **rope)),
        "qkv-rope": (qkv, lambda w: bg.gemv(x, w, bg.ROPE, **rope)),
        "qkv-plain-norm": (qkv, lambda w: bg.gemv(x, w, bg.PLAIN, norm=norm)),
        "qkv-plain": (qkv, lambda w: bg.gemv(x, w, bg.PLAIN)),
        "qkv-mlx": (qkv, lambda w: x @ w.T),
        "out-residual": (out_w, lambda w: bg.gemv(x, w, bg.RESIDUAL, res=x)),
        "out-mlx": (out_w, lambda w: x @ w.T),
        "gateup-swiglu-norm": (gate_up, lambda w: bg.gemv(x, w, bg.SWIGLU, norm=norm)),
        "gateup-swiglu": (gate_up, lambda w: bg.gemv(x, w, bg.SWIGLU)),
        "gateup-plain": (gate_up, lambda w: bg.gemv(x, w, bg.PLAIN)),
        "gateup-mlx": (gate_up, lambda w: x @ w.T),
        "down-residual": (down, lambda w: bg.gemv(a, w, bg.RESIDUAL, res=x)),
        "down-mlx": (down, lambda w: a @ w.T),
    }
    from tools.probe.probe_cuda import kernel_profile

    rows = []
    for name, (ws, call) in variants.items():
        mx.eval([call(w) for w in ws])  # built and warm

        def run(_n, ws=ws, call=call):
            for _ in range(args.repeats):
                mx.eval([call(w) for w in ws])
            return {"decoded": args.repeats * len(ws)}  # kernel_profile's figures: per call

        profiled = kernel_profile(run)
        us = profiled["gpu_ms_per_token"] * 1e3
        nbytes = ws[0].nbytes
        row = {"variant": name, "us_per_call": us, "kernels_per_call": profiled["kernels_per_token"],
               "weight_bytes": nbytes, "tb_per_s": nbytes / us / 1e6 if us else float("nan")}
        rows.append(row)
        print(f"{name:<20} {us:8.2f} us  {row['tb_per_s']:5.2f} TB/s  {row['kernels_per_call']:.1f} kernels per call",
              flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps({"args": vars(args), "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
