"""The same streaming /v1/completions requests against `unikern serve`, `mlx_lm.server` and
llama.cpp's `llama-server` on one model and machine, interleaved in one run: throughput,
TTFT p50/p99 and ITL p50 at 1, 8 and 32 streams; JSON and PNG under tools/results/.

    python -m tools.bench.bench_http --model llama-5m --llama-server BUILD/bin/llama-server \\
        --convert-script LLAMA_CPP/convert_hf_to_gguf.py --rounds 5

For each level and round every server gets the same batch of greedy requests in turn (the
order rotates per round); the client is an async httpx loop in this process. Both MLX
servers run under the BLAS unikern preloads: a ratio across BLAS libraries would say
nothing about the servers. A peer that cannot start is reported; the others still run.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from tools.common.gguf import convert_to_gguf

ROOT = Path(__file__).resolve().parents[2]
MAX_ATTEMPTS = 5
RESULTS = ROOT / "tools" / "results"
BODY_TEXT = (
    "import os\nimport sys\n\n\ndef walk(root, pattern):\n    for dirpath, dirnames, filenames in os.walk(root):\n"
    "        for name in filenames:\n            if name.endswith(pattern):\n"
    "                yield os.path.join(dirpath, name)\n\n\nclass Counter:\n    def __init__(self):\n"
)
# preload unikern's BLAS choice, then run mlx_lm.server as `python -m` would
MLX_LM_SERVER = "import runpy, sys, unikern; sys.argv[0] = 'mlx_lm.server'; runpy.run_module('mlx_lm.server', run_name='__main__')"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class Server:
    name: str
    argv: list[str]
    port: int
    log: Path
    process: subprocess.Popen | None = None
    error: str | None = None
    results: dict[int, list[dict]] = field(default_factory=dict)
    retries: int = 0  # requests sent again after a dropped connection

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self, env: dict[str, str] | None = None) -> None:
        with self.log.open("w") as out:
            self.process = subprocess.Popen(self.argv, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env)

    def wait_ready(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                self.error = f"exited with {self.process.returncode}: {self.log.read_text()[-800:]}"
                return
            try:
                if httpx.get(f"{self.url}/health", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.25)
        self.error = f"not ready after {timeout_s:.0f} s"

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.process.kill()


def make_servers(args: argparse.Namespace, model: Path, gguf: Path | None, logs: Path) -> list[Server]:
    servers = [
        Server("unikern", [sys.executable, "-m", "unikern", "serve", "--model", str(model), "--port", "{port}",
                           "--drain-seconds", "0", *sum((["--set", s] for s in args.set), [])], 0, logs / "unikern.log"),
        Server("mlx_lm", [sys.executable, "-c", MLX_LM_SERVER, "--model", str(model), "--port", "{port}",
                          "--decode-concurrency", str(max(args.levels)), "--prompt-concurrency", "8",
                          "--log-level", "WARNING"], 0, logs / "mlx_lm.log"),
    ]
    if args.llama_server:
        slots = max(args.levels)
        context = slots * (args.prompt_tokens * 2 + args.max_tokens + 64)
        servers.append(Server("llama.cpp", [args.llama_server, "-m", str(gguf), "--port", "{port}", "--host", "127.0.0.1",
                                            "-t", str(args.threads), "-np", str(slots), "-c", str(context), "--no-webui"],
                              0, logs / "llama-server.log"))
    for server in servers:
        server.port = free_port()
        server.argv = [a.replace("{port}", str(server.port)) for a in server.argv]
    return servers


def prompts(n: int, prompt_tokens: int) -> list[str]:
    """Distinct prompts of about `prompt_tokens` tokens (a byte-level BPE on Python source)."""
    body = (BODY_TEXT * 8)[: prompt_tokens * 3]
    return [f"# request {i}\n{body}" for i in range(n)]


def full_length_prompts(model: Path, n: int, prompt_tokens: int, max_tokens: int) -> list[str]:
    """`n` prompts whose greedy continuation (mlx-lm's) reaches max_tokens without an
    end-of-sequence token, so every server generates the same number of tokens."""
    from mlx_lm import load

    from unikern.testing.reference import greedy_reference

    lm, tokenizer = load(str(model))
    chosen: list[str] = []
    for text in prompts(40 * n, prompt_tokens):
        if len(greedy_reference(lm, tokenizer, tokenizer.encode(text), max_tokens).tokens) == max_tokens:
            chosen.append(text)
            if len(chosen) == n:
                return chosen
    raise SystemExit(f"fewer than {n} of {40 * n} prompts run {max_tokens} tokens without an end of sequence")


async def one_request(client: httpx.AsyncClient, server: Server, prompt: str, max_tokens: int) -> dict:
    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0, "stream": True,
            "stream_options": {"include_usage": True}}
    sent = time.perf_counter()
    arrivals: list[float] = []
    usage_tokens = None
    for attempt in range(MAX_ATTEMPTS):
        try:
            async with client.stream("POST", f"{server.url}/v1/completions", json=body) as response:
                response.raise_for_status()
                async for line in response.aiter_lines():
                    if not line.startswith("data:") or line.strip() == "data: [DONE]":
                        continue
                    chunk = json.loads(line[5:])
                    if chunk.get("usage"):
                        usage_tokens = chunk["usage"].get("completion_tokens")
                    choices = chunk.get("choices") or []
                    if choices and choices[0].get("text"):
                        arrivals.append(time.perf_counter())
            break
        except (httpx.ConnectError, httpx.ReadError, httpx.RemoteProtocolError):
            # a full listen backlog (http.server's is 5) drops connections: retry, the
            # clock keeps running from the first attempt
            if arrivals or attempt == MAX_ATTEMPTS - 1:
                raise
            server.retries += 1
    if not arrivals:
        raise RuntimeError(f"{server.name}: a request produced no text")
    gaps = [b - a for a, b in zip(arrivals, arrivals[1:], strict=False)]
    return {"ttft_s": arrivals[0] - sent, "gaps_s": gaps, "tokens": usage_tokens or len(arrivals),
            "chunks": len(arrivals), "end_s": arrivals[-1] - sent}


async def run_batch(server: Server, texts: list[str], concurrency: int, max_tokens: int) -> dict:
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    async with httpx.AsyncClient(limits=limits, timeout=600) as client:
        gate = asyncio.Semaphore(concurrency)

        async def limited(text: str) -> dict:
            async with gate:
                return await one_request(client, server, text, max_tokens)

        start = time.perf_counter()
        results = await asyncio.gather(*(limited(t) for t in texts))
        wall = time.perf_counter() - start
    return {"wall_s": wall, "requests": results, "tokens": sum(r["tokens"] for r in results)}


def summarize(batches: list[dict]) -> dict:
    requests = [r for b in batches for r in b["requests"]]
    ttft = sorted(r["ttft_s"] for r in requests)
    gaps = sorted(g for r in requests for g in r["gaps_s"])
    per_round = [b["tokens"] / b["wall_s"] for b in batches]
    return {
        # the median round: other load on a shared machine comes in bursts
        "throughput_tok_s": statistics.median(per_round),
        "throughput_per_round": per_round,
        "ttft_p50_ms": 1000 * statistics.median(ttft),
        "ttft_p99_ms": 1000 * ttft[min(len(ttft) - 1, round(0.99 * (len(ttft) - 1)))],
        "itl_p50_ms": 1000 * statistics.median(gaps) if gaps else None,
        "requests": len(requests),
        "tokens": sum(b["tokens"] for b in batches),
        "tokens_per_chunk": sum(b["tokens"] for b in batches) / sum(r["chunks"] for r in requests),
    }


def plot(summary: dict, levels: list[int], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(summary)
    fig, axes = plt.subplots(1, 3, figsize=(14, 4))
    width = 0.8 / max(len(names), 1)
    for i, name in enumerate(names):
        xs = [j + i * width for j in range(len(levels))]
        for ax, key in zip(axes, ("throughput_tok_s", "ttft_p50_ms", "itl_p50_ms"), strict=False):
            ax.bar(xs, [summary[name][str(c)][key] or 0 for c in levels], width, label=name)
    for ax, label in zip(axes, ("output tokens/s (median round)", "TTFT p50 (ms)", "gap between text chunks p50 (ms)"), strict=False):
        ax.set_xticks([j + width * (len(names) - 1) / 2 for j in range(len(levels))], [f"{c} streams" for c in levels])
        ax.set_ylabel(label)
    axes[0].legend()
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="llama-5m", help="a unikern.testing.modelgen preset or a model directory")
    parser.add_argument("--gguf", help="the model as GGUF for llama-server (default: converted with --convert-script)")
    parser.add_argument("--llama-server", help="path of a llama-server binary (omit to skip llama.cpp)")
    parser.add_argument("--convert-script", help="llama.cpp's convert_hf_to_gguf.py")
    parser.add_argument("--levels", default="1,8,32", help="concurrent streams, comma-separated")
    parser.add_argument("--requests-per-stream", type=int, default=2, help="requests per stream in each batch")
    parser.add_argument("--rounds", type=int, default=2, help="timed batches per server and level")
    parser.add_argument("--prompt-tokens", type=int, default=64)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 2, help="llama-server threads")
    parser.add_argument("--set", action="append", default=[], metavar="STAGE.KEY=VALUE", help="passed to unikern serve")
    args = parser.parse_args()
    args.levels = [int(x) for x in args.levels.split(",")]

    model = Path(args.model)
    if not model.is_dir():
        from unikern.testing.modelgen import cached_model

        model = cached_model(args.model)
    gguf = Path(args.gguf) if args.gguf else None
    if args.llama_server and gguf is None:
        if not args.convert_script:
            parser.error("--llama-server needs --gguf or --convert-script")
        gguf = convert_to_gguf(model, Path(args.convert_script), Path(tempfile.gettempdir()) / f"{model.name}-f32.gguf")

    pool = full_length_prompts(model, max(args.levels) * args.requests_per_stream, args.prompt_tokens, args.max_tokens)
    logs = Path(tempfile.mkdtemp(prefix="bench_http-"))
    servers = make_servers(args, model, gguf, logs)
    for server in servers:
        server.start(env={**os.environ, "TOKENIZERS_PARALLELISM": "false"})
    try:
        for server in servers:
            server.wait_ready(timeout_s=300)
            if server.error:
                print(f"{server.name} could not start: {server.error}", file=sys.stderr)
        live = [s for s in servers if s.error is None]
        for server in live:  # warm-up: loads, first kernels, the largest batch shape once
            asyncio.run(run_batch(server, prompts(max(args.levels), args.prompt_tokens), max(args.levels), 8))
        for level in args.levels:
            texts = pool[: level * args.requests_per_stream]
            for round_ in range(args.rounds):
                order = live[round_ % len(live):] + live[: round_ % len(live)]
                for server in order:
                    batch = asyncio.run(run_batch(server, texts, level, args.max_tokens))
                    server.results.setdefault(level, []).append(batch)
                    print(f"c={level:>2} round {round_} {server.name:>9}: {batch['tokens'] / batch['wall_s']:8.1f} tok/s",
                          file=sys.stderr)
    finally:
        for server in servers:
            server.stop()

    summary = {s.name: {str(c): summarize(s.results[c]) for c in args.levels} for s in live}
    for levels in summary.values():  # each round's ratio: both servers saw the same minute
        for c in args.levels:
            base = summary.get("mlx_lm", {}).get(str(c))
            if base:
                ratios = [a / b for a, b in zip(levels[str(c)]["throughput_per_round"], base["throughput_per_round"], strict=False)]
                levels[str(c)]["vs_mlx_lm_per_round"] = ratios
    print(f"\nmodel {args.model}, {args.prompt_tokens}-token prompts (about), {args.max_tokens} tokens each, greedy, "
          f"{args.rounds} rounds x {args.requests_per_stream} requests per stream, interleaved; tok/s: the median round")
    print("ITL: the gap between streamed chunks that carry text; tok/chunk: tokens per such chunk")
    print(f"{'server':>10} {'streams':>7} {'tok/s':>9} {'TTFT p50':>9} {'TTFT p99':>9} {'ITL p50':>8} {'tok/chunk':>9} "
          f"{'vs mlx_lm (rounds)':>24}")
    for name, levels in summary.items():
        for c in args.levels:
            row = levels[str(c)]
            ratios = row.get("vs_mlx_lm_per_round")
            ratio = f"{statistics.median(ratios):.2f}x ({min(ratios):.2f}-{max(ratios):.2f})" if ratios else "-"
            itl = f"{row['itl_p50_ms']:.1f}" if row["itl_p50_ms"] is not None else "-"
            print(f"{name:>10} {c:>7} {row['throughput_tok_s']:>9.1f} {row['ttft_p50_ms']:>7.1f}ms {row['ttft_p99_ms']:>7.1f}ms "
                  f"{itl:>6}ms {row['tokens_per_chunk']:>9.2f} {ratio:>24}")
    for server in servers:
        if server.error:
            print(f"{server.name}: not measured ({server.error.splitlines()[0]})")

    RESULTS.mkdir(parents=True, exist_ok=True)
    stem = RESULTS / f"bench-http-{Path(args.model).name}-{platform.machine()}"
    record = {
        "model": args.model, "levels": args.levels, "rounds": args.rounds,
        "requests_per_stream": args.requests_per_stream, "prompt_tokens": args.prompt_tokens,
        "max_tokens": args.max_tokens, "cpus": os.cpu_count(), "machine": platform.platform(),
        "servers": {s.name: s.argv for s in servers}, "retries": {s.name: s.retries for s in servers}, "errors": {s.name: s.error for s in servers if s.error},
        "summary": summary, "measured": time.strftime("%Y-%m-%d %H:%M"),
    }
    stem.with_suffix(".json").write_text(json.dumps(record, indent=2) + "\n")
    plot(summary, args.levels, stem.with_suffix(".png"), f"HTTP serving, {args.model}, {os.cpu_count()} CPUs")
    print(f"wrote {stem}.json and .png")
    return 0


if __name__ == "__main__":
    sys.exit(main())
