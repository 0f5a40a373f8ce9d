"""MLX float32 GEMM throughput with and without the optimized-BLAS preload.

Each configuration runs in a fresh subprocess, because the preload only works before
`mlx` is first imported. Usage: python -m tools.bench.bench_blas [--rows 1 8 32 128] [--size 1024]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

# Runs inside the child: preload (or not), then time `x @ w` for each row count.
CHILD = r"""
import json, sys, time
from unikern.platform import blas
chosen = blas.preload()
import mlx.core as mx
rows_list, size, min_seconds = json.loads(sys.argv[1])
w = mx.random.normal((size, size), dtype=mx.float32)
results = {}
for rows in rows_list:
    x = mx.random.normal((rows, size), dtype=mx.float32)
    mx.eval(x, w)
    for _ in range(3):
        mx.eval(x @ w)
    iterations, start = 0, time.perf_counter()
    while True:
        mx.eval(x @ w)
        iterations += 1
        elapsed = time.perf_counter() - start
        if elapsed >= min_seconds and iterations >= 5:
            break
    results[rows] = 2.0 * rows * size * size * iterations / elapsed / 1e9
print(json.dumps({"library": blas.info().library, "gflops": results}))
"""


def run_child(blas_setting: str, rows: list[int], size: int, min_seconds: float) -> dict:
    env = {**os.environ, "UNIKERN_BLAS": blas_setting}
    done = subprocess.run(
        [sys.executable, "-c", CHILD, json.dumps([rows, size, min_seconds])],
        env=env,
        capture_output=True,
        text=True,
        check=True,
    )
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 8, 32, 128])
    parser.add_argument("--size", type=int, default=1024, help="K = N of the weight matrix")
    parser.add_argument("--min-seconds", type=float, default=0.5, help="timing per row count")
    parser.add_argument("--blas", default="auto", help="UNIKERN_BLAS for the preload run")
    args = parser.parse_args()

    reference = run_child("off", args.rows, args.size, args.min_seconds)
    preloaded = run_child(args.blas, args.rows, args.size, args.min_seconds)
    print(f"float32 GEMM [rows, {args.size}] @ [{args.size}, {args.size}], GFLOP/s")
    print(f"  reference: {reference['library']}")
    print(f"  preload:   {preloaded['library']}")
    print(f"{'rows':>6} {'reference':>11} {'preload':>11} {'ratio':>8}")
    for rows in args.rows:
        slow, fast = reference["gflops"][str(rows)], preloaded["gflops"][str(rows)]
        print(f"{rows:>6} {slow:>11.2f} {fast:>11.2f} {fast / slow:>7.1f}x")


if __name__ == "__main__":
    main()
