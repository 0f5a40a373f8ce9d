"""The same streaming chat completions against `unikern serve`, `mlx_lm.server`, llama.cpp's
`llama-server` and unikern's library (an in-process Engine, in a child process) on one
model and machine, interleaved: per round output tok/s, TTFT and inter-chunk gap p50/p99,
at 1, 16 and 64 streams, with and without a shared system prompt, all at once or
arriving at random; every round kept; JSON and PNG under tools/results/.

    python -m tools.bench.bench_http --model llama-5m --levels 1,16,64 --rounds 3 [--stagger-ms 20] \
        [--llama-server PATH --convert-script <llama.cpp>/convert_hf_to_gguf.py] [--stand-in GPU_MS,HOST_US]

For each phase, level and round every peer gets the same batch of greedy requests in turn
(the order rotates per round); the HTTP clients run in this process and in helper processes,
the library peer is a child process running an Engine, sent each batch as one JSON line.
Both MLX servers run under the BLAS unikern preloads: a ratio across BLAS libraries would
say nothing about the servers. A peer that cannot start is reported; the others still run.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import random
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
SYSTEM_TEXT = (
    "You are a careful reviewer of Python code. Read the request, then answer with code only. "
    "Keep names short, follow PEP 8, and prefer the standard library. "
)
# preload unikern's BLAS choice, then run mlx_lm.server as `python -m` would
MLX_LM_SERVER = "import runpy, sys, unikern; sys.argv[0] = 'mlx_lm.server'; runpy.run_module('mlx_lm.server', run_name='__main__')"
LIBRARY = "library"  # the peer that runs unikern.Engine in a child process
SERVE_CHILD = "--serve-child"  # argv[1] of `unikern serve` run through this file (a stand-in model)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class Peer:
    name: str
    argv: list[str]
    port: int
    log: Path
    process: subprocess.Popen | None = None
    error: str | None = None
    results: dict[str, list[dict]] = field(default_factory=dict)  # "phase/streams" -> batches
    retries: int = 0  # requests sent again after a dropped connection
    startup: dict | None = None  # the library peer's Engine.startup

    def log_tail(self, chars: int = 1500) -> str:
        try:
            return self.log.read_text(errors="replace")[-chars:]
        except OSError:
            return ""

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self, env: dict[str, str]) -> None:
        with self.log.open("w") as out:
            pipes = {"stdin": subprocess.PIPE, "stdout": subprocess.PIPE} if self.name == LIBRARY else \
                {"stdin": subprocess.DEVNULL, "stdout": out}
            self.process = subprocess.Popen(self.argv, stderr=out if self.name == LIBRARY else subprocess.STDOUT,
                                            env=env, text=self.name == LIBRARY, cwd=ROOT, **pipes)

    def wait_ready(self, timeout_s: float) -> None:
        if self.name == LIBRARY:  # its first line says ready (or it exits)
            line = self.process.stdout.readline()
            if not line:
                self.error = f"exited with {self.process.wait()}: {self.log_tail(800)}"
            else:
                self.startup = json.loads(line).get("startup")
            return
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                self.error = f"exited with {self.process.returncode}: {self.log_tail(800)}"
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
            if self.name == LIBRARY:
                self.process.stdin.close()
            else:
                self.process.terminate()
            try:
                self.process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.process.kill()


def make_peers(args: argparse.Namespace, model: Path, gguf: Path | None, logs: Path) -> list[Peer]:
    sets = sum((["--set", s] for s in args.set), [])
    top = max(args.levels)
    this = ["-m", "tools.bench.bench_http"]  # run from the repository root (Peer's cwd)
    serve = [sys.executable, *this, SERVE_CHILD, args.stand_in] if args.stand_in else [sys.executable, "-m", "unikern"]
    stand_in = ["--stand-in", args.stand_in] if args.stand_in else []
    peers = [
        Peer("unikern", [*serve, "serve", "--model", str(model), "--port", "{port}", "--drain-seconds", "0", *sets],
             0, logs / "unikern.log"),
        Peer(LIBRARY, [sys.executable, *this, "--library-child", "--model", str(model), *stand_in, *sets],
             0, logs / "library.log"),
        Peer("mlx_lm", [sys.executable, "-c", MLX_LM_SERVER, "--model", str(model), "--port", "{port}",
                        "--decode-concurrency", str(top), "--prompt-concurrency", "8",
                        "--log-level", "WARNING"], 0, logs / "mlx_lm.log"),
    ]
    if args.llama_server:
        context = top * (args.prompt_tokens * 2 + args.system_tokens * 2 + args.max_tokens + 64)
        peers.append(Peer("llama.cpp", [args.llama_server, "-m", str(gguf), "--port", "{port}", "--host", "127.0.0.1",
                                        "-t", str(args.threads), "-np", str(top), "-c", str(context), "--no-webui",
                                        "--jinja", "-ngl", "all", "--cache-reuse", "256"], 0, logs / "llama-server.log"))
    # a stand-in model makes no tokens of the model's own: the other servers have nothing to match
    peers = [p for p in peers if p.name in args.peers and (not args.stand_in or p.name in ("unikern", LIBRARY))]
    for peer in peers:
        peer.port = free_port()
        peer.argv = [a.replace("{port}", str(peer.port)) for a in peer.argv]
    return peers


# ---- the workload -----------------------------------------------------------------------


def user_texts(n: int, prompt_tokens: int, salt: str = "") -> list[str]:
    """Distinct user messages of about `prompt_tokens` tokens (a byte-level BPE on Python source)."""
    body = (BODY_TEXT * 8)[: prompt_tokens * 3]
    return [f"# request {salt}{i}\n{body}" for i in range(n)]


def system_text(tokens: int) -> str:
    """A system prompt of about `tokens` tokens, the same for every request of the phase."""
    text = SYSTEM_TEXT
    while len(text) < tokens * 3:
        text += BODY_TEXT
    return text[: tokens * 3]


def conversations(phase: str, n: int, args: argparse.Namespace, salt: str = "") -> list[list[dict]]:
    system = [{"role": "system", "content": system_text(args.system_tokens)}] if phase == "system" else []
    return [system + [{"role": "user", "content": text}] for text in user_texts(n, args.prompt_tokens, salt)]


def stream_starts(streams: int, stagger_ms: float, seed: int) -> list[float]:
    """When each stream sends its first request (seconds after the batch starts): all at
    0, or arrivals of a Poisson process with `stagger_ms` between them on average."""
    if stagger_ms <= 0:
        return [0.0] * streams
    rng = random.Random(seed)
    starts, t = [], 0.0
    for _ in range(streams):
        starts.append(t)
        t += rng.expovariate(1000.0 / stagger_ms)
    return starts


# ---- one batch: HTTP or library ----------------------------------------------------------


async def one_http(client: httpx.AsyncClient, url: str, messages: list[dict], max_tokens: int,
                   retried: list[int]) -> dict:
    body = {"messages": messages, "max_tokens": max_tokens, "temperature": 0.0, "stream": True,
            "stream_options": {"include_usage": True}}
    sent = time.perf_counter()
    arrivals: list[float] = []
    usage_tokens = None
    for attempt in range(MAX_ATTEMPTS):
        try:
            async with client.stream("POST", f"{url}/v1/chat/completions", json=body) as response:
                if response.status_code >= 400:  # its body says why; an exception the client
                    # processes can hand back (httpx's own cannot be pickled: the pool hung on one)
                    text = (await response.aread()).decode(errors="replace")
                    raise RuntimeError(f"{url}: HTTP {response.status_code}: {text[:500]}")
                pending = b""
                # raw bytes split by hand: httpx's aiter_lines cost this client ~150 us of
                # CPU per token at 64 streams, more than the server's own work
                async for data in response.aiter_raw():
                    now = time.perf_counter()
                    *lines, pending = (pending + data).split(b"\n")
                    for line in lines:
                        line = line.strip()
                        if not line.startswith(b"data:") or line.endswith(b"[DONE]"):
                            continue
                        chunk = json.loads(line[5:])
                        if chunk.get("usage"):
                            usage_tokens = chunk["usage"].get("completion_tokens")
                        choices = chunk.get("choices") or []
                        if choices and (choices[0].get("delta") or {}).get("content"):
                            arrivals.append(now)
            break
        except (httpx.ConnectError, httpx.ReadError, httpx.RemoteProtocolError):
            # a full listen backlog (http.server's is 5) drops connections: retry, the
            # clock keeps running from the first attempt
            if arrivals or attempt == MAX_ATTEMPTS - 1:
                raise
            retried[0] += 1
    if not arrivals:
        raise RuntimeError(f"{url}: a request produced no text")
    return timing(sent, arrivals, usage_tokens or len(arrivals))


def timing(sent: float, arrivals: list[float], tokens: int) -> dict:
    gaps = [b - a for a, b in zip(arrivals, arrivals[1:], strict=False)]
    return {"ttft_s": arrivals[0] - sent, "gaps_s": gaps, "tokens": tokens, "chunks": len(arrivals),
            "end_s": arrivals[-1] - sent}


async def run_streams(send, shares: list[list[list[dict]]], starts: list[float], begin: float) -> dict:
    """One stream per share, each sending its conversations one after another, stream i
    from `begin` + starts[i] on (`begin`: time.time(), shared by the client processes);
    `send(messages)` runs one request and returns its timing."""

    async def stream(i: int) -> list[dict]:
        await asyncio.sleep(max(0.0, begin + starts[i] - time.time()))
        return [await send(messages) for messages in shares[i]]

    results = [r for rs in await asyncio.gather(*(stream(i) for i in range(len(shares)))) for r in rs]
    return {"requests": results, "end": time.time()}


def split_streams(batch: dict) -> tuple[list[list[list[dict]]], list[float]]:
    streams = batch["streams"]
    return [batch["conversations"][i::streams] for i in range(streams)], batch["starts"]


def client_part(url: str, shares: list, starts: list[float], max_tokens: int, begin: float) -> dict:
    """Some of a batch's streams, in a client process of their own."""

    async def part() -> dict:
        # a client (one connection) per stream: httpx's pool looks over every connection
        # for every request it places, which at 64 streams was most of this client's CPU;
        # no certificates to load (plain http), 25 ms a client on this machine
        retried = [0]
        clients = [httpx.AsyncClient(limits=httpx.Limits(max_connections=1), timeout=600, verify=False) for _ in shares]

        async def stream(i: int) -> list[dict]:
            await asyncio.sleep(max(0.0, begin + starts[i] - time.time()))
            return [await one_http(clients[i], url, msgs, max_tokens, retried) for msgs in shares[i]]

        try:
            results = await asyncio.gather(*(stream(i) for i in range(len(shares))))
        finally:
            for client in clients:
                await client.aclose()
        return {"requests": [r for rs in results for r in rs], "end": time.time(), "retries": retried[0]}

    return asyncio.run(part())


