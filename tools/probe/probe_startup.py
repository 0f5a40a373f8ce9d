"""Where a start's seconds go, finer than stats.model.startup: one process that imports,
reads the weights' files raw (the disk's or the page cache's speed), loads them through
MLX alone, times each op's first and second call at the model's shapes (the one-time
costs: cuBLAS, cuDNN, kernel builds), then runs the execute stage's own load and warm-up
with each warm-up step's seconds and the part of them spent in `mx.eval`, and the
warm-up once more (what a second runner pays again: traces). --cold-warm runs it twice
in fresh processes on one empty MLX kernel cache, the cache's file count after each.

    python -m tools.probe.probe_startup --model DIR [--ops] [--profile 25] [--json out.json]
    python -m tools.probe.probe_startup --model DIR --cold-warm --json out.json [--spy DIR]
    python -m tools.probe.probe_startup --summarize spy-warm.txt

--spy records each process with py-spy (--native: MLX's and CUDA's own frames) into
DIR/spy-cold.txt and spy-warm.txt; --summarize prints where such a record's samples are:
the seconds under each marked native call (NVRTC, module loads, cuBLAS, cuDNN, graph
launches, MLX's compile) and the Python lines that own the most samples. Native sampling
is slow: on an H200 a 1B start under it ran past 7 minutes (NVRTC's first compile 16 s
against 3.4 s), so keep it to short runs.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path


def raw_read(files: list[Path]) -> dict:
    """Read every file into one reused buffer: bytes per second of the disk or page cache."""
    chunk = bytearray(64 << 20)
    view = memoryview(chunk)
    total = 0
    t = time.perf_counter()
    for f in files:
        with open(f, "rb", buffering=0) as fh:
            while n := fh.readinto(view):
                total += n
    s = time.perf_counter() - t
    return {"bytes": total, "seconds": round(s, 3), "gb_per_s": round(total / s / 1e9, 2)}


def mlx_load(files: list[Path]) -> dict:
    import mlx.core as mx

    t = time.perf_counter()
    arrays = {}
    for f in files:
        arrays.update(mx.load(str(f)))
    lazy = time.perf_counter() - t
    mx.eval(list(arrays.values()))
    s = time.perf_counter() - t
    total = sum(a.nbytes for a in arrays.values())
    del arrays
    mx.clear_cache()
    return {"tensors": len(files), "bytes": total, "seconds": round(s, 3), "lazy_seconds": round(lazy, 3),
            "gb_per_s": round(total / s / 1e9, 2)}


def first_calls(config: dict) -> list[dict]:
    """Each op at the model's shapes: its first call (one-time costs) and its second."""
    import mlx.core as mx

    hidden = config["hidden_size"]
    heads = config["num_attention_heads"]
    kv = config.get("num_key_value_heads", heads)
    dim = config.get("head_dim") or hidden // heads
    mlp = config["intermediate_size"]
    dt = mx.bfloat16
    w = mx.random.normal((mlp, hidden)).astype(dt)
    norm_w = mx.ones((hidden,), dt)
    mx.eval(w, norm_w)

    def x(rows: int, width: int = hidden):
        return mx.random.normal((rows, width)).astype(dt)

    def sdpa(q_len: int, k_len: int, batch: int = 1):
        q = mx.random.normal((batch, heads, q_len, dim)).astype(dt)
        k = mx.random.normal((batch, kv, k_len, dim)).astype(dt)
        mask = "causal" if q_len > 1 else None
        return lambda: mx.fast.scaled_dot_product_attention(q, k, k, scale=dim ** -0.5, mask=mask)

    cases = {}
    for rows in (1, 4, 16, 64, 24, 48):
        a = x(rows)
        cases[f"matmul {rows}x{hidden} @ {hidden}x{mlp}"] = lambda a=a: a @ w.T
    a = x(24)
    cases["rms_norm 24"] = lambda: mx.fast.rms_norm(a, norm_w, 1e-5)
    q = mx.random.normal((1, heads, 24, dim)).astype(dt)
    cases["rope 24"] = lambda: mx.fast.rope(q, dim, traditional=False, base=500000.0, scale=1.0, offset=0)
    for q_len, k_len, batch in ((24, 24, 1), (24, 24, 2), (17, 17, 1), (64, 64, 1), (1, 24, 1), (1, 24, 16)):
        cases[f"sdpa q{q_len} k{k_len} b{batch}"] = sdpa(q_len, k_len, batch)
    logits = mx.random.normal((16, config["vocab_size"])).astype(dt)
    cases["argmax 16 rows"] = lambda: mx.argmax(logits, axis=-1)
    cases["softmax 16 rows"] = lambda: mx.softmax(logits.astype(mx.float32), axis=-1)
    fused = mx.compile(lambda a: mx.exp(a * 2.0 + 1.0) * a)
    b = x(8)
    cases["compiled elementwise"] = lambda: fused(b)
    out = []
    for name, fn in cases.items():
        times = []
        for _ in range(2):
            t = time.perf_counter()
            mx.eval(fn())
            times.append(round(1e3 * (time.perf_counter() - t), 2))
        out.append({"op": name, "first_ms": times[0], "second_ms": times[1]})
        print(f"  {name:40s} first {times[0]:9.2f} ms  second {times[1]:8.2f} ms", flush=True)
    return out


