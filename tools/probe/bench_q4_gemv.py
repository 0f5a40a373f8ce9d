"""The 4-bit GEMV (stages/execute/cuda/q4_gemv.py) variant by variant at a model's
shapes, against MLX's own quantized matmul: the kernel's GPU time per call (CUPTI, through
PyTorch's profiler), the weight bytes it read per second, and what one token's 4-bit
GEMVs would take (layers x the four projections + the output head). Needs CUDA.

    python -m tools.probe.bench_q4_gemv [--rows 1 16] [--variants default SUMS=1 ...]
        [--hidden 4096 --heads 32 --kv-heads 8 --mlp 14336 --vocab 128256 --layers 32]
        [--json out.json]

A variant is "mlx" (mx.quantized_matmul), "default" (q4_gemv as it ships, one-row steps
shaped by the weight's shape: GEMV_ONE_ROW_SHAPES) or q4_gemv's GEMV_* constants as
UNIKERN_Q4_GEMV takes them ("SUMS=1,WARPS=1,UNROLL=4"), which set every shape's block
alike (the one-row shapes off unless the variant names ONE_ROW_SHAPES). The projections
run as the 4-bit blocks call them: q/k/v plain (its RoPE epilogue costs the same loads),
o and down with the residual added inside, gate/up with SwiGLU.
Each shape runs over `--distinct` weight matrices (so they come from HBM, not L2).
`--best FILE` writes the variant with the lowest one-row token estimate there, as
UNIKERN_Q4_GEMV takes it (tools/device/h200_gpu.sh's q4-gemv step hands it to the later
steps).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

DEFAULT_VARIANTS = ["mlx", "default", "ONE_ROW_SHAPES=0", "SUMS=1", "WARPS=1,UNROLL=4", "SUMS=1,WARPS=2,UNROLL=2",
                    "SUMS=1,FEATURES=2", "SUMS=1,WARPS=8", "WARPS=8", "WARPS=2,UNROLL=2"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--hidden", type=int, default=4096)
    parser.add_argument("--heads", type=int, default=32)
    parser.add_argument("--kv-heads", type=int, default=8)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--mlp", type=int, default=14336)
    parser.add_argument("--vocab", type=int, default=128256)
    parser.add_argument("--layers", type=int, default=32, help="the model's layers (the token estimate)")
    parser.add_argument("--distinct", type=int, default=16, help="distinct weight matrices per shape")
    parser.add_argument("--group-size", type=int, default=64)
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 16])
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--variants", nargs="+", default=DEFAULT_VARIANTS)
    parser.add_argument("--json")
    parser.add_argument("--best", help="write the fastest variant (one row) here, as UNIKERN_Q4_GEMV takes it")
    args = parser.parse_args()

    import mlx.core as mx
    import mlx.nn as nn

    if not mx.cuda.is_available():
        sys.exit("bench_q4_gemv: needs MLX's CUDA backend (the kernel is CUDA source)")
    from tools.probe.probe_cuda import kernel_profile
    from unikern.stages.execute import quantized
    from unikern.stages.execute.cuda import q4_gemv

    defaults = {name: getattr(q4_gemv, name) for name in vars(q4_gemv) if name.startswith("GEMV_")}
    E, F, gs = args.hidden, args.mlp, args.group_size
    qkv_n = (args.heads + 2 * args.kv_heads) * args.head_dim
    mx.random.seed(0)

    def layers(n: int, k: int, count: int) -> list[nn.QuantizedLinear]:
        made = []
        for _ in range(count):
            layer = nn.QuantizedLinear(k, n, bias=False, group_size=gs, bits=4)
            layer.set_dtype(mx.bfloat16)
            made.append(layer)
        mx.eval([layer.parameters() for layer in made])
        return made

    shapes = {  # name: (layers, input width, calls per token)
        "qkv": (layers(qkv_n, E, args.distinct), E, args.layers),
        "o": (layers(E, args.heads * args.head_dim, args.distinct), args.heads * args.head_dim, args.layers),
        "gate_up": (layers(2 * F, E, args.distinct), E, args.layers),
        "down": (layers(E, F, args.distinct), F, args.layers),
        "head": (layers(args.vocab, E, max(2, args.distinct // 8)), E, 1),
    }

    def call(variant: str, shape: str, layer: nn.QuantizedLinear, x: mx.array, res: mx.array) -> mx.array:
        if variant == "mlx":
            y = layer(x)
            if shape == "gate_up":
                gate, up = mx.split(y, 2, axis=-1)
                return nn.silu(gate) * up
            return y + res if shape in ("o", "down") else y
        if shape == "gate_up":
            return q4_gemv.gemv_swiglu(x, layer)
        w, s, b = layer["weight"], layer["scales"], layer["biases"]
        return q4_gemv.gemv(x, w, s, b, gs, res=res if shape in ("o", "down") else None)

    results = []
    for variant in args.variants:
        for name, value in defaults.items():
            setattr(q4_gemv, name, value)
        if variant not in ("mlx", "default"):
            q4_gemv.GEMV_ONE_ROW_SHAPES = False
            quantized.set_gemv_constants(variant)
        for rows in args.rows:
            per_shape = {}
            for shape, (made, k, _) in shapes.items():
                x = (mx.random.normal((rows, k)) * 0.5).astype(mx.bfloat16)
                res = mx.random.normal((rows, made[0].weight.shape[0])).astype(mx.bfloat16)
                mx.eval(x, res)
                mx.eval([call(variant, shape, layer, x, res) for layer in made])  # built and warm

                def run(_n, made=made, x=x, res=res, shape=shape, variant=variant):
                    for _ in range(args.repeats):
                        mx.eval([call(variant, shape, layer, x, res) for layer in made])
                    return {"decoded": args.repeats * len(made)}

                start = time.perf_counter()
                run(0)
                wall_us = (time.perf_counter() - start) / (args.repeats * len(made)) * 1e6
                profiled = kernel_profile(run)
                us = profiled["gpu_ms_per_token"] * 1e3
                nbytes = sum(v.nbytes for v in (made[0]["weight"], made[0]["scales"], made[0]["biases"]))
                per_shape[shape] = {"gpu_us": round(us, 2), "wall_us": round(wall_us, 2),
                                    "kernels": profiled["kernels_per_token"], "tb_per_s": round(nbytes / us / 1e6, 3)}
            token_us = sum(per_shape[s]["gpu_us"] * calls for s, (_, _, calls) in shapes.items())
            row = {"variant": variant, "rows": rows, "token_gpu_us": round(token_us, 1), "shapes": per_shape}
            results.append(row)
            print(f"{variant:<36} rows {rows:>2}  token {token_us / 1e3:6.3f} ms  "
                  + "  ".join(f"{s} {v['gpu_us']:.1f}us {v['tb_per_s']:.2f}TB/s" for s, v in per_shape.items()),
                  flush=True)
    one_row = [r for r in results if r["rows"] == min(args.rows) and r["variant"] != "mlx"]
    best = min(one_row, key=lambda r: r["token_gpu_us"]) if one_row else None
    if best:
        print(f"fastest at {best['rows']} row(s): {best['variant']} ({best['token_gpu_us'] / 1e3:.3f} ms a token)")
    if args.best and best:
        Path(args.best).write_text("" if best["variant"] == "default" else best["variant"])
    if args.json:
        Path(args.json).write_text(json.dumps({"args": vars(args), "results": results}, indent=1))


if __name__ == "__main__":
    main()
