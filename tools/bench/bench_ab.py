"""Two settings of unikern in one process, their runs interleaved: an A/B that the host's
drift between processes cannot decide.

On the H200 the same code ran 1.62-1.88 ms per one-row step in one run and 2.42-2.56 in
the next, and whole processes landed fast or slow (one H200, 2026-12-01), so an A/B of
separate processes (tools/bench/bench_gpu.py per setting) told less than the settings
differ. Here both engines are open at once, each with its own model copy, and every
repeat runs each level through A and B back to back, the order flipped every repeat;
the ratios are paired per repeat.

    python -m tools.bench.bench_ab --model DIR --a schedule.overlap_windows=true [--b ...]
        [--concurrency 1 16 64] [--repeats 6] [--label L] [--json out.json]

Its own bias: with both engines at the defaults (an A/A, 1B on an H200, 10 repeats), A,
the engine opened first, ran 1.02x / 1.13x / 1.12x at 1 / 16 / 64 requests
(2026-12-01), so ratios within about 1.15x
there decide nothing. A setting of the process rather than of an engine cannot be
compared here either: `execute.freeze_heap` freezes the process's heap for both.

`--a` and `--b` take STAGE.KEY=VALUE settings (several each; none: the defaults).
`execute.gil_switch_ms` is the process's, not an engine's: it is set before each run to
the variant's value (where a variant has none, the default's: "auto", 0.5 ms on CUDA and
Python's 5 ms elsewhere). So is `execute.fuse_elementwise`: each engine's warm-up traces
its steps as its own setting asks, and the process's switch is set before each run for
the steps a run traces first.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

from tools.common.runs import batch_room, engine_overrides, make_prompts, run_unikern

PYTHON_SWITCH_S = 0.005  # CPython's default switch interval


def paired(a: list[float], b: list[float]) -> dict:
    ratios = sorted(x / y for x, y in zip(a, b, strict=True))
    return {"median": statistics.median(ratios), "range": [ratios[0], ratios[-1]],
            "a_wins": sum(r > 1 for r in ratios), "repeats": len(ratios)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", required=True, help="a model folder or a modelgen preset")
    parser.add_argument("--a", nargs="*", default=[], metavar="STAGE.KEY=VALUE")
    parser.add_argument("--b", nargs="*", default=[], metavar="STAGE.KEY=VALUE")
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 16, 64])
    parser.add_argument("--repeats", type=int, default=6)
    parser.add_argument("--prompt-tokens", type=int, default=64)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--token-budget", type=int, default=4096)
    parser.add_argument("--label", default="")
    parser.add_argument("--json")
    args = parser.parse_args()

    import unikern  # first: the BLAS that MLX's CPU backend should use

    # isort: split
    import anyio

    from unikern.platform.fusion import set_fusion
    from unikern.stages.execute.stage import gil_switch_ms
    from unikern.testing.modelgen import cached_model

    path = args.model if Path(args.model).exists() else str(cached_model(args.model))
    vocab = json.loads((Path(path) / "config.json").read_text())["vocab_size"]
    prompts = {c: make_prompts(c, vocab, args.prompt_tokens, args.prompt_tokens, seed=c) for c in args.concurrency}
    variants = {"a": args.a, "b": args.b}
    overrides, switch, fusion = {}, {}, {}
    for name, sets in variants.items():
        o = engine_overrides(batch_room(args.concurrency, args.token_budget), sets)
        ms = gil_switch_ms(o.get("execute", {}).pop("gil_switch_ms", "auto"))
        switch[name] = ms / 1e3 if ms is not None else PYTHON_SWITCH_S
        fusion[name] = o.get("execute", {}).get("fuse_elementwise", "auto") != "never"
        overrides[name] = o
    runs = {c: {"a": [], "b": []} for c in args.concurrency}

    async def run(engine, name: str, level: int) -> dict:
        sys.setswitchinterval(switch[name])
        set_fusion(fusion[name])  # for any step first traced in this run
        return await run_unikern(engine, prompts[level], args.max_tokens)

    async def main_async() -> None:
        async with (unikern.Engine.from_pipeline("generate", model=path, overrides=overrides["a"]) as a,
                    unikern.Engine.from_pipeline("generate", model=path, overrides=overrides["b"]) as b):
            engines = {"a": a, "b": b}
            for c in args.concurrency:  # untimed: kernels built and steps traced, both engines
                for name in engines:
                    await run(engines[name], name, c)
            for r in range(args.repeats):
                order = ("a", "b") if r % 2 == 0 else ("b", "a")
                for c in args.concurrency:
                    for name in order:
                        runs[c][name].append(await run(engines[name], name, c))
                print(f"repeat {r + 1}/{args.repeats}: " + "  ".join(
                    f"c={c} " + "/".join(f"{runs[c][n][-1]['tokens'] / runs[c][n][-1]['wall']:.0f}" for n in "ab")
                    for c in args.concurrency), flush=True)

    anyio.run(main_async)
    sys.setswitchinterval(PYTHON_SWITCH_S)
    rows = []
    print(f"\n{args.label or Path(path).name}: A = {' '.join(args.a) or 'defaults'}, B = {' '.join(args.b) or 'defaults'}"
          f" ({args.repeats} repeats, one process, interleaved)")
    print(f"{'conc':>5} {'A tok/s':>22} {'B tok/s':>22} {'A/B paired':>24} {'A faster':>9}")
    for c in args.concurrency:
        tok_s = {n: [x["tokens"] / x["wall"] for x in runs[c][n]] for n in "ab"}
        row = {"concurrency": c, **{n: {"tok_s": statistics.median(v), "tok_s_range": [min(v), max(v)],
                                        "tok_s_all": v, "ttft_ms": 1e3 * statistics.median(x["ttft"] for x in runs[c][n])}
                                    for n, v in tok_s.items()},
               "a_over_b": paired(tok_s["a"], tok_s["b"])}
        rows.append(row)
        cells = [f"{row[n]['tok_s']:.0f} ({row[n]['tok_s_range'][0]:.0f}-{row[n]['tok_s_range'][1]:.0f})" for n in "ab"]
        ratio = row["a_over_b"]
        print(f"{c:>5} {cells[0]:>22} {cells[1]:>22} "
              f"{ratio['median']:>8.3f}x ({ratio['range'][0]:.2f}-{ratio['range'][1]:.2f}) "
              f"{ratio['a_wins']:>5}/{ratio['repeats']}")
    if args.json:
        Path(args.json).write_text(json.dumps({"label": args.label, "model": path, "a": args.a, "b": args.b,
                                               "repeats": args.repeats, "prompt_tokens": args.prompt_tokens,
                                               "max_tokens": args.max_tokens, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