class Clients:
    """The HTTP client: processes that each run some of a batch's streams on an event loop
    of their own, so that the client's parsing is not what paces a fast server."""

    def __init__(self, processes: int) -> None:
        import multiprocessing

        self.processes = processes
        self.pool = multiprocessing.get_context("spawn").Pool(processes) if processes > 1 else None

    def run(self, peer: Peer, batch: dict) -> dict:
        shares, starts = split_streams(batch)
        n = min(self.processes, len(shares))
        begin = time.time() + (0.3 if n > 1 else 0.0)  # every process under way before the first send
        parts = [(peer.url, shares[k::n], starts[k::n], batch["max_tokens"], begin) for k in range(n)]
        done = self.pool.starmap(client_part, parts) if n > 1 else [client_part(*parts[0])]
        peer.retries += sum(d["retries"] for d in done)
        requests = [r for d in done for r in d["requests"]]
        return {"wall_s": max(d["end"] for d in done) - begin, "requests": requests,
                "tokens": sum(r["tokens"] for r in requests)}

    def close(self) -> None:
        if self.pool is not None:
            self.pool.terminate()


def run_batch(peer: Peer, batch: dict, clients: Clients) -> dict:
    if peer.name != LIBRARY:
        return clients.run(peer, batch)
    peer.process.stdin.write(json.dumps(batch) + "\n")
    peer.process.stdin.flush()
    line = peer.process.stdout.readline()
    if not line:
        raise RuntimeError(f"the library child exited: {peer.log.read_text()[-800:]}")
    return json.loads(line)


