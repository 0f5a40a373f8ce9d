"""Greedy parity of unikern against mlx_lm.stream_generate, standalone (no pytest).

For each model, N prompts of varied lengths go through one unikern Engine all at once
(so they share batched steps), and one by one through `mlx_lm.stream_generate`. A prompt
passes when the tokens are identical, or when the first difference falls on a step where
mlx-lm's own top-2 logits are within 1e-3 (a near-tie, reported, as DESIGN.md allows).

With --mlx-lm-batch the same prompts also go through `mlx_lm.batch_generate` and are
compared with stream_generate the same way: on a GPU that says how far mlx-lm's own
batched decode strays from its single-stream one (TF32 / bf16 rounding that depends on
the batch shape), i.e. what any batching engine must expect.

    python -m tools.check.parity_check --model llama-5m llama-80m --prompts 16 --max-tokens 32
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from tools.common.runs import engine_overrides


def prompts(n: int, vocab: int) -> list[list[int]]:
    # lengths cross kernel (16) and logical (64 here) block edges
    lengths = [3, 9, 15, 16, 17, 31, 47, 64, 100, 129, 200, 257, 300, 5]
    return [[(7 * i + 13 * j) % (vocab - 10) + 5 for j in range(lengths[i % len(lengths)])] for i in range(n)]


def check(path: str, n: int, max_tokens: int, block_size: int, token_budget: int,
          mlx_lm_batch: bool = False, extra: list[str] = ()) -> dict:
    import anyio
    from mlx_lm import load

    import unikern
    from unikern.testing.reference import compare, greedy_reference

    model, tokenizer = load(path)
    batch = prompts(n, len(tokenizer))
    overrides = engine_overrides({"kv": {"kv_budget_bytes": 256 << 20, "block_size": block_size},
                                  "schedule": {"max_num_batched_tokens": token_budget}}, extra)
    results: list = [None] * n

    async def main():
        async with unikern.Engine.from_pipeline("generate", model=path, overrides=overrides) as engine:
            async def one(i):
                results[i] = await engine.complete(prompt_tokens=batch[i], max_tokens=max_tokens)

            async with anyio.create_task_group() as tg:
                for i in range(n):
                    tg.start_soon(one, i)
            return engine.stats()

    start = time.perf_counter()
    stats = anyio.run(main)
    engine_s = time.perf_counter() - start
    theirs = None
    if mlx_lm_batch:
        from mlx_lm import batch_generate

        theirs = batch_generate(model, tokenizer, batch, max_tokens=max_tokens, return_token_ids=True).token_ids
    rows, batch_rows = [], []
    for i, (prompt, result) in enumerate(zip(batch, results, strict=True)):
        ref = greedy_reference(model, tokenizer, prompt, max_tokens)
        row = compare(result.token_ids, ref)
        row["prompt_tokens"] = len(prompt)
        rows.append(row)
        if theirs is not None:
            other = compare(list(theirs[i]), ref)
            other["prompt_tokens"] = len(prompt)
            other["same_as_unikern"] = list(theirs[i]) == list(result.token_ids)
            batch_rows.append(other)
    counts = {k: sum(r["result"] == k for r in rows) for k in ("exact", "near-tie", "mismatch")}
    extra = {}
    if theirs is not None:
        extra["mlx_lm_batch_rows"] = batch_rows
        extra["mlx_lm_batch_counts"] = {k: sum(r["result"] == k for r in batch_rows)
                                        for k in ("exact", "near-tie", "mismatch")}
        extra["mlx_lm_batch_same_as_unikern"] = sum(r["same_as_unikern"] for r in batch_rows)
    return {**extra,
        "model": path,
        "prompts": n,
        "max_tokens": max_tokens,
        "block_size": block_size,
        "token_budget": token_budget,
        "engine_seconds": engine_s,
        "counts": counts,
        "passed": counts["mismatch"] == 0,
        "rows": rows,
        "platform": stats.get("platform"),
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", nargs="+", default=["llama-5m"],
                        help="modelgen presets or model directories")
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--block-size", type=int, default=64)
    parser.add_argument("--token-budget", type=int, default=256)
    parser.add_argument("--mlx-lm-batch", action="store_true",
                        help="also compare mlx_lm.batch_generate with stream_generate")
    parser.add_argument("--json", help="write the results here")
    parser.add_argument("--set", action="append", default=[], dest="overrides", metavar="STAGE.KEY=VALUE",
                        help="a pipeline parameter for unikern's engine (repeatable)")
    args = parser.parse_args()
    from unikern.testing.modelgen import cached_model

    report = []
    for name in args.model:
        path = name if Path(name).exists() else str(cached_model(name))
        res = check(path, args.prompts, args.max_tokens, args.block_size, args.token_budget, args.mlx_lm_batch,
                    args.overrides)
        res["name"] = name
        report.append(res)
        notes = [f"{r['prompt_tokens']}-token prompt: {r['result']} at step {r['step']} "
                 f"(margin {r.get('margin', float('nan')):.2e})" for r in res["rows"] if r["result"] != "exact"]
        print(f"parity {name}: {res['counts']} -> {'PASS' if res['passed'] else 'FAIL'}", flush=True)
        for note in notes:
            print(f"    {note}")
        if "mlx_lm_batch_counts" in res:
            print(f"    mlx-lm batch_generate vs stream_generate: {res['mlx_lm_batch_counts']}; "
                  f"identical to unikern's tokens on {res['mlx_lm_batch_same_as_unikern']}/{args.prompts} prompts")
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2))
    return 0 if all(r["passed"] for r in report) else 1


if __name__ == "__main__":
    sys.exit(main())
