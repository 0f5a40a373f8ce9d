"""unikern against mlx-lm, side by side in one process and one run.

For each concurrency level the same prompts go through `mlx_lm.batch_generate` (or
`mlx_lm.stream_generate` at concurrency 1) and through a unikern Engine; the table gives
aggregate generated tokens per second (medians over the repeats), their ratio, and the
median of the per-repeat ratios ("paired": a repeat runs mlx-lm then unikern, so drifts
of a shared machine hit both alike) with its range. Each level runs once untimed on
both sides first (new shapes: kernels built, decode steps traced). Both sides run
under the same MLX and the same BLAS library (the one unikern preloads, or none with
--blas off), because a ratio across BLAS libraries says nothing about the engine.

    python -m tools.bench.bench --model llama-5m --concurrency 1 4 16 32 64 --plot bench.png

`--structured` measures instead what a JSON schema costs: 32 concurrent requests under
`response_format` against the same requests (prompts, and as many tokens each) free.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

from tools.common.runs import batch_room, engine_overrides, make_prompts, run_mlx_lm


async def run_unikern(engine, prompts, max_tokens) -> tuple[float, int]:
    import anyio

    counts = [0] * len(prompts)

    async def one(i):
        result = await engine.complete(prompt_tokens=prompts[i], max_tokens=max_tokens)
        counts[i] = len(result.token_ids)

    start = time.perf_counter()
    async with anyio.create_task_group() as tg:
        for i in range(len(prompts)):
            tg.start_soon(one, i)
    return time.perf_counter() - start, sum(counts)


def bench(args) -> dict:
    import anyio

    import unikern
    from unikern.platform import current_platform
    from unikern.testing.modelgen import cached_model

    path = str(cached_model(args.model)) if not Path(args.model).exists() else args.model
    from mlx_lm import load

    model, tokenizer = load(path)
    vocab = len(tokenizer)
    overrides = engine_overrides(batch_room(args.concurrency, args.token_budget), args.overrides)
    rows = []

    async def main():
        async with unikern.Engine.from_pipeline("generate", model=path, overrides=overrides) as engine:
            await run_unikern(engine, make_prompts(2, vocab, 16, 32, 99), 8)  # warm-up
            run_mlx_lm(model, tokenizer, make_prompts(2, vocab, 16, 32, 99), 8)
            for c in args.concurrency:
                prompts = make_prompts(c, vocab, args.prompt_min, args.prompt_max, seed=c)
                ours, theirs = [], []
                # one untimed round per level on both sides: MLX builds its GPU kernels
                # (and unikern traces its compiled decode step) for each new shape
                run_mlx_lm(model, tokenizer, prompts, args.max_tokens)
                await run_unikern(engine, prompts, args.max_tokens)
                for _ in range(args.repeats):  # interleaved, so noise hits both sides alike
                    r = run_mlx_lm(model, tokenizer, prompts, args.max_tokens)
                    theirs.append(r["tokens"] / r["wall"])
                    t, n = await run_unikern(engine, prompts, args.max_tokens)
                    ours.append(n / t)
                paired = sorted(o / t for o, t in zip(ours, theirs, strict=True))
                row = {
                    "concurrency": c,
                    "mlx_lm_tok_s": statistics.median(theirs),
                    "unikern_tok_s": statistics.median(ours),
                    "reference": "stream_generate" if c == 1 else "batch_generate",
                    "mlx_lm_all": theirs,
                    "unikern_all": ours,
                    # each repeat's two runs are adjacent in time: their ratio cancels the
                    # slow drifts of a shared machine that the medians above do not
                    "paired_ratio_median": statistics.median(paired),
                    "paired_ratio_range": [paired[0], paired[-1]],
                }
                row["ratio"] = row["unikern_tok_s"] / row["mlx_lm_tok_s"]
                rows.append(row)
                print(
                    f"{c:>5} {row['reference']:>16} {row['mlx_lm_tok_s']:>10.1f} "
                    f"{row['unikern_tok_s']:>10.1f} {row['ratio']:>7.2f}x "
                    f"{row['paired_ratio_median']:>7.2f}x ({paired[0]:.2f}-{paired[-1]:.2f})",
                    flush=True,
                )

    print(f"model {args.model}, prompts {args.prompt_min}-{args.prompt_max} tokens, {args.max_tokens} new tokens each")
    print(f"BLAS under MLX: {current_platform().blas}")
    print(f"{'conc':>5} {'reference':>16} {'mlx-lm':>10} {'unikern':>10} {'ratio':>8} {'paired':>8} (range)   (tokens/s)")
    anyio.run(main)
    import mlx.core as mx
    import mlx_lm

    return {
        "model": args.model,
        "blas": current_platform().blas,
        "platform": current_platform().to_stats(),
        "mlx": mx.__version__,
        "mlx_lm": mlx_lm.__version__,
        "max_tokens": args.max_tokens,
        "overrides": args.overrides,
        "prompt_tokens": [args.prompt_min, args.prompt_max],
        "rows": rows,
    }


# nested objects, arrays, enums, bounded numbers (multipleOf: a random model never stops
# adding digits), strings of bounded length
STRUCTURED_SCHEMA = {
    "type": "object",
    "properties": {
        "id": {"type": "integer", "minimum": 0, "maximum": 9999},
        "name": {"type": "string", "maxLength": 12},
        "score": {"type": "number", "minimum": -10, "maximum": 10, "multipleOf": 0.5},
        "kind": {"enum": ["alpha", "beta", "gamma"]},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 6}, "maxItems": 4},
        "owner": {"type": "object", "properties": {"active": {"type": "boolean"}, "level": {"type": "integer",
                  "minimum": 1, "maximum": 5}}, "required": ["active", "level"], "additionalProperties": False},
    },
    "required": ["id", "name", "score", "kind", "tags", "owner"],
    "additionalProperties": False,
}


def bench_structured(args) -> dict:
    """Constrained vs free throughput in one engine: each repeat runs the constrained
    requests, then the same prompts free with the token counts the constrained ones
    produced, so both sides generate the same number of tokens."""
    import anyio

    import unikern
    from unikern.platform import bridge_stats
    from unikern.testing.modelgen import cached_model

    path = str(cached_model(args.model)) if not Path(args.model).exists() else args.model
    concurrency = args.concurrency[0] if args.concurrency != [1, 4, 16, 32, 64] else 32
    fmt = {"type": "json_schema", "json_schema": {"name": "record", "schema": STRUCTURED_SCHEMA, "strict": True}}
    overrides = {"schedule": {"max_num_seqs": concurrency, "max_num_batched_tokens": args.token_budget}}
    rows = []

    async def run(engine, prompts, max_tokens, response_format) -> tuple[float, list[int]]:
        counts = [0] * len(prompts)

        async def one(i):
            result = await engine.complete(prompt_tokens=prompts[i], max_tokens=max_tokens[i],
                                           response_format=response_format)
            counts[i] = len(result.token_ids)

        start = time.perf_counter()
        async with anyio.create_task_group() as tg:
            for i in range(len(prompts)):
                tg.start_soon(one, i)
        return time.perf_counter() - start, counts

    async def main():
        async with unikern.Engine.from_pipeline("generate", model=path, overrides=overrides) as engine:
            vocab = engine._router.stages["tokenize"].encoder.vocab_size
            prompts = make_prompts(concurrency, vocab, args.prompt_min, args.prompt_max, seed=concurrency)
            limit = [args.max_tokens] * concurrency
            await run(engine, prompts, limit, fmt)  # untimed: compiles the schema, warms the shapes
            for _ in range(args.repeats):
                t_constrained, counts = await run(engine, prompts, limit, fmt)
                t_free, free_counts = await run(engine, prompts, counts, None)
                row = {"constrained_tok_s": sum(counts) / t_constrained, "free_tok_s": sum(free_counts) / t_free,
                       "tokens": sum(counts), "free_tokens": sum(free_counts)}
                row["ratio"] = row["constrained_tok_s"] / row["free_tok_s"]
                rows.append(row)
                print(f"{concurrency:>5} {row['tokens']:>7} {row['free_tok_s']:>10.1f} "
                      f"{row['constrained_tok_s']:>12.1f} {row['ratio']:>7.2f}x", flush=True)

    print(f"model {args.model}, {concurrency} concurrent requests, JSON schema vs free, prompts "
          f"{args.prompt_min}-{args.prompt_max} tokens, at most {args.max_tokens} new tokens")
    print(f"{'conc':>5} {'tokens':>7} {'free':>10} {'constrained':>12} {'ratio':>8}   (tokens/s)")
    anyio.run(main)
    ratio = statistics.median(r["ratio"] for r in rows)
    print(f"median constrained / free: {ratio:.2f}x; bridge {bridge_stats()}")
    return {"model": args.model, "concurrency": concurrency, "rows": rows, "median_ratio": ratio,
            "bridge": bridge_stats(), "schema": STRUCTURED_SCHEMA}


def plot(results: list[dict], out: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for res in results:
        xs = [r["concurrency"] for r in res["rows"]]
        tag = "reference BLAS" if res["blas"] == "reference" else Path(res["blas"]).name
        ax.plot(xs, [r["unikern_tok_s"] for r in res["rows"]], "o-", label=f"unikern ({tag})")
        ax.plot(xs, [r["mlx_lm_tok_s"] for r in res["rows"]], "s--", label=f"mlx-lm ({tag})")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("concurrent requests")
    ax.set_ylabel("generated tokens / s (aggregate)")
    ax.set_title(f"{results[0]['model']}: unikern vs mlx-lm\n(stream_generate at 1, batch_generate above)", fontsize=10)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(out, dpi=120)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="llama-5m", help="a modelgen preset or a model directory")
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 4, 16, 32, 64])
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--prompt-min", type=int, default=16)
    parser.add_argument("--prompt-max", type=int, default=128)
    parser.add_argument("--token-budget", type=int, default=2048)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--blas", choices=["on", "off", "both"], default="on",
                        help="on: the preloaded BLAS; off: MLX's reference BLAS; both: one run each")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="STAGE.KEY=VALUE",
                        help="override a parameter of unikern's pipeline, e.g. schedule.decode_lookahead=32")
    parser.add_argument("--json", help="write the results here")
    parser.add_argument("--plot", help="write a PNG plot here")
    parser.add_argument("--structured", action="store_true",
                        help="JSON-schema-constrained vs free throughput, 32 concurrent (or --concurrency N)")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.structured:
        result = bench_structured(args)
        if args.json:
            Path(args.json).write_text(json.dumps(result, indent=2))
        return
    if args.child or args.blas == "on":
        results = [bench(args)]
    else:
        modes = ["on", "off"] if args.blas == "both" else ["off"]
        results = []
        for mode in modes:
            env = dict(os.environ, UNIKERN_BLAS="auto" if mode == "on" else "off")
            argv = [a for a in sys.argv[1:] if not a.startswith("--blas") and a not in ("on", "off", "both")]
            out = subprocess.run(
                [sys.executable, "-m", __spec__.name, *argv, "--child", "--json", f"/tmp/unikern-bench-{mode}.json"],
                env=env, check=True,
            )
            del out
            results.append(json.loads(Path(f"/tmp/unikern-bench-{mode}.json").read_text()))
    if args.json:
        Path(args.json).write_text(json.dumps(results if len(results) > 1 else results[0], indent=2))
    if args.plot and not args.child:
        plot(results, args.plot)


if __name__ == "__main__":
    main()
    from unikern.frontends.cli import leave

    leave(0)  # results are written; MLX's native teardown has aborted here (exit 134 on CUDA)