def install_stand_in(setting: str, model: str) -> None:
    """Every step of the engine's runner replaced by a fixed cost: `GPU_MS,HOST_US` (a GIL-free
    wait, Python holding the GIL), as tools/host_bound.py's, and a token per row and step that
    is nobody's end of sequence. The rest (scheduler, detokenizer, delivery, HTTP) is real:
    what the host does at a GPU's step rate, on this machine."""
    from unikern import messages as m
    from unikern.stages.execute.runner import ModelRunner
    from unikern.stages.models import resolve_model_path

    gpu_ms, host_us = (float(x) for x in setting.split(","))
    vocab = json.loads((resolve_model_path(model) / "config.json").read_text())["vocab_size"]

    class Computed:
        """A step's tokens, there once the step's GPU time has passed (as an MLX array's
        `tolist` waits for its step): what the runner's window reader reads step by step."""

        def __init__(self, tokens: list[int]) -> None:
            self.tokens, self.waited = tokens, False

        def tolist(self) -> list[int]:
            if not self.waited:
                time.sleep(gpu_ms / 1e3)
                self.waited = True
            return self.tokens

    def execute(self, step: m.Step, seeds: dict[str, int]) -> m.StepDone:
        rows = [w for w in step.work if w.sample]
        tokens = {w.request_id: [5 + (hash(w.request_id) + w.num_generated + i) % (vocab - 10)
                                 for i in range(step.num_steps)] for w in rows}
        for _ in range(step.num_steps):  # the steps' graphs, then the device's time step by step
            end = time.thread_time() + host_us / 1e6
            while time.thread_time() < end:
                pass
        steps = [Computed([tokens[w.request_id][i] for w in rows]) for i in range(step.num_steps)]
        reader = self.window_stream.reader(step.step_id, [w.request_id for w in rows]) if self.window_stream else None
        if reader is not None:
            reader.read_to(steps, step.num_steps - 1)
        for computed in steps:
            computed.tolist()
        return m.StepDone(step.step_id, tokens)

    ModelRunner.execute = execute


