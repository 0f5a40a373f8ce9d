"""tools/check/load.py's library mode: an in-process `unikern.Engine` under concurrent
load, where a share of the requests carry a logits processor that raises (the worker
cannot send Python callables). Every other request is greedy and checked against mlx-lm.

    python -m tools.check.load --mode library --requests 1000 --concurrency 32 \\
        --raising-processors 0.05 --set schedule.max_num_seqs=32

Passes when: each request whose processor raised ends alone with `processor_failed`;
every other one completes with mlx_lm.stream_generate's tokens (a stop string: a prefix
of them; a near-tie: counted); no stage fault; no KV block stays in use.
"""

from __future__ import annotations

import json
import random
import time
from pathlib import Path
from typing import Any

import anyio
import psutil

from tools.check.workload import make_requests, percentiles

MiB = 1 << 20


class RaisingProcessor:
    """Raises on its `fail_at`-th call: a user's buggy logits processor."""

    def __init__(self, fail_at: int) -> None:
        self.fail_at = fail_at
        self.calls = 0
        self.raised = False  # a request may end (stop string, EOS) before the failing call

    def __call__(self, token_ids: list[int], logits: Any) -> Any:
        self.calls += 1
        if self.calls >= self.fail_at:
            self.raised = True
            raise RuntimeError(f"load.py: injected logits processor fault (call {self.calls})")
        return logits


def greedy_requests(n: int, model: str, rng: random.Random) -> list[dict[str, Any]]:
    """load.py's mix (shared prefixes, lengths, stop strings) as token prompts, greedy."""
    from mlx_lm.utils import load_tokenizer

    tokenizer = load_tokenizer(Path(model))
    vocab = json.loads((Path(model) / "config.json").read_text())["vocab_size"]
    requests = make_requests(n, vocab, rng)
    for body in requests:
        if "prompt" in body:  # the same BOS rule as the tokenize stage
            body["prompt_tokens"] = list(tokenizer.encode(body.pop("prompt")))
        body.pop("temperature", None)
        body.pop("seed", None)
    return requests


async def drive(engine: Any, requests: list[dict[str, Any]], raising: dict[str, RaisingProcessor], concurrency: int) -> dict[str, dict[str, Any]]:
    """Run every request, at most `concurrency` at once; the outcome of each by id."""
    from unikern import messages as m
    from unikern.errors import UnikernError

    outcomes: dict[str, dict[str, Any]] = {}
    limit = anyio.Semaphore(concurrency)

    async def one(body: dict[str, Any]) -> None:
        rid = body["id"]
        processors = [raising[rid]] if rid in raising else None
        outcome: dict[str, Any] = {"tokens": []}
        async with limit:
            outcome["sent"] = time.monotonic()  # latencies from here: not the wait for a slot
            try:
                events = engine.generate(prompt_tokens=body["prompt_tokens"], max_tokens=body["max_tokens"],
                                         stop=body.get("stop", ()), logits_processors=processors, request_id=rid)
                async for event in events:
                    if isinstance(event, m.TokenEvent):
                        outcome["tokens"].append(event.token_id)
                        outcome.setdefault("first_token", time.monotonic())
                    elif isinstance(event, m.DoneEvent):
                        outcome["end"] = event.finish_reason
                    else:
                        outcome["end"], outcome["message"] = f"error:{event.code}", event.message
            except UnikernError as exc:  # refused at the call: the engine has failed
                outcome["end"], outcome["message"] = f"error:{getattr(exc, 'code', 'stage_failed')}", str(exc)
        outcome["ended"] = time.monotonic()
        outcomes[rid] = outcome

    async with anyio.create_task_group() as tg:
        for body in requests:
            tg.start_soon(one, body)
    return outcomes


def check_tokens(model: str, requests: list[dict[str, Any]], outcomes: dict[str, dict[str, Any]], raised: set[str]) -> dict[str, Any]:
    """Each completed request's tokens against mlx-lm's greedy ones (after the load)."""
    from mlx_lm import load

    from unikern.testing.reference import compare, greedy_reference

    reference_model = load(model)
    counts = {"exact": 0, "near-tie": 0, "stop-prefix": 0, "mismatch": 0}
    mismatches = []
    for body in requests:
        rid, outcome = body["id"], outcomes.get(body["id"], {})
        if rid in raised or outcome.get("end") not in ("length", "stop"):
            continue
        ref = greedy_reference(*reference_model, body["prompt_tokens"], body["max_tokens"])
        ours = outcome["tokens"]
        if outcome["end"] == "stop" and body.get("stop") and ours == ref.tokens[: len(ours)]:
            counts["stop-prefix"] += 1  # a stop string ended it early: mlx-lm's tokens so far
            continue
        row = compare(ours, ref)
        counts[row["result"] if row["result"] != "exact" else "exact"] += 1
        if row["result"] == "mismatch":
            mismatches.append({"id": rid, **row})
    return {"counts": counts, "mismatches": mismatches[:10]}