def one_process(args: argparse.Namespace) -> dict:
    t0 = time.perf_counter()
    import unikern  # noqa: F401  first: the BLAS MLX's CPU backend should use
    # isort: split
    import mlx.core as mx
    import msgspec

    from unikern.platform.pinning import WeightWiring
    from unikern.stages.execute.model import ModelGeometry
    from unikern.stages.execute.ranks import prepare_model
    from unikern.stages.execute.stage import MLXExecuteParams
    from unikern.stages.execute.warmup import warm_up

    report: dict = {"import_s": round(time.perf_counter() - t0, 3)}
    t = time.perf_counter()
    mx.eval(mx.zeros(1) + 1)
    report["device_s"] = round(time.perf_counter() - t, 3)
    files = sorted(Path(args.model).glob("*.safetensors"))
    report["raw_read"] = raw_read(files)
    print(f"raw read {report['raw_read']}", flush=True)
    report["mlx_load"] = mlx_load(files)
    print(f"mlx load {report['mlx_load']}", flush=True)
    if args.ops:
        config = json.loads((Path(args.model) / "config.json").read_text())
        report["first_calls"] = first_calls(config)

    from tools.probe.probe_cuda import timed

    spent = {"eval": 0.0}
    timed(mx, "eval", spent, "eval")
    options = dict(s.split("=", 1) for s in args.set)
    params = msgspec.convert({"model": args.model, **options}, MLXExecuteParams, strict=False)
    profiler = None
    if args.profile:
        import cProfile

        profiler = cProfile.Profile()
        profiler.enable()
    t = time.perf_counter()
    prepared = prepare_model(params, None, WeightWiring())
    report["prepare_s"] = round(time.perf_counter() - t, 3)
    report["prepare_eval_s"] = round(spent["eval"], 3)
    if profiler is not None:
        profiler.disable()
        import io
        import pstats

        text = io.StringIO()
        pstats.Stats(profiler, stream=text).sort_stats("tottime").print_stats(args.profile)
        report["profile"] = text.getvalue().splitlines()[-args.profile - 4:]
        print(text.getvalue()[-6000:], flush=True)
    report["startup"] = prepared.startup
    report["warmup"] = prepared.warmup
    print(f"prepare {report['prepare_s']} s (eval {report['prepare_eval_s']} s): {prepared.startup}", flush=True)
    for line in (prepared.warmup or {}).get("step_seconds", []):
        print(f"  warm-up {line}", flush=True)
    loaded = prepared.loaded
    t = time.perf_counter()
    ModelGeometry(loaded.model, "again")
    report["geometry_again_s"] = round(time.perf_counter() - t, 3)
    if prepared.warmup is not None:
        spent["eval"] = 0.0
        again = warm_up(loaded.model, loaded.geometry, prepared.kernels, prepared.compile_decode,
                        prepared.paged_attention, prepared.compile_one_row, prepared.prefill_rows,
                        prepared.compile_prefill)
        report["warmup_again"] = {"seconds": again["seconds"], "eval_s": round(spent["eval"], 3),
                                  "step_seconds": again["step_seconds"]}
        print(f"warm-up again {again['seconds']} s (eval {spent['eval']:.3f} s)", flush=True)
        for line in again["step_seconds"]:
            print(f"  again {line}", flush=True)
    return report


def cache_listing(path: str) -> list[str]:
    """The kernel cache's compiled modules: name and bytes."""
    return sorted(f"{f.name} {f.stat().st_size}" for f in Path(path).rglob("*.ptx")) if Path(path).exists() else []


