"""Drive a worker subprocess with many requests and report what happened.

    # mixed load: prompt lengths, shared prefixes, cancellations, bad lines interleaved
    python -m tools.check.load --requests 2000 --concurrency 32 --set schedule.max_num_seqs=32 \\
        --plot load.png --json load.json
    # the reliability check of issue 6: 2000 bad lines among 200 valid requests
    python -m tools.check.load --mode bad-lines --bad 2000 --requests 200 --set schedule.max_num_seqs=32
    # in-process Engine, 5% of requests with a raising logits processor (tools/check/load_library.py)
    python -m tools.check.load --mode library --requests 1000 --raising-processors 0.05 --set schedule.max_num_seqs=32

Reports completions, errors, cancellations, latency percentiles (time to first token,
total), throughput and the worker's resident memory over time (sampled every 0.5 s).
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from collections import deque
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from tools.check.bad_lines import bad_lines
from tools.check.load_library import print_library_report, run_library
from tools.check.worker_client import MiB, RssSampler, WorkerClient
from tools.check.workload import make_requests, percentiles

RSS_LIMIT_BYTES = 150 * MiB
WARMUP_REQUESTS = 8


class Progress:
    """One line on stderr every `every` seconds, so a long run shows it is alive."""

    def __init__(self, client: WorkerClient, total: int, every: float = 15.0) -> None:
        self.client, self.total, self.every = client, total, every
        self.next_at = time.monotonic() + every

    def maybe_print(self) -> None:
        now = time.monotonic()
        if now < self.next_at:
            return
        self.next_at = now + self.every
        c = self.client
        print(f"[{now - c.started_at:6.0f} s] sent {len(c.sent_at)}, ended {len(c.terminal)} of {self.total} (+warm-up), lines {c.lines_sent}", file=sys.stderr, flush=True)


def drive(
    client: WorkerClient,
    requests: list[dict[str, Any]],
    bad: list[Any],
    *,
    concurrency: int,
    cancel: dict[str, str],
    timeout: float,
) -> dict[int, Any]:
    """Send every request (at most `concurrency` in flight) with the bad lines spread
    evenly between them; cancel the ids in `cancel` ("queued": right after sending,
    "first_token": on their first token). Returns {line number: bad line}."""
    pending_cancels: deque[str] = deque()
    client.on_first_token = lambda rid: pending_cancels.append(rid) if cancel.get(rid) == "first_token" else None
    bad_at: dict[int, Any] = {}
    per_request = len(bad) / max(len(requests), 1)
    bad_iter = iter(bad)
    deadline = time.monotonic() + timeout
    progress = Progress(client, len(requests))
    for i, body in enumerate(requests):
        progress.maybe_print()
        for _ in range(int((i + 1) * per_request) - int(i * per_request)):
            line = next(bad_iter)
            bad_at[client.send(line.data)] = line
        with client.cond:
            while len(client.sent_at) - len(client.terminal) >= concurrency and not pending_cancels:
                if time.monotonic() > deadline or client.eof:
                    raise AssertionError(f"stuck with {concurrency} requests in flight\n{client.stderr_tail()}")
                client.cond.wait(0.5)
            to_cancel = [pending_cancels.popleft() for _ in range(len(pending_cancels))]
        for rid in to_cancel:
            client.send_json({"op": "cancel", "id": rid})
        client.send_json(body)
        if cancel.get(body["id"]) == "queued":
            client.send_json({"op": "cancel", "id": body["id"]})
        if i == len(requests) // 2:
            client.send_json({"op": "stats"})
    for line in bad_iter:
        bad_at[client.send(line.data)] = line
    ids = [r["id"] for r in requests]
    while True:  # cancels for first tokens that arrive from now on
        progress.maybe_print()
        with client.cond:
            if all(i in client.terminal for i in ids):
                break
            if time.monotonic() > deadline or client.eof:
                missing = [i for i in ids if i not in client.terminal]
                raise AssertionError(f"{len(missing)} requests never ended, e.g. {missing[:5]}\n{client.stderr_tail()}")
            client.cond.wait(0.2)
            to_cancel = [pending_cancels.popleft() for _ in range(len(pending_cancels))]
        for rid in to_cancel:
            if rid not in client.terminal:
                client.send_json({"op": "cancel", "id": rid})
    return bad_at


def summarize(client: WorkerClient, requests: list[dict[str, Any]], bad_at: dict[int, Any], *, started: float, finished: float) -> dict[str, Any]:
    reasons: dict[str, int] = {}
    errors: dict[str, int] = {}
    ttft, total, generated = [], [], 0
    for body in requests:
        rid = body["id"]
        event = client.terminal.get(rid)
        if event is None:
            reasons["missing"] = reasons.get("missing", 0) + 1
            continue
        generated += len(client.tokens.get(rid, ()))
        if event["event"] == "error":
            errors[event["code"]] = errors.get(event["code"], 0) + 1
            continue
        reasons[event["finish_reason"]] = reasons.get(event["finish_reason"], 0) + 1
        if event["finish_reason"] in ("length", "stop"):
            total.append(client.ended_at[rid] - client.sent_at[rid])
            if rid in client.first_token_at:
                ttft.append(client.first_token_at[rid] - client.sent_at[rid])
    bad_answered = sum(
        1 for number, line in bad_at.items()
        if len(client.by_line.get(number, [])) == 1
        and client.by_line[number][0]["event"] == "error"
        and client.by_line[number][0]["id"] == line.expected_id
    )
    late_cancels = other_errors = 0  # error events at lines that are not bad lines
    for number, events in client.by_line.items():
        if number in bad_at:
            continue
        for event in events:
            if event["event"] == "error" and event["code"] == "unknown_id":
                late_cancels += 1  # the request ended before its cancel arrived
            elif event["event"] == "error":
                other_errors += 1
    wall = finished - started
    return {
        "requests": len(requests),
        "completed": reasons.get("length", 0) + reasons.get("stop", 0),
        "finish_reasons": reasons,
        "cancelled": reasons.get("cancelled", 0),
        "request_errors": errors,
        "bad_lines": len(bad_at),
        "bad_lines_answered_once": bad_answered,
        "late_cancels": late_cancels,
        "other_error_events": other_errors,
        "not_json_lines": len(client.not_json),
        "generated_tokens": generated,
        "wall_seconds": round(wall, 2),
        "tokens_per_second": round(generated / wall, 1) if wall > 0 else 0.0,
        "requests_per_second": round(len(requests) / wall, 2) if wall > 0 else 0.0,
        "ttft_seconds": {k: round(v, 4) for k, v in percentiles(ttft).items()},
        "total_seconds": {k: round(v, 4) for k, v in percentiles(total).items()},
    }


def run(
    model: str,
    *,
    mode: str,
    num_requests: int,
    num_bad: int,
    concurrency: int,
    cancel_fraction: float,
    seed: int,
    sets: Sequence[str],
    timeout: float = 3600.0,
    plot: str | None = None,
    stderr_path: Path | None = None,
) -> dict[str, Any]:
    rng = random.Random(seed)
    vocab = json.loads((Path(model) / "config.json").read_text())["vocab_size"]
    client = WorkerClient(model, sets=[f"kv.kv_budget_bytes={64 * MiB}", *sets], stderr_path=stderr_path)
    sampler = None
    try:
        client.wait_ready()
        sampler = RssSampler(client)
        rss_ready = client.rss_bytes()
        warmup = make_requests(WARMUP_REQUESTS, vocab, rng, prefix="warmup")
        for body in warmup:
            client.send_json(body)
        client.wait_done([b["id"] for b in warmup], timeout=600)
        client.send_json({"op": "stats"})
        client.wait("stats after warm-up", lambda c: len(c.stats_events()) >= 1, timeout=60)
        rss_warm = client.rss_bytes()
        warm_at = time.monotonic() - client.started_at
        requests = make_requests(num_requests, vocab, rng)
        cancel: dict[str, str] = {}
        if mode == "mixed":
            for body in rng.sample(requests, int(cancel_fraction * len(requests))):
                body["max_tokens"] = 200  # long enough to be cancelled mid-decode
                cancel[body["id"]] = rng.choice(("first_token", "first_token", "queued"))
        bad = bad_lines(rng, num_bad)
        started = time.monotonic()
        bad_at = drive(client, requests, bad, concurrency=concurrency, cancel=cancel, timeout=timeout)
        finished = time.monotonic()
        stats_line = client.send_json({"op": "stats"})
        client.wait("the last stats", lambda c: len(c.stats_events()) >= 3, timeout=60)
        rss_end = client.rss_bytes()
        client.close_stdin()
        exit_code = client.wait_exit(timeout=120)
        sampler.stop()
        summary = summarize(client, requests, bad_at, started=started, finished=finished)
        last_stats = client.stats_events()[-1]
        after_warm = [rss for t, rss in sampler.samples if t >= warm_at] or [rss_end]
        summary.update(
            mode=mode, model=model, concurrency=concurrency, sets=list(sets), exit_code=exit_code,
            stats_answered=len(client.stats_events()), stats_line=stats_line,
            kv_blocks_used_at_end=last_stats["kv"]["blocks_used"],
            memory_after_warmup=client.stats_events()[0]["memory"], memory_at_end=last_stats["memory"],
            rss_mib={"ready": rss_ready / MiB, "after_warmup": rss_warm / MiB, "peak_after_warmup": max(after_warm) / MiB, "end": rss_end / MiB},
            rss_samples=[(round(t, 2), rss) for t, rss in sampler.samples],
        )
        summary["rss_mib"] = {k: round(v, 1) for k, v in summary["rss_mib"].items()}
        growth = max(after_warm) - rss_warm
        summary["criteria"] = {
            f"all {len(requests)} valid requests complete ({len(cancel)} of them cancelled on purpose)": summary["completed"] + summary["cancelled"] == len(requests),
            f"every bad line ({len(bad_at)}) gets one error event with its line": summary["bad_lines_answered_once"] == len(bad_at),
            "stats still answers": summary["stats_answered"] >= 3,  # warm-up, midway, end
            "exit 0 at end of input": exit_code == 0,
            f"RSS within 150 MiB of after warm-up (grew {growth / MiB:.1f} MiB)": growth <= RSS_LIMIT_BYTES,
            "no error event but for bad lines and late cancels": summary["other_error_events"] == 0,
            "stdout holds only JSON event lines": not client.not_json,
            "no KV blocks used at the end": last_stats["kv"]["blocks_used"] == 0,
        }
        summary["passed"] = all(summary["criteria"].values())
        if plot:
            plot_report(summary, client, warm_at, plot)
        return summary
    finally:
        if sampler is not None:
            sampler.stop()
        client.close()


def plot_report(summary: dict[str, Any], client: WorkerClient, warm_at: float, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_rss, ax_done, ax_lat) = plt.subplots(3, 1, figsize=(9, 10))
    t = [s[0] for s in summary["rss_samples"]]
    rss = [s[1] / MiB for s in summary["rss_samples"]]
    ax_rss.plot(t, rss, label="worker RSS")
    base = summary["rss_mib"]["after_warmup"]
    ax_rss.axhline(base, color="gray", ls="--", label=f"after warm-up ({base:.0f} MiB)")
    ax_rss.axhline(base + RSS_LIMIT_BYTES / MiB, color="red", ls=":", label="+150 MiB limit")
    ax_rss.axvline(warm_at, color="gray", lw=0.5)
    ax_rss.set(xlabel="seconds since start", ylabel="MiB", title=f"resident memory ({summary['mode']}, {summary['requests']} requests)")
    ax_rss.legend(fontsize=8)
    ends = sorted(v - client.started_at for k, v in client.ended_at.items() if not k.startswith("warmup"))
    ax_done.plot(ends, range(1, len(ends) + 1))
    ax_done.set(xlabel="seconds since start", ylabel="requests ended", title=f"{summary['tokens_per_second']} tok/s, {summary['requests_per_second']} req/s")
    completed = [
        k for k, e in client.terminal.items()
        if not k.startswith("warmup") and e.get("finish_reason") in ("length", "stop")
    ]
    ttft = sorted(client.first_token_at[k] - client.sent_at[k] for k in completed if k in client.first_token_at)
    total = sorted(client.ended_at[k] - client.sent_at[k] for k in completed)
    for values, label in ((ttft, "time to first token"), (total, "total")):
        if values:
            ax_lat.plot(values, [i / len(values) for i in range(1, len(values) + 1)], label=label)
    ax_lat.set(xlabel="seconds", ylabel="fraction of completed requests", title="latency CDF (completed requests)")
    ax_lat.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def run_bad_lines(model: str, *, num_bad: int, num_valid: int, seed: int, sets: Sequence[str], concurrency: int = 32) -> dict[str, Any]:
    summary = run(model, mode="bad-lines", num_requests=num_valid, num_bad=num_bad, concurrency=concurrency, cancel_fraction=0.0, seed=seed, sets=sets)
    print_report(summary)
    return summary


def print_report(summary: dict[str, Any]) -> None:
    keys = ("requests", "completed", "cancelled", "finish_reasons", "request_errors", "bad_lines", "bad_lines_answered_once", "late_cancels",
            "generated_tokens", "wall_seconds", "tokens_per_second", "requests_per_second", "ttft_seconds", "total_seconds", "rss_mib", "exit_code")
    for key in keys:
        print(f"{key:>24}: {summary[key]}")
    for when in ("memory_after_warmup", "memory_at_end"):
        memory = summary[when]
        print(f"{when:>24}: rss {memory['rss_bytes'] / MiB:.1f} MiB, KV resident {memory.get('kv_resident_bytes', 0) / MiB:.1f} MiB")
    for criterion, ok in summary["criteria"].items():
        print(f"{'PASS' if ok else 'FAIL'}  {criterion}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", help="model directory (default: the tiny-llama test model)")
    parser.add_argument("--mode", choices=("mixed", "bad-lines", "library"), default="mixed")
    parser.add_argument("--requests", type=int, default=2000, help="valid requests (bad-lines mode: 200 is the issue's check)")
    parser.add_argument("--bad", type=int, help="bad lines interleaved (default: 10%% of requests; bad-lines mode: 2000)")
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--cancel-fraction", type=float, default=0.05)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--set", dest="sets", action="append", default=[], metavar="STAGE.KEY=VALUE")
    parser.add_argument("--plot", help="write a PNG report here")
    parser.add_argument("--json", help="write the JSON summary here")
    parser.add_argument("--stderr", help="keep the worker's stderr in this file")
    parser.add_argument("--raising-processors", type=float, default=0.05, metavar="FRACTION",
                        help="library mode: this fraction of requests carry a logits processor that raises")
    parser.add_argument("--no-check", action="store_true", help="library mode: skip the mlx-lm token check")
    args = parser.parse_args(argv)
    model = args.model
    if model is None:
        from unikern.testing.modelgen import cached_model

        model = str(cached_model("tiny-llama"))
    if args.mode == "library":
        return _library(args, model)
    bad = args.bad if args.bad is not None else (2000 if args.mode == "bad-lines" else args.requests // 10)
    summary = run(
        model, mode=args.mode, num_requests=args.requests, num_bad=bad, concurrency=args.concurrency,
        cancel_fraction=args.cancel_fraction if args.mode == "mixed" else 0.0, seed=args.seed, sets=args.sets,
        plot=args.plot, stderr_path=Path(args.stderr) if args.stderr else None,
    )
    print_report(summary)
    if args.json:
        Path(args.json).write_text(json.dumps(summary, indent=1) + "\n")
    return 0 if summary["passed"] else 1


def _library(args: argparse.Namespace, model: str) -> int:
    summary = run_library(model, num_requests=args.requests, concurrency=args.concurrency,
                          raising_fraction=args.raising_processors, seed=args.seed, sets=args.sets,
                          check=not args.no_check)
    print_library_report(summary)
    if args.json:
        Path(args.json).write_text(json.dumps(summary, indent=1) + "\n")
    return 0 if summary["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
