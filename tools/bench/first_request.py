"""A fresh worker's start and its first requests, with the execute stage's warm-up on
and off: seconds to `ready`, then per request the seconds to its first token and to
`done`. Each variant is a new `python -m unikern worker` process; on CUDA pass
--fresh-cache so each one starts with an empty MLX kernel cache, as a new machine does.
--cold-warm instead starts two workers on unikern's default kernel cache (under a fresh
XDG_CACHE_HOME): the first compiles every kernel, the second finds them (issue 17).

    python -m tools.bench.first_request --model llama-80m [--variants auto never] [--json out.json]
    python -m tools.bench.first_request --model DIR --cold-warm [--warm-starts 3] [--read-ahead-ab]
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from pathlib import Path

from tools.check.worker_client import WorkerClient


def mlx_cache_dir(env: dict[str, str] | None) -> Path | None:
    """Where the worker's MLX keeps the kernels it compiles (unikern.platform.kernel_cache)."""
    from unikern.platform import kernel_cache

    env = {**os.environ, **(env or {})}
    chosen = env.get(kernel_cache.PTX_CACHE_VARIABLE)
    return Path(chosen) if chosen else kernel_cache.default_dir(env)


def new_modules(cache: Path | None, before: set[str], started: float) -> list[dict]:
    """The kernels MLX compiled in this worker (each a `.cu` it wrote beside the binary),
    in the order written: seconds after the worker's start, and since the one before
    (a bound on its compile where they came one after another; the first one's gap also
    holds the worker's start before it)."""
    if cache is None or not cache.is_dir():
        return []
    written = sorted((f.stat().st_mtime, f) for f in cache.glob("*.cu") if f.name not in before)
    modules, last = [], started
    for mtime, f in written:
        binary = f.with_suffix(".ptx")
        modules.append({"name": f.stem, "at_s": round(mtime - started, 3), "gap_s": round(mtime - last, 3),
                        "source_bytes": f.stat().st_size, "binary_bytes": binary.stat().st_size if binary.exists() else None})
        last = mtime
    return modules


def one_worker(model: str, warmup: str, requests: list[dict], fresh_cache: bool,
               env: dict[str, str] | None = None, sets: tuple[str, ...] = ()) -> dict:
    if fresh_cache:
        env = {"MLX_PTX_CACHE_DIR": tempfile.mkdtemp(prefix="mlx-ptx-")}
    cache = mlx_cache_dir(env)
    before = {f.name for f in cache.glob("*.cu")} if cache is not None and cache.is_dir() else set()
    started = time.time()
    client = WorkerClient(model, sets=[f"execute.warmup={warmup}", *sets], env=env)
    try:
        client.wait_ready(timeout=600)
        ready_s = next(e["_t"] for e in client.events if e["event"] == "ready")
        client.send_json({"op": "stats"})  # the execute stage's own split of the start-up
        client.wait("stats", lambda c: bool(c.stats_events()), timeout=60)
        stats = client.stats_events()[-1]
        split = {**stats.get("model", {}).get("startup", {}), "warmup_s": stats.get("warmup", {}).get("seconds")}
        kernels = stats.get("warmup", {}).get("kernels")  # unikern's kernels: compiled or read from disk
        timings = []
        for request in requests:  # one at a time: each one's latency alone
            rid = request["id"]
            client.send_json(request)
            client.wait_done([rid], timeout=120)
            sent = client.sent_at[rid]
            first = client.first_token_at.get(rid)
            timings.append({"id": rid, "first_token_s": None if first is None else first - sent,
                            "done_s": client.ended_at[rid] - sent, "event": client.terminal[rid]["event"]})
        client.close_stdin()
        code = client.wait_exit(120)
    finally:
        client.close()
    return {"warmup": warmup, "ready_s": ready_s, "split": split, "kernels": kernels, "requests": timings,
            "exit_code": code, "mlx_modules": new_modules(cache, before, started)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="llama-5m", help="a modelgen preset or a model directory")
    parser.add_argument("--variants", nargs="+", default=["auto", "never"], help="execute.warmup settings")
    parser.add_argument("--fresh-cache", action="store_true", help="an empty MLX_PTX_CACHE_DIR per worker")
    parser.add_argument("--cold-warm", action="store_true",
                        help="two workers on the default kernel cache under a fresh XDG_CACHE_HOME")
    parser.add_argument("--warm-starts", type=int, default=1,
                        help="with --cold-warm: warm workers after the cold one (the host's speed moves between "
                             "processes: several give the spread)")
    parser.add_argument("--read-ahead-ab", action="store_true",
                        help="with --cold-warm: each warm start twice, UNIKERN_READ_AHEAD=1 then 0, interleaved")
    parser.add_argument("--set", dest="sets", action="append", default=[], metavar="STAGE.KEY=VALUE",
                        help="a pipeline setting for every worker")
    parser.add_argument("--json")
    args = parser.parse_args()
    from unikern.testing.modelgen import cached_model

    model = args.model if Path(args.model).exists() else str(cached_model(args.model))
    requests = [
        {"op": "generate", "id": "r0", "prompt_tokens": list(range(5, 45)), "max_tokens": 16},
        {"op": "generate", "id": "r1", "prompt_tokens": list(range(7, 120)), "max_tokens": 16},
        {"op": "generate", "id": "r2", "prompt_tokens": list(range(9, 30)), "max_tokens": 16},
    ]
    if args.cold_warm:  # MLX_PTX_CACHE_DIR empty: unikern picks its default under XDG_CACHE_HOME
        env = {"XDG_CACHE_HOME": tempfile.mkdtemp(prefix="xdg-cache-"), "MLX_PTX_CACHE_DIR": ""}
        starts = [("cold", None)] + [("warm", None)] * args.warm_starts
        if args.read_ahead_ab:
            starts = [("cold", None)] + [("warm", ahead) for _ in range(args.warm_starts) for ahead in ("1", "0")]
        runs = []
        for start, ahead in starts:
            extra = {} if ahead is None else {"UNIKERN_READ_AHEAD": ahead}
            runs.append(dict(one_worker(model, "auto", requests, False, {**env, **extra}, args.sets), start=start,
                             read_ahead=ahead))
    else:
        runs = [one_worker(model, v, requests, args.fresh_cache, sets=args.sets) for v in args.variants]
    for run in runs:
        reqs = "  ".join(f"{r['id']} first {r['first_token_s']:.2f} s done {r['done_s']:.2f} s" for r in run["requests"])
        split = " ".join(f"{k} {v}" for k, v in run["split"].items() if v is not None)
        label = run.get("start", "") + (f" read_ahead={run['read_ahead']}" if run.get("read_ahead") else "")
        print(f"{label}{' ' if label else ''}warmup={run['warmup']:<6} ready {run['ready_s']:6.2f} s "
              f"({split})  {reqs}  exit {run['exit_code']}  kernels {run.get('kernels')}")
        modules = run["mlx_modules"]
        if modules:  # the slowest of MLX's own compiles in this worker
            slow = sorted(modules, key=lambda m: -m["gap_s"])[:8]
            print(f"  MLX compiled {len(modules)} kernels: " + ", ".join(f"{m['name'][:60]} {m['gap_s']:.1f} s" for m in slow))
    if args.json:
        Path(args.json).write_text(json.dumps({"model": args.model, "sets": args.sets, "runs": runs}, indent=1))


if __name__ == "__main__":
    main()
