"""Throughput with the execute stage on one rank against N ranks (execute.tensor_parallel,
or --mode pipeline), same model, same prompts, greedy.

MLX keeps one distributed group per process, so each setting runs in a child process of
its own (`--child`): an untimed round per concurrency level first, then `--repeats`
timed rounds; the table gives the median generated tokens per second, the ratio N / 1,
and how many requests' tokens differ between the two (greedy: expected 0, but sums
split across ranks round differently, so a near-tie may flip). The JSON goes under
tools/results/.

    python -m tools.bench.bench_tp --model llama-5m --tp 2 --concurrency 1 8 --max-tokens 32   # CPU, ring, loopback
    python -m tools.bench.bench_tp --model /models/llama-8b --tp 2 --backend nccl --concurrency 1 16 64
"""

from __future__ import annotations

import argparse
import json
import platform
import random
import statistics
import subprocess
import sys
import time
from pathlib import Path

RESULTS = Path(__file__).resolve().parents[1] / "results"


def make_prompts(n: int, vocab: int, lo: int, hi: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(10, vocab - 10) for _ in range(rng.randint(lo, hi))] for _ in range(n)]


async def one_round(engine, prompts: list[list[int]], max_tokens: int) -> tuple[float, list[list[int]]]:
    import anyio

    tokens: list[list[int]] = [[] for _ in prompts]

    async def one(i: int) -> None:
        tokens[i] = (await engine.complete(prompt_tokens=prompts[i], max_tokens=max_tokens)).token_ids

    start = time.perf_counter()
    async with anyio.create_task_group() as tg:
        for i in range(len(prompts)):
            tg.start_soon(one, i)
    return time.perf_counter() - start, tokens


def child(args: argparse.Namespace) -> dict:
    """One engine (this process's one world), every concurrency level."""
    import anyio

    import unikern
    from unikern.spec import parse_overrides

    overrides = parse_overrides(args.set)
    overrides.setdefault("schedule", {}).setdefault("max_num_seqs", max(args.concurrency))
    execute = overrides.setdefault("execute", {})
    execute[f"{args.mode}_parallel"] = args.ranks
    execute["distributed_backend"] = args.backend

    async def main() -> dict:
        levels = {}
        async with unikern.Engine.from_pipeline(args.pipeline, model=args.model_path, overrides=overrides) as engine:
            for c in args.concurrency:
                prompts = make_prompts(c, args.vocab, args.prompt_len[0], args.prompt_len[1], seed=c)
                _, tokens = await one_round(engine, prompts, args.max_tokens)  # untimed: shapes, kernels
                rates = []
                for _ in range(args.repeats):
                    seconds, tokens = await one_round(engine, prompts, args.max_tokens)
                    rates.append(sum(len(t) for t in tokens) / seconds)
                levels[str(c)] = {"tok_s": rates, "tokens": tokens}
            stats = engine.stats()
        return {"levels": levels, "platform": stats["platform"], "kv": stats.get("kv", {})}

    return anyio.run(main)


def run_child(args: argparse.Namespace, ranks: int) -> dict:
    command = [sys.executable, "-m", __spec__.name, "--child", "--ranks", str(ranks), "--model-path", args.model_path,
               "--vocab", str(args.vocab), "--mode", args.mode, "--backend", args.backend,
               "--pipeline", args.pipeline, "--max-tokens", str(args.max_tokens), "--repeats", str(args.repeats),
               "--prompt-len", *map(str, args.prompt_len), "--concurrency", *map(str, args.concurrency)]
    for s in args.set:
        command += ["--set", s]
    done = subprocess.run(command, capture_output=True, text=True)
    if done.returncode != 0:
        sys.exit(f"bench_tp: the {ranks}-rank run failed (exit {done.returncode}):\n{done.stderr[-4000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="llama-5m", help="a modelgen preset or a model directory")
    parser.add_argument("--tp", type=int, default=2, help="ranks to compare against one")
    parser.add_argument("--mode", choices=["tensor", "pipeline"], default="tensor")
    parser.add_argument("--backend", default="auto", help="execute.distributed_backend: auto, ring, nccl, ...")
    parser.add_argument("--pipeline", default="generate")
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 16, 64])
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--prompt-len", type=int, nargs=2, default=[16, 128], metavar=("LO", "HI"))
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--set", action="append", default=[], metavar="STAGE.KEY=VALUE")
    parser.add_argument("--out", help="JSON path (default tools/results/bench-tp-<model>-<backend>.json)")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--ranks", type=int, default=1, help=argparse.SUPPRESS)
    parser.add_argument("--model-path", help=argparse.SUPPRESS)
    parser.add_argument("--vocab", type=int, default=0, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(child(args)))
        return

    from unikern.testing.modelgen import cached_model

    args.model_path = args.model if Path(args.model).exists() else str(cached_model(args.model))
    config = json.loads((Path(args.model_path) / "config.json").read_text())
    args.vocab = int(config["vocab_size"])
    one, many = run_child(args, 1), run_child(args, args.tp)
    backend = many["platform"].get("world", {}).get("backend", args.backend)
    rows = []
    print(f"{args.model}: 1 rank vs {args.tp} ({args.mode} parallel, {backend}), {args.max_tokens} tokens each, "
          f"median of {args.repeats}")
    print(f"{'concurrency':>11} {'1 rank tok/s':>13} {f'{args.tp} ranks tok/s':>15} {'ratio':>7} {'differ':>7}")
    for c in map(str, args.concurrency):
        a, b = one["levels"][c], many["levels"][c]
        ra, rb = statistics.median(a["tok_s"]), statistics.median(b["tok_s"])
        differ = sum(x != y for x, y in zip(a["tokens"], b["tokens"], strict=True))
        rows.append({"concurrency": int(c), "one_rank_tok_s": a["tok_s"], "ranks_tok_s": b["tok_s"],
                     "median_one_rank": ra, "median_ranks": rb, "ratio": rb / ra, "requests_differing": differ})
        print(f"{c:>11} {ra:>13.1f} {rb:>15.1f} {rb / ra:>6.2f}x {differ:>4}/{c}")
    result = {
        "tool": "tools/bench/bench_tp.py", "argv": sys.argv[1:], "model": args.model, "ranks": args.tp,
        "mode": args.mode, "backend": backend, "max_tokens": args.max_tokens, "prompt_len": args.prompt_len,
        "repeats": args.repeats, "machine": platform.machine(), "when": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "platform": many["platform"], "kv_ranks": many["kv"].get("ranks"), "levels": rows,
    }
    name = Path(args.model).name if Path(args.model).exists() else args.model
    out = Path(args.out) if args.out else RESULTS / f"bench-tp-{name}-{args.mode}{args.tp}-{backend}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2, default=str) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
