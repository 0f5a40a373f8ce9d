"""Where the one-row decode step of a decoder block goes inside block_kernel.py's one
kernel, phase by phase, and what its variants cost. Needs MLX's CUDA backend.

    python -m tools.probe.probe_block_phases [--hidden 2048 --heads 32 --kv-heads 8 --mlp 8192]
        [--layers 16] [--positions 128] [--repeats 30] [--variants default UNROLL=2 WARPS=8,SPLITS=4/2/1/2]
        [--json out.json]

Random weights of `--layers` blocks (as many as the model has, so every launch reads its
weights from HBM, not from L2) run as a chain, each block's output the next one's input,
as the engine's token runs them. Per variant (comma-separated block_kernel constants;
"default": none changed): the wall time of `--repeats` chains over their launches (the
host's encoding of a launch alone: on an H200 90-108 us against 55-58 us of kernel), and,
from one more chain with block_kernel.TIMES on, the kernel's own time with the weight
bytes it read per second, and each phase's timeline from the kernel's start (median over
the layers): when the first and the last block had the phase's input row staged and had
its work done, and when the last one left the barrier after it.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

PHASE_NAMES = ("q/k/v + RoPE", "attention", "o + residual", "gate/up + SwiGLU", "down + residual")


def main() -> None:
    from tools.probe.bench_block_gemv import shape_arguments

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    shape_arguments(parser)
    parser.add_argument("--positions", type=int, default=128, help="the row's context (its slot table)")
    parser.add_argument("--repeats", type=int, default=30)
    parser.add_argument("--variants", nargs="+", default=["default"],
                        help="comma-separated block_kernel constants per variant, e.g. UNROLL=2,WARPS=8")
    parser.add_argument("--json")
    args = parser.parse_args()

    import mlx.core as mx
    import mlx.nn as nn
    import numpy as np

    if not mx.cuda.is_available():
        sys.exit("probe_block_phases: needs MLX's CUDA backend (the kernel is CUDA source)")
    from unikern.stages.execute import blocks
    from unikern.stages.execute.cuda import block_kernel as bk

    H, Hk, E, F, L = args.heads, args.kv_heads, args.hidden, args.mlp, args.positions
    D = E // H
    dt = mx.bfloat16
    mx.random.seed(0)

    def w(*shape, scale):
        return (mx.random.normal(shape) * scale).astype(dt)

    layers = []
    for _ in range(args.layers):
        layers.append({
            "qkv": w((H + 2 * Hk) * D, E, scale=E**-0.5), "o": w(E, H * D, scale=(H * D) ** -0.5),
            "gu": w(2 * F, E, scale=E**-0.5), "down": w(E, F, scale=F**-0.5),
            "n1": 1 + w(E, scale=0.1), "n2": 1 + w(E, scale=0.1),
            "k": w(Hk, L + 16, D, scale=1.0), "v": w(Hk, L + 16, D, scale=1.0), "bar": bk.barrier(Hk)})
        mx.eval(list(layers[-1].values()))
    inv_freq, _ = blocks.inverse_frequencies(nn.RoPE(D, base=10000.0), D)
    freq_pi = inv_freq / np.pi
    table = mx.arange(L, dtype=mx.int32)[None]
    # the row's position, length and slot as the engine hands them (DecodeWindow): views of
    # arrays of more than 8 bytes, which MLX keeps in device memory, not in its pool of
    # managed memory for small arrays (every block's read of those crosses the bus; a
    # first run of this tool, with one-element arrays, timed a block at 148 us)
    pos, lengths, wslot = (mx.array([v] * 4, dtype=mx.int32)[:1] for v in (L - 1, L, L - 1))
    weight_bytes = sum(lay[k].nbytes for lay in layers for k in ("qkv", "o", "gu", "down")) / args.layers

    def chain(x):  # the blocks' output row and their TIMES stamps
        stamps = []
        for lay in layers:
            outs = bk.block_step(x, lay["qkv"], None, (lay["n1"], 1e-5), lay["o"], (lay["n2"], 1e-5), lay["gu"],
                                 lay["down"], pos, freq_pi, H, Hk, D, False, D**-0.5, (lay["k"], lay["v"], wslot),
                                 table, lengths, lay["bar"])
            x = outs[0]
            stamps.append(outs[6])
        return x, stamps

    x0 = (mx.random.normal((1, 1, E)) * 0.5).astype(dt)
    results = {}
    for variant in args.variants:
        settings = {} if variant == "default" else dict(kv.split("=", 1) for kv in variant.split(","))
        saved = {k: getattr(bk, k) for k in settings}
        for k, v in settings.items():
            if not hasattr(bk, k):
                sys.exit(f"probe_block_phases: block_kernel has no constant {k!r}")
            setattr(bk, k, tuple(map(int, v.split("/"))) if "/" in v else int(v))  # SPLITS=4/2/1/2
        try:
            bk.TIMES = 0
            x, _ = chain(x0)
            mx.eval(x)  # compiled, warm
            t = time.perf_counter()
            for _ in range(args.repeats):
                x, _ = chain(x)
            mx.eval(x)
            us = 1e6 * (time.perf_counter() - t) / (args.repeats * args.layers)
            bk.TIMES = 1
            _, stamps = chain(x0)
            mx.eval(stamps)
            bk.TIMES = 0
            phases = timeline([np.array(s, dtype=np.int64).reshape(-1, 1 + 3 * bk.PHASES) for s in stamps])
        finally:
            for k, v in saved.items():
                setattr(bk, k, v)
        kernel_us = phases[-1]["left"]  # the last phase's end: the kernel's own time
        results[variant] = {"wall_us_per_launch": us, "kernel_us": kernel_us, "tb_s": weight_bytes / kernel_us / 1e6,
                            "phases": phases}
        print(f"{variant:32s} kernel {kernel_us:6.1f} us ({weight_bytes / kernel_us / 1e6:.2f} TB/s of weights), "
              f"wall {us:6.1f} us a launch", flush=True)
        for name, p in zip(PHASE_NAMES, phases, strict=True):
            print(f"    {name:18s} input staged {p['staged_first']:6.1f}-{p['staged_last']:6.1f}, work ends "
                  f"{p['work_first']:6.1f}-{p['work_last']:6.1f} us, all past its barrier at {p['left']:6.1f}",
                  flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"shape": vars(args), "weight_bytes": weight_bytes, "variants": results}, f, indent=1)


def timeline(per_layer) -> list[dict]:
    """Per phase, medians over the layers, us from the kernel's first block's start: the
    first and the last block to have its input row staged, and to end the phase's work,
    and the last block's leaving of the barrier after it (the kernel's end for the last
    phase). `per_layer`: arrays [blocks, 1 + 3 * phases] of the blocks' clocks (ns, low
    32 bits)."""
    keys = ("staged_first", "staged_last", "work_first", "work_last", "left")
    rows = []
    for s in per_layer:
        d = ((s - s[:, :1].min()) % (1 << 32)) / 1e3  # (the clock's low 32 bits wrap)
        rows.append([(d[:, 1 + 3 * k].min(), d[:, 1 + 3 * k].max(), d[:, 2 + 3 * k].min(), d[:, 2 + 3 * k].max(),
                      d[:, 3 + 3 * k].max()) for k in range((s.shape[1] - 1) // 3)])
    return [{key: statistics.median(r[k][i] for r in rows) for i, key in enumerate(keys)} for k in range(len(rows[0]))]


if __name__ == "__main__":
    main()