def serve_child(argv: list[str]) -> int:
    """`unikern serve` with a stand-in model: argv is [setting, "serve", ...]."""
    from unikern.frontends.cli import leave, main

    install_stand_in(argv[0], argv[argv.index("--model") + 1])
    leave(main(argv[1:]))
    return 0


def library_child(args: argparse.Namespace) -> int:
    """The library peer: an Engine with the server's settings; one batch per stdin line,
    its result as one stdout line."""
    from unikern.engine import Engine
    from unikern.frontends.logs import configure
    from unikern.spec import load_pipeline, parse_overrides

    configure("warning")  # to stderr: stdout carries the results
    if args.stand_in:
        install_stand_in(args.stand_in, args.model)
    spec = load_pipeline("generate", model=args.model, overrides=parse_overrides(args.set))

    async def serve() -> None:
        async with Engine(spec) as engine:
            print(json.dumps({"ready": True, "startup": engine.startup}), flush=True)
            loop = asyncio.get_running_loop()
            while line := await loop.run_in_executor(None, sys.stdin.readline):
                batch = json.loads(line)

                async def send(messages: list[dict], batch=batch) -> dict:
                    sent, arrivals, tokens, last = time.perf_counter(), [], 0, None
                    async for event in engine.generate(messages=messages, max_tokens=batch["max_tokens"],
                                                       temperature=0.0):
                        last = event
                        if getattr(event, "token_id", None) is not None:
                            arrivals.append(time.perf_counter())
                            tokens += 1
                    if not arrivals:  # (an error event, say: its code and message are the reason)
                        raise RuntimeError(f"the library: a request produced no tokens; its last event: {last!r}")
                    return timing(sent, arrivals, tokens)

                shares, starts = split_streams(batch)
                begin = time.time()
                result = await run_streams(send, shares, starts, begin)
                requests = result["requests"]
                print(json.dumps({"wall_s": result["end"] - begin, "requests": requests,
                                  "tokens": sum(r["tokens"] for r in requests)}), flush=True)

    asyncio.run(serve())
    return 0


# ---- figures ----------------------------------------------------------------------------


def percentile(values: list[float], q: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, round(q * (len(values) - 1)))]


