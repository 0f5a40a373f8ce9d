"""Where an engine run's wall time goes between the model thread's steps: each step's
time inside `ModelRunner.execute` (the forward, its sync and sampling) and the gaps
between one step's end and the next one's start (the StepDone's trip through the
scheduler, the output stage and the messages, the next step's tables). The requests are
tools/bench_gpu.py's for unikern (its prompts and its run_unikern), through the library.

    python tools/step_gaps.py --model DIR [--concurrency 1 16 64] [--set execute.x=y] [--json out.json]

Per level, the median over the repeats of: wall, time inside execute, the gaps' sum and
largest one, and the steps (prefill and decode windows, with their lengths; "+" marks a
window planned while the one before ran, schedule.overlap_windows). The decode windows'
time is split as tools/probe_cuda.py splits its runner's, per lookahead step: build (the
traced step's replay), submit (`mx.async_eval`), wait (`mx.eval`) and other (the
runner's own Python), so the engine's steps compare with the runner's alone; the prefill
steps' (a prompt fed, no window) as tools/probe_prefill.py splits them: build (the
forward's graph), wait (`mx.eval`: MLX's encoding, then the GPU) and other. On MLX's CPU
backend the CPU kernels evaluate inside the forward, so there a prefill's build and wait
overlap and its "other" comes out negative.
"""

from __future__ import annotations

import argparse
import json
import statistics
import threading
import time
from pathlib import Path


class StepClock:
    """Times ModelRunner.execute per step and splits the decode windows' time on the model
    thread into build (the traced step's replay), submit (`mx.async_eval`), wait
    (`mx.eval`) and other (the runner's own Python). install() patches the classes for
    the process (a tool's, not the engine's)."""

    PARTS = ("build", "submit", "wait")

    def __init__(self) -> None:
        # start, end, num_steps, rows, tokens fed, follow-up, the window's host time by part
        self.steps: list[tuple[float, float, int, int, int, bool, dict[str, float]]] = []
        self.spent = dict.fromkeys(self.PARTS, 0.0)  # seconds, on the model thread
        self._thread: int | None = None  # the thread inside a decode window's execute

    def install(self) -> None:
        import mlx.core as mx
        from probe_cuda import timed  # tools/ is on sys.path

        from unikern.stages.execute.compiled import CompiledDecode
        from unikern.stages.execute.runner import ModelRunner

        execute = ModelRunner.execute
        clock = self

        def execute_timed(runner, step, seeds):
            clock._thread = threading.get_ident()
            before = dict(clock.spent)
            start = time.perf_counter()
            try:
                return execute(runner, step, seeds)
            finally:
                end = time.perf_counter()
                clock._thread = None
                clock.steps.append((start, end, step.num_steps, len(step.work),
                                    sum(len(w.token_ids) for w in step.work), any(w.continues for w in step.work),
                                    {k: clock.spent[k] - before[k] for k in clock.PARTS}))

        ModelRunner.execute = execute_timed

        def on_model_thread() -> bool:
            return self._thread == threading.get_ident()

        timed(CompiledDecode, "__call__", self.spent, "build", when=on_model_thread)
        # a prefill's forward: the family's (_logits) or by rows (_logits_by_rows)
        timed(ModelRunner, "_logits", self.spent, "build", when=on_model_thread)
        timed(ModelRunner, "_logits_by_rows", self.spent, "build", when=on_model_thread)
        timed(mx, "async_eval", self.spent, "submit", when=on_model_thread)
        timed(mx, "eval", self.spent, "wait", when=on_model_thread)

    def summary(self, began: float, ended: float, with_steps: bool = False) -> dict:
        """The steps since `steps` was last cleared, in ms: time inside execute, the gaps
        between steps, head (from `began` to the first step) and tail (from the last step
        to `ended`), and per decode-window step its time and parts."""
        steps = self.steps
        gaps = [steps[i + 1][0] - steps[i][1] for i in range(len(steps) - 1)]
        windows = [s for s in steps if s[2] > 1]
        decode_steps = sum(s[2] for s in windows)
        out = {"execute_ms": sum(s[1] - s[0] for s in steps) * 1e3,
               "gaps_ms": sum(gaps) * 1e3, "largest_gap_ms": max(gaps, default=0) * 1e3,
               "head_ms": (steps[0][0] - began) * 1e3 if steps else None,
               "tail_ms": (ended - steps[-1][1]) * 1e3 if steps else None}
        if decode_steps:
            out.update({f"{k}_ms": sum(s[6][k] for s in windows) / decode_steps * 1e3 for k in self.PARTS})
            out["window_step_ms"] = sum(s[1] - s[0] for s in windows) / decode_steps * 1e3
            out["other_ms"] = out["window_step_ms"] - sum(out[f"{k}_ms"] for k in self.PARTS)
        # steps that feed a prompt (more tokens than rows) and decode no window
        prefills = [s for s in steps if s[2] == 1 and s[4] > s[3]]
        if prefills:
            out["prefill_step_ms"] = sum(s[1] - s[0] for s in prefills) / len(prefills) * 1e3
            for k in ("build", "wait"):
                out[f"prefill_{k}_ms"] = sum(s[6][k] for s in prefills) / len(prefills) * 1e3
            out["prefill_other_ms"] = out["prefill_step_ms"] - out["prefill_build_ms"] - out["prefill_wait_ms"]
        if with_steps:
            out["steps"] = [{"num_steps": n, "rows": r, "tokens_fed": t, "follow_up": f, "ms": (e - s) * 1e3,
                             "gap_before_ms": (s - steps[i - 1][1]) * 1e3 if i else None}
                            for i, (s, e, n, r, t, f, _) in enumerate(steps)]
        return out


def medians(runs: list[dict]) -> dict:
    """Each figure the runs all have (numbers, not None), as its median over them."""
    return {k: statistics.median(r[k] for r in runs) for k, v in runs[0].items()
            if isinstance(v, int | float) and all(isinstance(r.get(k), int | float) for r in runs)}


def steps_line(row: dict) -> str:
    line = ""
    if "prefill_step_ms" in row:
        line = (f"prefill steps: {row['prefill_step_ms']:.2f} ms  build {row['prefill_build_ms']:.2f}  "
                f"wait {row['prefill_wait_ms']:.2f}  other {row['prefill_other_ms']:.2f}; ")
    if "window_step_ms" in row:
        line += (f"decode windows: {row['window_step_ms']:.3f} ms per step  build {row['build_ms']:.3f}  "
                 f"submit {row['submit_ms']:.3f}  wait {row['wait_ms']:.3f}  other {row['other_ms']:.3f}")
    return line


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
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

    # tools/ is on sys.path when run as a script
    from bench import batch_room, engine_overrides, make_prompts
    from bench_gpu import run_unikern

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
