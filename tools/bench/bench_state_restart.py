"""Time to first token of a recurrent model's prompt cold, and from the disk tier in a fresh
engine (KV blocks and the state checkpoint at their end loaded from files), in one run.

    python -m tools.bench.bench_state_restart [--families qwen3-next nemotron-h mamba2] [--prompt-tokens 2048] [--repeats 2]

The test models of `unikern.testing.families` (tiny, random weights): what it shows is
what the restart saves relative to computing the prompt, and that the cached tokens and
the greedy tokens agree with the cold run; absolute times mean little.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time

import anyio

import unikern


async def first_token(engine, prompt: list[int]) -> tuple[float, list[int], int]:
    start, ttft, tokens, cached = time.perf_counter(), None, [], 0
    async for event in engine.generate(prompt_tokens=prompt, max_tokens=8, temperature=0.0):
        if ttft is None:
            ttft = time.perf_counter() - start
        if isinstance(event, unikern.messages.TokenEvent):
            tokens.append(event.token_id)
        else:
            cached = event.usage.cached_tokens
    return ttft, tokens, cached


async def settle(engine) -> None:
    """Wait (up to 10 s) for the mover's stores, so the restart finds every file."""
    with anyio.move_on_after(10):
        while (s := engine.stats()["offload"])["inflight_blocks"] or s["queued_blocks"]:  # noqa: ASYNC110
            await anyio.sleep(0.01)


async def one(path: str, prompt: list[int]) -> dict:
    overrides = {"disk": {"path": tempfile.mkdtemp()}, "kv": {"kv_budget_bytes": 64 << 20, "host_bytes": 0}}
    row: dict = {}
    for label in ("cold", "restart"):
        async with unikern.Engine.from_pipeline("generate-offload", model=path, overrides=overrides) as engine:
            await engine.complete(prompt_tokens=[5, 6, 7, 8] * 10, max_tokens=2)  # one-time costs
            ttft, tokens, cached = await first_token(engine, prompt)
            await settle(engine)
            stats = engine.stats()
        row[label] = {"ttft_s": round(ttft, 4), "cached_tokens": cached, "tokens": tokens,
                      "states_loaded": stats["offload"]["states_loaded"], "state_files": stats["tiers"]["disk"]["states"]}
    row["same_tokens"] = row["cold"]["tokens"] == row["restart"]["tokens"]
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--families", nargs="+", default=["qwen3-next", "nemotron-h", "mamba2"])
    parser.add_argument("--prompt-tokens", type=int, default=2048)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--json", help="write the results here")
    args = parser.parse_args()
    from unikern.testing.families import cached_family_model

    prompt = [(13 * j) % 1000 + 7 for j in range(args.prompt_tokens)]
    results = {}
    for family in args.families:
        path = str(cached_family_model(f"tiny-{family}"))
        results[family] = rows = [anyio.run(one, path, prompt) for _ in range(args.repeats)]
        for r in rows:
            print(f"{family}: cold {r['cold']['ttft_s']:.3f} s, restart {r['restart']['ttft_s']:.3f} s "
                  f"({r['cold']['ttft_s'] / r['restart']['ttft_s']:.1f}x), cached {r['restart']['cached_tokens']}, "
                  f"states loaded {r['restart']['states_loaded']}, same tokens {r['same_tokens']}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