def round_figures(batch: dict) -> dict:
    requests = batch["requests"]
    ttft = [r["ttft_s"] for r in requests]
    gaps = [g for r in requests for g in r["gaps_s"]]
    return {
        "tok_s": batch["tokens"] / batch["wall_s"],
        "ttft_p50_ms": 1000 * percentile(ttft, 0.5), "ttft_p99_ms": 1000 * percentile(ttft, 0.99),
        "itl_p50_ms": 1000 * percentile(gaps, 0.5) if gaps else None,
        "itl_p99_ms": 1000 * percentile(gaps, 0.99) if gaps else None,
        "tokens": batch["tokens"], "tokens_per_chunk": batch["tokens"] / sum(r["chunks"] for r in requests),
    }


def summarize(batches: list[dict]) -> dict:
    rounds = [round_figures(b) for b in batches]
    every = [r for b in batches for r in b["requests"]]
    gaps = [g for r in every for g in r["gaps_s"]]
    ttft = [r["ttft_s"] for r in every]
    return {
        # the median round: other load on a shared machine comes in bursts
        "throughput_tok_s": statistics.median(r["tok_s"] for r in rounds),
        "ttft_p50_ms": 1000 * percentile(ttft, 0.5), "ttft_p99_ms": 1000 * percentile(ttft, 0.99),
        "itl_p50_ms": 1000 * percentile(gaps, 0.5) if gaps else None,
        "itl_p99_ms": 1000 * percentile(gaps, 0.99) if gaps else None,
        "tokens_per_chunk": sum(b["tokens"] for b in batches) / sum(r["chunks"] for r in every),
        "rounds": rounds,
    }


def ratios(summary: dict, keys: list[str]) -> dict:
    """unikern's per-round tok/s over each other peer's, paired by round (both saw the
    same minute): median, min and max per key."""
    out: dict = {}
    ours = summary.get("unikern", {})
    for other, figures in summary.items():
        if other == "unikern":
            continue
        for key in keys:
            if key in ours and key in figures:
                pairs = [a["tok_s"] / b["tok_s"] for a, b in zip(ours[key]["rounds"], figures[key]["rounds"], strict=False)]
                out.setdefault(other, {})[key] = {"median": statistics.median(pairs), "min": min(pairs), "max": max(pairs)}
    return out


