"""The host's cost of one MLX primitive, by kind: chains of N dependent ops (as a model's
decode step is), timed in three parts per op: building the graph in Python, MLX's
encoding and launch (`mx.async_eval`), and the wait for the device.

On an H200 a one-row decode step of the 1B shape spends 1.5-2.6 ms in `mx.async_eval`
for ~240 kernels (measured 2026-12-01), several times the
kernels' own 1.2 ms: this says which primitives cost the host most, kernels or views.

    python -m tools.probe.probe_ops [--n 256] [--repeats 7] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import mlx.core as mx
import mlx.nn as nn

H, D, HIDDEN = 32, 64, 2048


def chains(compiled_n: int) -> dict:
    """name -> (make state, one op on the state): each op feeds the next."""
    dt = mx.bfloat16
    w = mx.random.normal((HIDDEN, HIDDEN)).astype(dt) * 0.02
    norm_w = mx.ones((HIDDEN,), dtype=dt)
    pool_shape = (8, 4096, D)
    index = mx.broadcast_to(mx.array([[[17]]], dtype=mx.int32), (8, 1, D))
    swiglu = mx.compile(lambda a: nn.silu(a) * a)

    def x0():
        return mx.random.normal((1, HIDDEN)).astype(dt)

    def rows(n):
        return lambda: mx.random.normal((n, HIDDEN)).astype(dt)

    def pool0():
        return (mx.zeros(pool_shape, dtype=dt), mx.random.normal((8, 1, D)).astype(dt))

    def scatter(state):
        pool, x = state
        return (mx.put_along_axis(pool, index, x, axis=1), x * 1)

    def slice_write(state):
        pool, x = state
        pool[:, 17:18] = x
        return (pool, x * 1)

    def block(x):  # a residual, a norm and a GEMV: a decoder's pattern
        return x + mx.fast.rms_norm(x, norm_w, 1e-5) @ w.T

    def compiled_chain(x):
        for _ in range(compiled_n):
            x = block(x)
        return x

    ops = {
        "add": (x0, lambda x: x + 1),
        "rms_norm": (x0, lambda x: mx.fast.rms_norm(x, norm_w, 1e-5)),
        # a Linear's x @ W.T: MLX's own GEMV kernel for one row, cuBLASLt for more (and
        # for x @ W, whose weight is not the transposed view the GEMV takes)
        "matmul 1 row (gemv kernel)": (x0, lambda x: x @ w.T),
        "matmul 1 row, x @ W (cuBLASLt)": (x0, lambda x: x @ w),
        "matmul 2 rows (cuBLASLt)": (rows(2), lambda x: x @ w.T),
        "matmul 64 rows (cuBLASLt)": (rows(64), lambda x: x @ w.T),
        "reshape pair (no kernel)": (x0, lambda x: x.reshape(1, H, D).reshape(1, HIDDEN)),
        "transpose pair (no kernel)": (x0, lambda x: x.reshape(1, H, D).transpose(1, 0, 2).transpose(1, 0, 2)
                                       .reshape(1, HIDDEN)),
        "rope (+2 reshapes)": (x0, lambda x: mx.fast.rope(x.reshape(1, H, 1, D), D, traditional=False, base=1e4,
                                                          scale=1.0, offset=5).reshape(1, HIDDEN)),
        "compiled swiglu": (x0, swiglu),
        "argmax+take": (x0, lambda x: x + mx.argmax(x, axis=-1, keepdims=True).astype(dt)),
        "put_along_axis (+mul)": (pool0, scatter),
        "slice_update (+mul)": (pool0, slice_write),
        "add+norm+gemv": (x0, block),
    }
    if compiled_n:
        traced = mx.compile(compiled_chain)
        ops[f"add+norm+gemv, {compiled_n} per compiled call"] = (x0, traced)
    if mx.cuda.is_available():
        copy = mx.fast.cuda_kernel(name="probe_copy", input_names=["a"], output_names=["o"],
                                   source="auto i = blockIdx.x * blockDim.x + threadIdx.x; o[i] = a[i];")

        def custom(x):
            (out,) = copy(inputs=[x], grid=(HIDDEN, 1, 1), threadgroup=(256, 1, 1), output_shapes=[x.shape],
                          output_dtypes=[x.dtype])
            return out

        ops["custom kernel"] = (x0, custom)
    return ops


def measure(make, op, n: int, calls: int) -> dict:
    """One chain of n ops (`calls` calls of op: a compiled call holds several)."""
    state = make()
    mx.eval(state)
    t0 = time.perf_counter()
    for _ in range(calls):
        state = op(state)
    t1 = time.perf_counter()
    mx.async_eval(state)
    t2 = time.perf_counter()
    mx.eval(state)
    t3 = time.perf_counter()
    us = 1e6 / n
    return {"build_us": (t1 - t0) * us, "submit_us": (t2 - t1) * us, "wait_us": (t3 - t2) * us,
            "wall_us": (t3 - t0) * us}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--n", type=int, default=256, help="ops per chain")
    parser.add_argument("--compiled", type=int, default=16, help="blocks per compiled call (0: none)")
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--json")
    args = parser.parse_args()
    results = {}
    print(f"{'op':40s} {'build us':>9} {'submit us':>10} {'wait us':>8} {'wall us':>8}  (per op, medians)")
    for name, (make, op) in chains(args.compiled).items():
        per_call = args.compiled if "compiled call" in name else 1
        calls = max(1, args.n // per_call)
        measure(make, op, calls * per_call, calls)  # kernels built, traces made
        rows = [measure(make, op, calls * per_call, calls) for _ in range(args.repeats)]
        med = {k: statistics.median(r[k] for r in rows) for k in rows[0]}
        results[name] = med
        print(f"{name:40s} {med['build_us']:9.2f} {med['submit_us']:10.2f} {med['wait_us']:8.2f} "
              f"{med['wall_us']:8.2f}", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": str(mx.default_device()), "n": args.n, "ops": results}, f, indent=1)


if __name__ == "__main__":
    main()
