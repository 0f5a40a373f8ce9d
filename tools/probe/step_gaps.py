"""Where an engine run's wall time goes between the model thread's steps: each step's
time inside `ModelRunner.execute` (the forward, its sync and sampling) and the gaps
between one step's end and the next one's start (the StepDone's trip through the
scheduler, the output stage and the messages, the next step's tables). The requests are
tools/bench/bench_gpu.py's for unikern (tools/common/runs.py), through the library.

    python -m tools.probe.step_gaps --model DIR [--concurrency 1 16 64] [--set execute.x=y] [--json out.json]

Per level, the median over the repeats of: wall, time inside execute, the gaps' sum and
largest one, and the steps (prefill and decode windows, with their lengths; "+" marks a
window planned while the one before ran, schedule.overlap_windows). The decode windows'
time is split as tools/probe/probe_cuda.py splits its runner's, per lookahead step: build (the
traced step's replay), submit (`mx.async_eval`), wait (`mx.eval`) and other (the
runner's own Python), so the engine's steps compare with the runner's alone; the prefill
steps' (a prompt fed, no window) as tools/probe/probe_prefill.py splits them: build (the
forward's graph), wait (`mx.eval`: MLX's encoding, then the GPU) and other. On MLX's CPU
backend the CPU kernels evaluate inside the forward, so there a prefill's build and wait
overlap and its "other" comes out negative.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from tools.common.runs import batch_room, engine_overrides, make_prompts, run_unikern
from tools.common.step_clock import StepClock, medians, steps_line


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="llama-5m", help="a modelgen preset or a model directory")
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 16, 64])
    parser.add_argument("--prompt-tokens", type=int, default=64)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--token-budget", type=int, default=4096, help="schedule.max_num_batched_tokens, as bench_gpu")
    parser.add_argument("--set", dest="overrides", action="append", default=[], help="stage.key=value")
    parser.add_argument("--clear-cache", action="store_true",
                        help="mx.clear_cache() before each run, as bench_gpu's mlx-lm runs between unikern's do "
                             "(mlx-lm's batch_generate clears MLX's buffer cache after each prompt batch)")
    parser.add_argument("--json")
    args = parser.parse_args()

    import unikern  # first: the BLAS MLX's CPU backend should use

    # isort: split
    import anyio

    from unikern.testing.modelgen import cached_model

    path = args.model if Path(args.model).exists() else str(cached_model(args.model))
    overrides = engine_overrides(batch_room(args.concurrency, args.token_budget), args.overrides)
    clock = StepClock()
    clock.install()
    results = []

    vocab = json.loads((Path(path) / "config.json").read_text())["vocab_size"]

    async def run_level(engine, level: int) -> dict:
        prompts = make_prompts(level, vocab, args.prompt_tokens, args.prompt_tokens, seed=level)  # as bench_gpu's
        if args.clear_cache:
            import mlx.core as mx

            mx.clear_cache()
        clock.steps.clear()
        began = time.perf_counter()
        run = await run_unikern(engine, prompts, args.max_tokens)
        return {"wall_ms": run["wall"] * 1e3, "ttft_ms": run["ttft"] * 1e3,
                **clock.summary(began, time.perf_counter(), with_steps=True)}

    async def main_async() -> None:
        async with unikern.Engine.from_pipeline("generate", model=path, overrides=overrides) as engine:
            for level in args.concurrency:
                await run_level(engine, level)  # untimed: kernels built, steps traced
                runs = [await run_level(engine, level) for _ in range(args.repeats)]
                row = {"concurrency": level, "runs": runs, **medians(runs)}
                results.append(row)
                # "+": a window planned while the one before ran (schedule.overlap_windows)
                shape = " ".join(f"{'+' if s['follow_up'] else ''}{s['num_steps']}x{s['rows']}"
                                 for s in runs[-1]["steps"])
                print(f"c={level:<3} wall {row['wall_ms']:7.1f} ms  in execute {row['execute_ms']:7.1f}  gaps "
                      f"{row['gaps_ms']:6.1f} (largest {row['largest_gap_ms']:.1f})  head {row['head_ms']:.1f} tail "
                      f"{row['tail_ms']:.1f}  steps (num_steps x rows): {shape}",
                      flush=True)
                if line := steps_line(row):
                    print("      " + line, flush=True)

    anyio.run(main_async)
    if args.json:
        Path(args.json).write_text(json.dumps({"model": args.model, "overrides": args.overrides,
                                               "levels": results}, indent=1))


if __name__ == "__main__":
    main()
