"""What a request's prompt log-probabilities cost: one engine, a prompt of N tokens and
max_tokens 1, alternately plain and with `prompt_logprobs`, each with its own first token
(so neither finds a cached prefix); per variant the median seconds of `complete`.

    python -m tools.bench.bench_prompt_logprobs [--model llama-5m] [--tokens 512] [--top 5] [--repeats 5]
"""

from __future__ import annotations

import argparse
import statistics
import time

import anyio

import unikern
from unikern.testing.modelgen import PRESETS, cached_model


async def run(model: str, num_tokens: int, top: int, repeats: int) -> dict[str, list[float]]:
    prompt = [(7 * j) % 900 + 5 for j in range(num_tokens)]
    overrides = {"kv": {"kv_budget_bytes": 256 << 20}}
    seconds: dict[str, list[float]] = {"plain": [], f"prompt_logprobs={top}": []}
    async with unikern.Engine.from_pipeline("generate", model=model, overrides=overrides) as engine:
        await engine.complete(prompt_tokens=prompt, max_tokens=1, prompt_logprobs=top)  # warm
        for r in range(repeats):
            for name, extra in zip(seconds, ({}, {"prompt_logprobs": top}), strict=True):
                fresh = [r * 3 + len(extra) + 1, *prompt[1:]]
                start = time.perf_counter()
                await engine.complete(prompt_tokens=fresh, max_tokens=1, **extra)
                seconds[name].append(time.perf_counter() - start)
    return seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="llama-5m", help="a modelgen preset or a model directory")
    parser.add_argument("--tokens", type=int, default=512)
    parser.add_argument("--top", type=int, default=5)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    model = str(cached_model(args.model)) if args.model in PRESETS else args.model
    for name, values in anyio.run(run, model, args.tokens, args.top, args.repeats).items():
        print(f"{name}: median {statistics.median(values) * 1e3:.1f} ms of {[round(v * 1e3, 1) for v in values]}")


if __name__ == "__main__":
    main()