def plot(summary: dict, keys: list[str], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(summary)
    fig, axes = plt.subplots(2, 2, figsize=(15, 8))
    width = 0.8 / max(len(names), 1)
    panels = (("throughput_tok_s", "output tokens/s (median round)"), ("ttft_p99_ms", "TTFT p99 (ms, log)"),
              ("itl_p50_ms", "gap between text chunks p50 (ms)"))
    for (key, label), ax in zip(panels, axes.flat, strict=False):
        for i, name in enumerate(names):
            xs = [j + i * width for j in range(len(keys))]
            ax.bar(xs, [summary[name].get(k, {}).get(key) or 0 for k in keys], width, label=name)
        ax.set_xticks([j + width * (len(names) - 1) / 2 for j in range(len(keys))], keys, rotation=20, fontsize=8)
        ax.set_ylabel(label)
        if key == "ttft_p99_ms":
            ax.set_yscale("log")
    ax = axes.flat[3]  # every round: a stall in the first one, or a fall across them, shows
    base = "unikern" if "unikern" in summary else names[0]
    for i, name in enumerate(names):
        for j, k in enumerate(keys):
            rounds = summary[name].get(k, {}).get("rounds", [])
            if not rounds or k not in summary[base]:
                continue
            xs = [j + (r + 0.5) / (len(rounds) + 1) for r in range(len(rounds))]
            ys = [r["tok_s"] / max(1e-9, summary[base][k]["throughput_tok_s"]) for r in rounds]
            ax.plot(xs, ys, "o-", color=f"C{i}", markersize=3)
    ax.set_xticks(range(len(keys)), keys, rotation=20, fontsize=8, ha="left")
    ax.set_ylabel(f"each round's tok/s / {base}'s median round")
    axes.flat[0].legend()
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


# ---- the run ----------------------------------------------------------------------------


def main() -> int:
    if sys.argv[1:2] == [SERVE_CHILD]:
        return serve_child(sys.argv[2:])
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="llama-5m", help="a unikern.testing.modelgen preset or a model directory")
    parser.add_argument("--gguf", help="the model as GGUF for llama-server (default: converted with --convert-script)")
    parser.add_argument("--llama-server", help="path of a llama-server binary (omit to skip llama.cpp)")
    parser.add_argument("--convert-script", help="llama.cpp's convert_hf_to_gguf.py")
    parser.add_argument("--peers", default="unikern,library,mlx_lm,llama.cpp", help="which to run, comma-separated")
    parser.add_argument("--levels", default="1,16,64", help="concurrent streams, comma-separated")
    parser.add_argument("--phases", default="plain,system",
                        help="plain: a user message alone; system: a shared system prompt before it (prefix cache)")
    parser.add_argument("--requests-per-stream", type=int, default=2, help="requests per stream in each batch")
    parser.add_argument("--rounds", type=int, default=3, help="timed batches per peer, phase and level")
    parser.add_argument("--prompt-tokens", type=int, default=64, help="user message, about")
    parser.add_argument("--system-tokens", type=int, default=1000, help="the system phase's shared prompt, about")
    parser.add_argument("--max-tokens", type=int, default=256)
    parser.add_argument("--stagger-ms", type=float, default=0.0,
                        help="streams start at random (exponential gaps of this mean, seeded per round); 0: all at once")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 2, help="llama-server threads")
    parser.add_argument("--set", action="append", default=[], metavar="STAGE.KEY=VALUE",
                        help="passed to unikern serve and the library peer")
    parser.add_argument("--tag", default="", help="added to the output files' names")
    parser.add_argument("--client-processes", type=int, default=max(1, min(8, (os.cpu_count() or 2) // 2)),
                        help="HTTP client processes a batch's streams are spread over")
    parser.add_argument("--stand-in", metavar="GPU_MS,HOST_US",
                        help="unikern (serve and library) on a stand-in model of this cost per step, e.g. 2.6,300 "
                             "(an H200's 1B step at 64 rows): the host's work at a GPU's pace; other peers skipped")
    parser.add_argument("--library-child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.library_child:
        return library_child(args)
    args.levels = [int(x) for x in args.levels.split(",")]
    args.phases = args.phases.split(",")
    args.peers = args.peers.split(",")

    model = Path(args.model)
    if not model.is_dir():
        from unikern.testing.modelgen import cached_model

        model = cached_model(args.model)
    gguf = Path(args.gguf) if args.gguf else None
    if args.llama_server and gguf is None:
        if not args.convert_script:
            parser.error("--llama-server needs --gguf or --convert-script")
        gguf = convert_to_gguf(model, Path(args.convert_script), Path(tempfile.gettempdir()) / f"{model.name}-f32.gguf")

    logs = Path(tempfile.mkdtemp(prefix="bench_http-"))
    peers = make_peers(args, model, gguf, logs)
    env = {**os.environ, "TOKENIZERS_PARALLELISM": "false"}
    for peer in peers:
        peer.start(env)
    clients = Clients(args.client_processes)
    keys = [f"{phase}/{c}" for phase in args.phases for c in args.levels]
    try:
        for peer in peers:
            peer.wait_ready(timeout_s=600)
            if peer.error:
                print(f"{peer.name} could not start: {peer.error}", file=sys.stderr)
        live = [p for p in peers if p.error is None]
        top = max(args.levels)
        warm = {"conversations": conversations("plain", top, args, "warm-"), "streams": top, "max_tokens": 8,
                "starts": [0.0] * top}

        def attempt(peer: Peer, batch: dict, what: str) -> dict | None:
            """The batch's result; a failure ends this peer's runs (kept in its error), not the others'."""
            try:
                return run_batch(peer, batch, clients)
            except Exception as exc:  # noqa: BLE001
                peer.error = f"{what}: {exc}; its log ends: {peer.log_tail()}"
                print(f"{peer.name} failed at {what}: {exc}", file=sys.stderr)
                return None

        for peer in live:  # one warm-up round: loads, first kernels, the largest batch once
            attempt(peer, warm, "the warm-up round")
        for phase in args.phases:
            for level in args.levels:
                batch = {"conversations": conversations(phase, level * args.requests_per_stream, args),
                         "streams": level, "max_tokens": args.max_tokens}
                for round_ in range(args.rounds):
                    batch["starts"] = stream_starts(level, args.stagger_ms, args.seed + round_)
                    order = live[round_ % len(live):] + live[: round_ % len(live)]
                    for peer in [p for p in order if p.error is None]:
                        result = attempt(peer, batch, f"{phase}/{level} round {round_}")
                        if result is None:
                            continue
                        peer.results.setdefault(f"{phase}/{level}", []).append(result)
                        f = round_figures(result)
                        print(f"{phase:>6} c={level:>2} round {round_} {peer.name:>9}: {f['tok_s']:8.1f} tok/s  "
                              f"TTFT p50 {f['ttft_p50_ms']:7.1f} p99 {f['ttft_p99_ms']:7.1f} ms", file=sys.stderr)
    finally:
        clients.close()
        for peer in peers:
            peer.stop()

    summary = {p.name: {k: summarize(p.results[k]) for k in keys if k in p.results} for p in live}
    versus = ratios(summary, keys)
    arrival = f"streams starting {args.stagger_ms:g} ms apart on average (seeded)" if args.stagger_ms else "all at once"
    print(f"\nmodel {args.model}: chat, user messages of about {args.prompt_tokens} tokens (system phase: a shared "
          f"{args.system_tokens}-token system prompt first), {args.max_tokens} tokens each, greedy; {args.rounds} rounds x "
          f"{args.requests_per_stream} requests per stream, {arrival}, interleaved; tok/s: the median round")
    print("ITL: the gap between streamed chunks that carry text; tok/chunk: tokens per such chunk")
    print(f"{'peer':>10} {'phase/streams':>14} {'tok/s':>9} {'TTFT p50':>9} {'TTFT p99':>9} {'ITL p50':>8} "
          f"{'ITL p99':>8} {'tok/chunk':>9}  tok/s per round")
    for name, figures in summary.items():
        for key in keys:
            if key not in figures:
                continue
            row = figures[key]

            def ms(v):
                return f"{v:6.1f}ms" if v is not None else "     -  "

            per_round = " ".join(f"{r['tok_s']:.0f}" for r in row["rounds"])
            print(f"{name:>10} {key:>14} {row['throughput_tok_s']:>9.1f} {row['ttft_p50_ms']:>7.1f}ms "
                  f"{row['ttft_p99_ms']:>7.1f}ms {ms(row['itl_p50_ms'])} {ms(row['itl_p99_ms'])} "
                  f"{row['tokens_per_chunk']:>9.2f}  {per_round}")
    print("\nunikern serve's tok/s over each other peer's, paired by round: median (min-max)")
    for other, by_key in versus.items():
        cells = "  ".join(f"{k} {v['median']:.2f}x ({v['min']:.2f}-{v['max']:.2f})" for k, v in by_key.items())
        print(f"  vs {other:>9}: {cells}")
    if LIBRARY in versus:
        print("  (vs library: HTTP over the library path, the same Engine in one process)")
    for peer in peers:
        if peer.error:
            print(f"{peer.name}: not measured ({peer.error.splitlines()[0]})")

    RESULTS.mkdir(parents=True, exist_ok=True)
    stem = RESULTS / f"bench-http-{Path(args.model).name}-{platform.machine()}{args.tag}"
    record = {
        "model": args.model, "levels": args.levels, "phases": args.phases, "rounds": args.rounds,
        "requests_per_stream": args.requests_per_stream, "prompt_tokens": args.prompt_tokens,
        "system_tokens": args.system_tokens, "max_tokens": args.max_tokens, "stagger_ms": args.stagger_ms,
        "seed": args.seed, "client_processes": args.client_processes, "sets": args.set, "stand_in": args.stand_in, "cpus": os.cpu_count(), "machine": platform.platform(),
        "peers": {p.name: p.argv for p in peers}, "retries": {p.name: p.retries for p in peers},
        "errors": {p.name: p.error for p in peers if p.error},
        "library_startup": next((p.startup for p in peers if p.name == LIBRARY), None),
        "summary": summary, "unikern_over": versus, "measured": time.strftime("%Y-%m-%d %H:%M"),
        "command": " ".join(sys.argv),
    }
    stem.with_suffix(".json").write_text(json.dumps(record, indent=1) + "\n")
    plot(summary, keys, stem.with_suffix(".png"),
         f"HTTP serving, {args.model}{f' (stand-in {args.stand_in})' if args.stand_in else ''}, {os.cpu_count()} CPUs, "
         f"{arrival}, {args.max_tokens} tokens")
    print(f"wrote {stem}.json and .png")
    return 0


if __name__ == "__main__":
    sys.exit(main())