def run_library(model: str, *, num_requests: int, concurrency: int, raising_fraction: float, seed: int,
                sets: list[str], check: bool = True) -> dict[str, Any]:
    import unikern
    from unikern.errors import StageError
    from unikern.spec import parse_overrides

    rng = random.Random(seed)
    requests = greedy_requests(num_requests, model, rng)
    chosen = rng.sample(requests, round(raising_fraction * len(requests)))
    raising = {b["id"]: RaisingProcessor(fail_at=rng.randint(1, 3)) for b in chosen}
    overrides = parse_overrides([f"kv.kv_budget_bytes={64 * MiB}", *sets])
    process = psutil.Process()

    async def main() -> dict[str, Any]:
        run: dict[str, Any] = {}
        try:
            async with unikern.Engine.from_pipeline("generate", model=model, overrides=overrides) as engine:
                run["rss_ready"] = process.memory_info().rss
                started = time.monotonic()
                run["outcomes"] = await drive(engine, requests, raising, concurrency)
                run["wall"] = time.monotonic() - started
                run["stats"] = engine.stats()
        except StageError as exc:  # the engine re-raises its fault when it closes
            run["fault"] = str(exc)
        return run

    result = anyio.run(main)
    outcomes = result["outcomes"]
    ends: dict[str, int] = {}
    for outcome in outcomes.values():
        ends[outcome.get("end", "missing")] = ends.get(outcome.get("end", "missing"), 0) + 1
    # a processor that never reached its failing call (the request ended first) is harmless;
    # one that raised on a step past the request's stop string fails a token nobody sees:
    # the request ends "stop", as the caller saw it, and is checked like the others
    by_id = {b["id"]: b for b in requests}
    past_stop = {rid for rid, p in raising.items()
                 if p.raised and outcomes[rid].get("end") == "stop" and by_id[rid].get("stop")}
    raised = {rid for rid, processor in raising.items() if processor.raised} - past_stop
    raised_ends = [outcomes[rid].get("end") for rid in raised]
    others = [outcomes[b["id"]].get("end") for b in requests if b["id"] not in raised]
    completed = [o for rid, o in outcomes.items() if rid not in raised and o.get("end") in ("length", "stop")]
    generated = sum(len(o["tokens"]) for o in outcomes.values())
    summary: dict[str, Any] = {
        "mode": "library", "model": model, "requests": len(requests), "concurrency": concurrency,
        "raising_processors": len(raising), "processors_raised": len(raised) + len(past_stop),
        "raised_past_a_stop_string": len(past_stop), "ends": ends, "stage_fault": result.get("fault"),
        "generated_tokens": generated, "wall_seconds": round(result["wall"], 2),
        "tokens_per_second": round(generated / result["wall"], 1) if result["wall"] else 0.0,
        "ttft_seconds": {k: round(v, 4) for k, v in percentiles([o["first_token"] - o["sent"] for o in completed if "first_token" in o]).items()},
        "total_seconds": {k: round(v, 4) for k, v in percentiles([o["ended"] - o["sent"] for o in completed]).items()},
        "kv_blocks_used_at_end": result["stats"]["kv"]["blocks_used"],
        "rss_mib": {"ready": round(result["rss_ready"] / MiB, 1), "end": round(process.memory_info().rss / MiB, 1)},
    }
    summary["tokens_vs_mlx_lm"] = check_tokens(model, requests, outcomes, raised) if check else None
    parity = summary["tokens_vs_mlx_lm"]
    summary["criteria"] = {
        f"each of the {len(raised)} requests whose processor raised ends with processor_failed": all(e == "error:processor_failed" for e in raised_ends),
        f"all {len(others)} other requests complete": all(e in ("length", "stop") for e in others),
        "no stage fault": result.get("fault") is None and not any(e == "error:stage_failed" for e in ends),
        "no KV blocks used at the end": summary["kv_blocks_used_at_end"] == 0,
    }
    if parity is not None:
        summary["criteria"]["every completed request has mlx-lm's tokens (near-ties counted)"] = parity["counts"]["mismatch"] == 0
    summary["passed"] = all(summary["criteria"].values())
    return summary


def print_library_report(summary: dict[str, Any]) -> None:
    for key in ("requests", "raising_processors", "processors_raised", "raised_past_a_stop_string", "ends", "stage_fault", "generated_tokens", "wall_seconds",
                "tokens_per_second", "ttft_seconds", "total_seconds", "kv_blocks_used_at_end", "rss_mib", "tokens_vs_mlx_lm"):
        print(f"{key:>24}: {summary[key]}")
    for criterion, ok in summary["criteria"].items():
        print(f"{'PASS' if ok else 'FAIL'}  {criterion}")