# native calls whose samples say where a start's time goes (the first match from the
# innermost frame out names a sample)
MARKERS = ("nvrtcCompileProgram", "cuModuleLoadData", "cuLibraryLoad", "cudaGraphInstantiate", "cuGraphInstantiate",
           "cudnn", "cublas", "compile_simplify", "compile_fuse", "compile_dfs", "mlx::core::compile",
           "cuModuleGetFunction", "cudaMalloc", "cuMemAlloc", "cuMemcpy", "cudaMemcpy", "read", "_find_and_load",
           "cuStreamSynchronize", "cuEventSynchronize", "cudaStreamSynchronize", "cudaEventSynchronize",
           "pread", "sched_yield", "futex")


def summarize(path: str, rate: float, top: int = 25) -> dict:
    """py-spy's raw records (one `frame;frame;... count` line per stack): seconds per
    marker and the Python lines holding most samples."""
    from collections import Counter

    markers: Counter[str] = Counter()
    lines: Counter[str] = Counter()
    total = 0
    for line in Path(path).read_text().splitlines():
        stack, _, count = line.rpartition(" ")
        if not count.isdigit():
            continue
        n = int(count)
        total += n
        frames = stack.split(";")
        hit = next((m for f in reversed(frames) for m in MARKERS if m in f.split(" (")[0]), "other")
        markers[hit] += n
        python = [f for f in frames if ".py:" in f]
        if python:
            lines[python[-1]] += n
    report = {"samples": total, "seconds": round(total / rate, 2),
              "markers_s": {k: round(v / rate, 2) for k, v in markers.most_common()},
              "python_lines_s": {k: round(v / rate, 2) for k, v in lines.most_common(top)}}
    print(f"{path}: {report['seconds']} s sampled")
    for k, v in report["markers_s"].items():
        print(f"  {v:8.2f} s  {k}")
    for k, v in report["python_lines_s"].items():
        print(f"  {v:8.2f} s  {k}")
    return report


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", required=True, help="a model directory")
    parser.add_argument("--ops", action="store_true", help="time each op's first and second call")
    parser.add_argument("--profile", type=int, default=0, help="cProfile the load and warm-up: the top N by own time")
    parser.add_argument("--set", nargs="*", default=[], metavar="OPTION=VALUE", help="mlx_execute options")
    parser.add_argument("--cold-warm", action="store_true",
                        help="two fresh processes on one empty MLX kernel cache (MLX_PTX_CACHE_DIR)")
    parser.add_argument("--spy", help="with --cold-warm: record each process with py-spy into this folder")
    parser.add_argument("--spy-rate", type=int, default=100, help="py-spy samples per second")
    parser.add_argument("--summarize", nargs="*", default=[], help="py-spy raw records to summarize")
    parser.add_argument("--json")
    args = parser.parse_args()
    if args.summarize:
        report = {p: summarize(p, args.spy_rate) for p in args.summarize}
    elif not args.cold_warm:
        report = one_process(args)
    else:
        cache = tempfile.mkdtemp(prefix="mlx-ptx-")
        report = {"cache": cache, "runs": []}
        for start in ("cold", "warm"):
            out = tempfile.mktemp(suffix=".json")
            argv = [a for a in sys.argv[1:] if a != "--cold-warm"]
            for option in ("--json", "--spy"):
                if option in argv:
                    i = argv.index(option)
                    del argv[i:i + 2]
            command = [sys.executable, "-m", "tools.probe.probe_startup", *argv, "--json", out]
            if args.spy:
                Path(args.spy).mkdir(parents=True, exist_ok=True)
                record = str(Path(args.spy) / f"spy-{start}.txt")
                command = ["py-spy", "record", "--native", "--format", "raw", "-r", str(args.spy_rate), "-o", record,
                           "--", *command]
            t = time.perf_counter()
            subprocess.run(command, check=True, env={**os.environ, "MLX_PTX_CACHE_DIR": cache})
            run = json.loads(Path(out).read_text())
            run.update(start=start, process_s=round(time.perf_counter() - t, 3), cache=cache_listing(cache))
            if args.spy:
                run["spy"] = summarize(record, args.spy_rate)
            report["runs"].append(run)
            print(f"== {start}: process {run['process_s']} s, kernel cache {len(run['cache'])} modules", flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
