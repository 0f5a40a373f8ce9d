"""How often a library program that generates and returns exits 0: fresh processes, each
`async with Engine...`, a few requests, then a normal return (no os._exit anywhere).

`--legacy-shutdown` runs the same program with the model thread stopped the old way
(`ThreadPoolExecutor.shutdown(wait=False)`, no wait for the OS thread), for an A/B of
the fix in stages/execute/thread.py. Rounds alternate the two so both meet the same
machine load.

    python -m tools.check.exit_check --model PATH --runs 10 --ab --json tools/results/exit-check.json
"""

from __future__ import annotations

import argparse
import collections
import json
import subprocess
import sys
import time

CHILD = r"""
import sys, anyio, unikern
if sys.argv[2] == "legacy":
    from unikern.stages.execute.thread import ModelThread
    ModelThread.close = lambda self: self._executor.shutdown(wait=False, cancel_futures=True)

async def main():
    overrides = {"kv": {"kv_budget_bytes": 256 << 20}}
    async with unikern.Engine.from_pipeline("generate", model=sys.argv[1], overrides=overrides) as engine:
        async def one(i):
            await engine.complete(prompt_tokens=[1 + i, 2, 3], max_tokens=16)

        async with anyio.create_task_group() as tg:
            for i in range(4):
                tg.start_soon(one, i)
        result = await engine.complete(prompt_tokens=[1, 2, 3, 4, 5], max_tokens=16)
        print("tokens", len(result.token_ids))
        if sys.argv[3] == "in-flight":  # leave while long requests are still generating
            events = [engine.generate(prompt_tokens=[5 + i, 6, 7], max_tokens=2000) for i in range(8)]
            for stream in events:
                await stream.__anext__()

anyio.run(main)
"""


def run_once(model: str, variant: str, leave: str, timeout_s: float) -> tuple[int, str]:
    try:
        done = subprocess.run(
            [sys.executable, "-c", CHILD, model, variant, leave], capture_output=True, text=True, timeout=timeout_s
        )
    except subprocess.TimeoutExpired:
        return -9, "timeout"
    tail = done.stderr.strip().splitlines()[-1:] if done.returncode else []
    return done.returncode, tail[0] if tail else ""


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True)
    ap.add_argument("--runs", type=int, default=10, help="runs per variant")
    ap.add_argument("--ab", action="store_true", help="also run the legacy shutdown, interleaved")
    ap.add_argument("--timeout", type=float, default=300.0)
    ap.add_argument("--leave", choices=["idle", "in-flight"], default="idle",
                    help="leave the engine idle, or with 8 long requests still generating")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    variants = ["fixed", "legacy"] if args.ab else ["fixed"]
    codes: dict[str, collections.Counter] = {v: collections.Counter() for v in variants}
    messages: dict[str, collections.Counter] = {v: collections.Counter() for v in variants}
    start = time.perf_counter()
    for _ in range(args.runs):
        for variant in variants:
            rc, message = run_once(args.model, variant, args.leave, args.timeout)
            codes[variant][rc] += 1
            if message:
                messages[variant][message] += 1
    result = {
        "model": args.model,
        "leave": args.leave,
        "runs_per_variant": args.runs,
        "seconds": round(time.perf_counter() - start, 1),
        "exit_codes": {v: dict(c) for v, c in codes.items()},
        "failures": {v: dict(c) for v, c in messages.items()},
    }
    print(json.dumps(result, indent=2))
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(result, fh, indent=2)
    sys.exit(0 if set(codes["fixed"]) == {0} else 1)


if __name__ == "__main__":
    main()
