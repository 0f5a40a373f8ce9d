"""The engine with a stand-in model of fixed cost per step: how long the model thread
waits for Python's GIL while the event loop schedules, detokenizes and delivers.

On a GPU the model thread's step is a little Python (building and launching the traced
step; the GIL held) and then the GPU's work (the GIL released while it waits). Here
each step spins for --host-us of Python and sleeps --gpu-ms, and the rest of the engine
is the real one: scheduler, output stage (detokenizing in the prompt's context), the library's
delivery and a benchmark's consumers (tools/common/runs.py's run_unikern). Per concurrency it prints the
model thread's time per step against what the step costs alone, so the difference is
time spent waiting for the GIL; --switch-interval sets Python's (default 5 ms).

    python -m tools.probe.host_bound [--model llama-5m] [--gpu-ms 2.6] [--host-us 300] [--handoffs 1]
        [--concurrency 1 16 64] [--switch-interval MS] [--set STAGE.KEY=VALUE] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

from tools.common.runs import batch_room, engine_overrides, make_prompts, run_unikern


def spin(seconds: float) -> None:
    """Python work holding the GIL for `seconds` of this thread's own run time."""
    end = time.thread_time() + seconds
    while time.thread_time() < end:
        pass


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="llama-5m", help="a modelgen preset or a model directory (its tokenizer)")
    parser.add_argument("--gpu-ms", type=float, default=2.6, help="each step's GIL-free wait (the GPU's work)")
    parser.add_argument("--host-us", type=float, default=300.0, help="each step's Python with the GIL held")
    parser.add_argument("--handoffs", type=int, default=1,
                        help="times per step the model thread gives the GIL up and takes it back (the host "
                             "work and the wait split in as many parts)")
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 16, 64])
    parser.add_argument("--prompt-tokens", type=int, default=64)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--switch-interval", type=float, default=None, help="ms (sys.setswitchinterval)")
    parser.add_argument("--set", action="append", default=[], dest="overrides", metavar="STAGE.KEY=VALUE",
                        help="a pipeline setting, e.g. execute.gil_switch_ms=0.2 or schedule.overlap_windows=true")
    parser.add_argument("--json")
    args = parser.parse_args()
    if args.switch_interval is not None:
        sys.setswitchinterval(args.switch_interval / 1e3)

    import unikern  # first: the BLAS MLX's CPU backend should use

    # isort: split
    import anyio

    from unikern import messages as m
    from unikern.stages.execute.runner import ModelRunner
    from unikern.testing.modelgen import cached_model

    path = args.model if Path(args.model).exists() else str(cached_model(args.model))
    vocab = json.loads((Path(path) / "config.json").read_text())["vocab_size"]
    steps: list[tuple[int, float]] = []  # per execute: steps in it, the thread's wall seconds

    def execute(self, step: m.Step, seeds: dict[str, int]) -> m.StepDone:
        start = time.perf_counter()
        for _ in range(step.num_steps * args.handoffs):
            spin(args.host_us / 1e6 / args.handoffs)
            time.sleep(args.gpu_ms / 1e3 / args.handoffs)
        # tokens that are no one's end of sequence, a different one per row and step
        sampled = {w.request_id: [5 + (hash(w.request_id) + i) % (vocab - 10) for i in range(step.num_steps)]
                   for w in step.work if w.sample}
        steps.append((step.num_steps, time.perf_counter() - start))
        return m.StepDone(step.step_id, sampled)

    ModelRunner.execute = execute
    overrides = engine_overrides({**batch_room(args.concurrency, 4096), "execute": {"warmup": "never"}}, args.overrides)
    alone = args.host_us / 1e6 + args.gpu_ms / 1e3
    results = []

    async def run_level(engine, level: int) -> dict:
        prompts = make_prompts(level, vocab, args.prompt_tokens, args.prompt_tokens, seed=level)
        steps.clear()
        run = await run_unikern(engine, prompts, args.max_tokens)
        n = sum(k for k, _ in steps)
        inside = sum(s for _, s in steps)
        return {"wall_ms": run["wall"] * 1e3, "steps": n, "step_ms": inside / n * 1e3,
                "alone_ms": alone * 1e3, "wait_share": (inside - n * alone) / inside}

    async def main_async() -> None:
        async with unikern.Engine.from_pipeline("generate", model=path, overrides=overrides) as engine:
            for level in args.concurrency:
                await run_level(engine, level)
                runs = [await run_level(engine, level) for _ in range(args.repeats)]
                row = {"concurrency": level, "runs": runs,
                       **{k: statistics.median(r[k] for r in runs) for k in ("wall_ms", "step_ms", "wait_share")}}
                results.append(row)
                walls = [r["wall_ms"] for r in runs]
                print(f"c={level:<3} wall {row['wall_ms']:7.1f} ms ({min(walls):.1f}-{max(walls):.1f})  model thread {row['step_ms']:.3f} ms per step "
                      f"(alone {alone * 1e3:.3f}): {row['wait_share']:.0%} of its time waiting", flush=True)

    anyio.run(main_async)
    if args.json:
        Path(args.json).write_text(json.dumps({"args": vars(args), "levels": results}, indent=1))


if __name__ == "__main__":
    main()
