"""A fresh worker's start and its first requests, with the execute stage's warm-up on
and off: seconds to `ready`, then per request the seconds to its first token and to
`done`. Each variant is a new `python -m unikern worker` process; on CUDA pass
--fresh-cache so each one starts with an empty MLX kernel cache, as a new machine does.

    python tools/first_request.py --model llama-80m [--variants auto never] [--json out.json]
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


def one_worker(model: str, warmup: str, requests: list[dict], fresh_cache: bool) -> dict:
    env = dict(os.environ)
    if fresh_cache:
        env["MLX_PTX_CACHE_DIR"] = tempfile.mkdtemp(prefix="mlx-ptx-")
    cmd = [sys.executable, "-m", "unikern", "worker", "--model", model, "--set", f"execute.warmup={warmup}"]
    start = time.perf_counter()
    proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                            text=True, env=env)
    result: dict = {"warmup": warmup, "requests": []}
    for line in proc.stdout:
        event = json.loads(line)
        if event.get("event") == "ready":
            result["ready_s"] = time.perf_counter() - start
            break
    for request in requests:  # one at a time: each one's latency alone
        sent = time.perf_counter()
        proc.stdin.write(json.dumps(request) + "\n")
        proc.stdin.flush()
        first = None
        for line in proc.stdout:
            event = json.loads(line)
            if event.get("id") != request["id"]:
                continue
            if event["event"] == "token" and first is None:
                first = time.perf_counter() - sent
            if event["event"] in ("done", "error"):
                result["requests"].append({"id": request["id"], "first_token_s": first,
                                           "done_s": time.perf_counter() - sent, "event": event["event"]})
                break
    proc.stdin.close()
    result["exit_code"] = proc.wait(timeout=120)
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="llama-5m", help="a modelgen preset or a model directory")
    parser.add_argument("--variants", nargs="+", default=["auto", "never"], help="execute.warmup settings")
    parser.add_argument("--fresh-cache", action="store_true", help="an empty MLX_PTX_CACHE_DIR per worker")
    parser.add_argument("--json")
    args = parser.parse_args()
    from unikern.modelgen import cached_model

    model = args.model if Path(args.model).exists() else str(cached_model(args.model))
    requests = [
        {"op": "generate", "id": "r0", "prompt_tokens": list(range(5, 45)), "max_tokens": 16},
        {"op": "generate", "id": "r1", "prompt_tokens": list(range(7, 120)), "max_tokens": 16},
        {"op": "generate", "id": "r2", "prompt_tokens": list(range(9, 30)), "max_tokens": 16},
    ]
    runs = [one_worker(model, v, requests, args.fresh_cache) for v in args.variants]
    for run in runs:
        reqs = "  ".join(f"{r['id']} first {r['first_token_s']:.2f} s done {r['done_s']:.2f} s" for r in run["requests"])
        print(f"warmup={run['warmup']:<6} ready {run['ready_s']:6.2f} s  {reqs}  exit {run['exit_code']}")
    if args.json:
        Path(args.json).write_text(json.dumps({"model": args.model, "runs": runs}, indent=1))


if __name__ == "__main__":
    main()
