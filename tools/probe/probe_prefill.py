"""Where a prompt's prefill step goes, as the engine runs it: the execute stage's model
(loaded, fused and warmed up by its defaults) and ModelRunner, one fresh prompt per step.
Per step: the host's time building the forward's graph (Python: `ModelRunner._logits`
or `_logits_by_rows`), in `mx.eval` (MLX encoding and launching the kernels, then
waiting for the GPU), the rest (sampling, tables), and with --profile the GPU's own
kernel time (CUPTI, through PyTorch's profiler) with the kernels that take it.

    python -m tools.probe.probe_prefill --model DIR [--lengths 16 64 256] [--repeats 20] [--profile] [--json out.json]
    python -m tools.probe.probe_prefill --model DIR --set prefill_rows=0 ...

The first token's latency (TTFT) of one request is this step plus the messages around
it (tools/probe/step_gaps.py splits those). On MLX's CPU backend the CPU kernels evaluate inside
the forward (execute.cpu_kernels), so there build and eval overlap.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", required=True)
    parser.add_argument("--lengths", type=int, nargs="+", default=[16, 64, 256])
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--profile", action="store_true", help="CUPTI kernel time (needs PyTorch with CUDA)")
    parser.add_argument("--scattered", action="store_true",
                        help="block tables of every other block (gathers), not consecutive ids (slices)")
    parser.add_argument("--set", nargs="*", default=[], metavar="OPTION=VALUE",
                        help="mlx_execute options, e.g. prefill_rows=0")
    parser.add_argument("--json")
    args = parser.parse_args()

    import unikern  # noqa: F401  first: the BLAS MLX's CPU backend should use
    # isort: split
    import mlx.core as mx
    import msgspec

    from unikern import messages as m
    from unikern.platform.pinning import WeightWiring
    from unikern.stages.execute.ranks import make_runner, prepare_model
    from unikern.stages.execute.stage import MLXExecuteParams
    from unikern.stages.kv.pool import KVPool

    options = dict(s.split("=", 1) for s in args.set)
    options = {k.removeprefix("execute."): v for k, v in options.items()}
    params = msgspec.convert({"model": args.model, **options}, MLXExecuteParams, strict=False)
    t = time.perf_counter()
    prepared = prepare_model(params, None, WeightWiring())
    geo = prepared.loaded.geometry
    block_size = 16
    blocks = -(-max(args.lengths) // block_size) + 1
    stride = 2 if args.scattered else 1
    pool = KVPool(num_layers=geo.num_layers, num_kv_heads=geo.num_kv_heads, head_dim=geo.head_dim, dtype=geo.dtype,
                  block_size=block_size, kernel_block_size=block_size, num_blocks=stride * blocks + 4,
                  slab_blocks=stride * blocks + 4)
    runner = make_runner(prepared, pool)
    print(f"model ready in {time.perf_counter() - t:.1f} s; options {options or 'defaults'}", flush=True)
    table = tuple(range(2, 2 + stride * blocks, stride))
    params_ = m.SamplingParams(max_tokens=1)

    from tools.probe.probe_cuda import timed

    spent = {"build": 0.0, "eval": 0.0}
    timed(runner, "_logits", spent, "build")  # the family's prefill
    timed(runner, "_logits_by_rows", spent, "build")  # a prompt by rows (execute.prefill_rows)
    timed(mx, "eval", spent, "eval")
    results = {}
    for n in args.lengths:
        def step(i: int, n: int = n) -> float:
            prompt = tuple((7 * j + 13 * i) % 1000 + 5 for j in range(n))
            t0 = time.perf_counter()
            runner.run(m.Step(i, (m.SeqWork(f"r{i}", prompt, 0, table, True, params_),), 1), {})
            return time.perf_counter() - t0

        for i in range(3):  # shapes met for the first time (kernel caches, traces)
            step(i)
        spent.update(build=0.0, eval=0.0)
        walls = [step(i) for i in range(args.repeats)]
        row = {"wall_ms": 1e3 * statistics.median(walls), "wall_ms_range": [1e3 * min(walls), 1e3 * max(walls)],
               "build_ms": 1e3 * spent["build"] / args.repeats, "eval_ms": 1e3 * spent["eval"] / args.repeats}
        row["other_ms"] = 1e3 * sum(walls) / args.repeats - row["build_ms"] - row["eval_ms"]
        if args.profile:  # per step: kernel_profile divides by the steps run() reports
            from tools.probe.probe_cuda import kernel_profile

            prof = kernel_profile(lambda k: {"decoded": len([step(i) for i in range(k)])})
            row.update(gpu_ms=prof["gpu_ms_per_token"], kernels=prof["kernels_per_token"],
                       top_kernels=prof["top_kernels"])
        results[n] = row
        line = (f"prefill {n:5d} tokens  {row['wall_ms']:6.2f} ms ({row['wall_ms_range'][0]:.2f}-"
                f"{row['wall_ms_range'][1]:.2f})  build {row['build_ms']:.2f}  eval {row['eval_ms']:.2f}  "
                f"other {row['other_ms']:.2f}")
        if "gpu_ms" in row:
            line += f"  gpu {row['gpu_ms']:.2f} ({row['kernels']:.0f} kernels)"
        print(line, flush=True)
        for k in row.get("top_kernels", [])[:10]:
            print(f"    {k['us_per_token']:8.1f} us  x {k['count_per_token']:5.1f}  {k['name']}", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"model": args.model, "options": options, "scattered": args.scattered, "lengths": results},
                      f, indent=1)


if __name__ == "__main__":
    main()
