"""What it costs a CUDA kernel to read (or count on) a small array, by where MLX put it.

MLX's CUDA allocator keeps arrays of up to 8 bytes in one pool of managed memory that
the host writes and the GPU reaches across the bus, and arrays made on the host (a
step's positions, slots, lengths, tables: `mx.array(...)`) in managed memory as well.
On an H200 a residual kernel whose every block counted on a one-element counter there
took 600 us instead of 10 (2026-12-02). This probe times one
small kernel (a grid of blocks; each thread reads the array's first element, then adds
it over its share of a 1 MB buffer) in steps of --launches launches, the array made
again for every step where a case says "fresh" (as the engine makes its step's inputs),
and prints the GPU time per launch (CUPTI, through PyTorch's profiler) and the host's
wall time per step, by case:

  template        the value as a template argument: no read (the floor)
  device          16 int32 made on the GPU once (device memory)
  small           one int32 made on the host once (MLX's pool of small arrays)
  small-fresh     one int32 made on the host for every step
  host16-fresh    16 int32 made on the host for every step (managed memory)
  host1k-fresh    1,024 int32 made on the host for every step
  host16-copied   16 int32 made on the host for every step, copied on the GPU once
                  (`+ 0`) and the copy read by the step's launches
  atomic-small    each block adds 1 to a one-element counter (the small pool) as well
  atomic-device   each block adds 1 to a 4-element counter made on the GPU

    python -m tools.probe.probe_memory [--launches 16] [--steps 32] [--blocks 264] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

_SOURCE = """
    const int base = TEMPLATE ? VALUE : v[0];
    if (ATOMIC && threadIdx.x == 0) atomicAdd(const_cast<unsigned*>(counter), 1u);
    const int n = x_shape[0];
    for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < n; i += gridDim.x * blockDim.x)
        out[i] = x[i] + static_cast<float>(base);
"""

CASES = ("template", "device", "small", "small-fresh", "host16-fresh", "host1k-fresh", "host16-copied",
         "atomic-small", "atomic-device")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--launches", type=int, default=16, help="launches per step, each reading the step's array")
    parser.add_argument("--steps", type=int, default=32)
    parser.add_argument("--blocks", type=int, default=264)
    parser.add_argument("--cases", nargs="+", default=list(CASES), choices=CASES)
    parser.add_argument("--json")
    args = parser.parse_args()

    import unikern  # noqa: F401  (first: MLX's kernel cache where the engine keeps it)

    # isort: split
    import mlx.core as mx
    import torch
    from torch.profiler import ProfilerActivity, profile

    from unikern.platform.kernel_cache import cuda_kernel

    if not mx.cuda.is_available():
        raise SystemExit("probe_memory times CUDA kernels: this machine's MLX has no CUDA backend")
    torch.cuda.init()
    kernel = cuda_kernel("unikern_probe_memory", ("x", "v", "counter"), _SOURCE)
    x = mx.zeros((1 << 18,), dtype=mx.float32)
    counters = {"atomic-small": mx.zeros((1,), dtype=mx.uint32), "atomic-device": mx.zeros((4,), dtype=mx.uint32)}
    device16, small = mx.full((16,), 1, dtype=mx.int32), mx.array([1], dtype=mx.int32)
    mx.eval(x, device16, small, *counters.values())

    def step_input(case: str) -> mx.array:
        if case in ("template", "device", "atomic-device"):
            return device16
        if case in ("small", "atomic-small"):
            return small
        if case == "small-fresh":
            return mx.array([1], dtype=mx.int32)
        if case == "host1k-fresh":
            return mx.array(list(range(1, 1025)), dtype=mx.int32)
        fresh = mx.array(list(range(1, 17)), dtype=mx.int32)
        return fresh + 0 if case == "host16-copied" else fresh

    def run(case: str, steps: int) -> float:
        """`steps` steps of the case; returns the host's wall seconds per step."""
        counter = counters.get(case, counters["atomic-device"])
        template = [("TEMPLATE", int(case == "template")), ("VALUE", 1), ("ATOMIC", int(case.startswith("atomic")))]
        y, t0 = x, time.perf_counter()
        for _ in range(steps):
            v = step_input(case)
            for _ in range(args.launches):
                (y,) = kernel(inputs=[y, v, counter], template=template, grid=(args.blocks * 256, 1, 1),
                              threadgroup=(256, 1, 1), output_shapes=[x.shape], output_dtypes=[mx.float32])
            mx.eval(y)
        return (time.perf_counter() - t0) / steps

    results = {}
    for case in args.cases:
        run(case, 2)  # builds the kernel and warms the allocator's cache
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            walls = [run(case, 1) for _ in range(args.steps)]
        times = [getattr(e, "device_time", None) or getattr(e, "cuda_time", 0) for e in prof.events()
                 if "unikern_probe_memory" in e.name]
        results[case] = {"gpu_us_per_launch": statistics.median(times) if times else None,
                         "gpu_us_per_launch_mean": statistics.fmean(times) if times else None,
                         "launches": len(times), "wall_us_per_step": statistics.median(walls) * 1e6}
        r = results[case]
        print(f"{case:15s} GPU {r['gpu_us_per_launch'] or 0:8.2f} us per launch (mean "
              f"{r['gpu_us_per_launch_mean'] or 0:8.2f}, {len(times)} launches)  host {r['wall_us_per_step']:9.1f} "
              f"us per step of {args.launches}", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"launches_per_step": args.launches, "blocks": args.blocks, "cases": results}, f, indent=1)


if __name__ == "__main__":
    main()
