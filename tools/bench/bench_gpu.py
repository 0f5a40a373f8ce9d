"""unikern, mlx-lm and llama.cpp side by side on one GPU, on the same weights (issue 17).

Three subcommands, run in this order on the GPU machine:

    python -m tools.bench.bench_gpu models --out DIR [--shapes 1b 8b]
        random Llama weights written by MLX (HF layout, modelgen's tokenizer): DIR/llama-1b
        in bfloat16, DIR/llama-8b in bfloat16 and DIR/llama-8b-q4 from `mlx_lm convert -q`
    python -m tools.bench.bench_gpu gguf --out DIR --llama-cpp SRC --llama-bin BIN
        the same weights as GGUF through llama.cpp's own converter: llama-1b bf16, and
        llama-8b quantized to Q4_0 by llama-quantize
    python -m tools.bench.bench_gpu bench --model DIR/llama-1b --gguf DIR/llama-1b.gguf --llama-bin BIN --json OUT

`bench` runs, for every repeat, each concurrency level through mlx-lm (stream_generate at
1, batch_generate above) and through a unikern Engine, one after the other, then every
level through one llama-batched-bench process. All three get prompts of the same length
and generate the same number of tokens, greedy; tok/s is generated tokens over wall time
(prompt processing included); TTFT is the first token's delay (for llama.cpp its batch's
prompt time; mlx-lm's batch_generate reports none). The table gives medians over the
repeats, min-max, and unikern's ratios to each peer. `--isolate` runs mlx-lm in a
process of its own (MlxLmWorker), so that the benchmark's process holds the unikern
engine alone; `--split` times unikern's steps in the same runs (tools.common.step_clock.StepClock).
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import subprocess
import sys
import time
from pathlib import Path

from tools.common.gguf import convert_to_gguf
from tools.common.runs import batch_room, engine_overrides, make_prompts, run_mlx_lm, run_unikern
from tools.common.step_clock import StepClock, medians, steps_line

SHAPES = {  # the shapes of issue 17 (Llama 3.2 1B and Llama 3 8B, with a small vocabulary)
    "1b": dict(hidden_size=2048, num_layers=16, num_heads=32, num_kv_heads=8, intermediate_size=8192,
               vocab_size=8192, tie=True, dtype="bfloat16"),
    "8b": dict(hidden_size=4096, num_layers=32, num_heads=32, num_kv_heads=8, intermediate_size=14336,
               vocab_size=8192, tie=False, dtype="bfloat16"),
    # the 1B shape's very weights in float32 (bf16 rounds them): greedy parity on a GPU with
    # TF32 off, where only a logic error, not a rounding of one bf16 step, parts the engine from mlx-lm
    "1b-f32": dict(hidden_size=2048, num_layers=16, num_heads=32, num_kv_heads=8, intermediate_size=8192,
                   vocab_size=8192, tie=True, dtype="float32"),
    "tiny": dict(hidden_size=128, num_layers=2, num_heads=4, num_kv_heads=2, intermediate_size=256,
                 vocab_size=1024, tie=False, dtype="bfloat16"),  # for a dry run on a CPU
}
ENGINES = ("mlx-lm", "unikern", "llama.cpp")


# ---- models ------------------------------------------------------------------------------

def write_llama(out: Path, shape: dict, seed: int = 0) -> Path:
    """A seeded random Llama written by MLX in HF's layout; modelgen's init (fan-in scaled,
    so attention and logits are far from uniform) and its trained tokenizer."""
    import mlx.core as mx
    from mlx.utils import tree_flatten, tree_unflatten
    from mlx_lm.models import llama
    from mlx_lm.utils import save_model

    from unikern.testing import modelgen

    if (out / "config.json").exists():
        return out
    tok_dir = modelgen.cached_tokenizer(min(shape["vocab_size"], 8192))
    special = modelgen._special_token_ids(tok_dir)
    config = {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_act": "silu",
        "hidden_size": shape["hidden_size"], "intermediate_size": shape["intermediate_size"],
        "num_hidden_layers": shape["num_layers"], "num_attention_heads": shape["num_heads"],
        "num_key_value_heads": shape["num_kv_heads"], "head_dim": shape["hidden_size"] // shape["num_heads"],
        "vocab_size": shape["vocab_size"], "rms_norm_eps": 1e-5, "rope_theta": 500000.0,
        "max_position_embeddings": 8192, "tie_word_embeddings": shape["tie"], "torch_dtype": shape["dtype"],
        "attention_bias": False, "mlp_bias": False,
        "bos_token_id": special[modelgen.BOS_TOKEN], "eos_token_id": special[modelgen.EOS_TOKEN],
    }
    args = llama.ModelArgs.from_dict(config)
    model = llama.Model(args)
    dtype = getattr(mx, shape["dtype"])
    layers = shape["num_layers"]
    params = sorted(tree_flatten(model.parameters()))
    keys = mx.random.split(mx.random.key(seed), len(params))
    new = []
    for key, (name, p) in zip(keys, params, strict=True):
        noise = mx.random.normal(p.shape, key=key)
        if name.endswith("norm.weight"):
            value = 1.0 + 0.1 * noise
        elif "embed_tokens" in name or "lm_head" in name:
            value = noise * (2.0 / math.sqrt(p.shape[1]))
        else:
            std = 1.0 / math.sqrt(p.shape[1])
            if name.endswith(("o_proj.weight", "down_proj.weight")):
                std /= math.sqrt(2 * layers)
            value = noise * std
        value = value.astype(dtype)
        mx.eval(value)
        new.append((name, value))
    model.update(tree_unflatten(new))
    out.mkdir(parents=True, exist_ok=True)
    save_model(out, model, donate_model=True)
    (out / "config.json").write_text(json.dumps(config, indent=1))
    (out / "tokenizer.json").write_bytes((tok_dir / "tokenizer.json").read_bytes())
    tok_config = json.loads((tok_dir / "tokenizer_config.json").read_text())
    tok_config["model_max_length"] = config["max_position_embeddings"]
    (out / "tokenizer_config.json").write_text(json.dumps(tok_config, indent=1))
    return out


def cmd_models(args) -> None:
    out = Path(args.out)
    for name in args.shapes:
        t = time.perf_counter()
        path = write_llama(out / f"llama-{name}", SHAPES[name])
        print(f"llama-{name}: {path} ({time.perf_counter() - t:.0f} s)", flush=True)
        if name in args.quantize:
            q = out / f"llama-{name}-q4"
            if not q.exists():
                t = time.perf_counter()
                subprocess.run([sys.executable, "-m", "mlx_lm", "convert", "--hf-path", str(path),
                                "--mlx-path", str(q), "-q", "--q-bits", "4"], check=True)
                print(f"llama-{name}-q4: {q} ({time.perf_counter() - t:.0f} s)", flush=True)


def cmd_gguf(args) -> None:
    out = Path(args.out)
    script = Path(args.llama_cpp) / "convert_hf_to_gguf.py"
    for name in args.shapes:
        t = time.perf_counter()
        bf16 = convert_to_gguf(out / f"llama-{name}", script, out / f"llama-{name}-bf16.gguf", "bf16")
        print(f"{bf16} ({time.perf_counter() - t:.0f} s)", flush=True)
        if name in args.quantize:
            q = out / f"llama-{name}-q4_0.gguf"
            if not q.exists():
                subprocess.run([str(Path(args.llama_bin) / "llama-quantize"), str(bf16), str(q), "Q4_0"],
                               check=True, capture_output=True)
            print(f"{q}", flush=True)


# ---- bench -------------------------------------------------------------------------------

def run_llama_cpp(binary: Path, gguf: str, levels: list[int], prompt_tokens: int, max_tokens: int) -> dict:
    """One llama-batched-bench process for every level: {level: run}. The first level runs
    twice and the second run counts: the process's first one carries start-up work (on
    an H200, 1 stream: 125 ms of prompt time for 64 tokens, against 31 ms for the 8B)."""
    ctx = max(levels) * (prompt_tokens + max_tokens) + 256
    argv = [str(binary / "llama-batched-bench"), "-m", gguf, "-c", str(ctx), "-b", "2048", "-ub", "512",
            "-ngl", "999", "-npp", str(prompt_tokens), "-ntg", str(max_tokens),
            "-npl", ",".join(map(str, [levels[0], *levels])), "--output-format", "jsonl"]
    done = subprocess.run(argv, capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"llama-batched-bench exited {done.returncode}: {done.stderr[-1500:]}")
    runs = {}
    for line in (done.stdout + "\n" + done.stderr).splitlines():
        if line.startswith("{") and '"pl"' in line:
            row = json.loads(line)
            runs[row["pl"]] = {"wall": row["t"], "tokens": row["pl"] * row["tg"], "ttft": row["t_pp"],
                               "decode_tok_s": row["speed_tg"]}
    missing = [c for c in levels if c not in runs]
    if missing:
        raise RuntimeError(f"llama-batched-bench printed no result for levels {missing}: {done.stdout[-800:]}")
    return runs


def summarize(level: int, runs: dict[str, list[dict]]) -> dict:
    row: dict = {"concurrency": level}
    for name, rs in runs.items():
        if not rs:
            continue
        tok_s = [r["tokens"] / r["wall"] for r in rs]
        ttft = [r["ttft"] for r in rs if r["ttft"] is not None]
        row[name] = {"tok_s": statistics.median(tok_s), "tok_s_range": [min(tok_s), max(tok_s)], "tok_s_all": tok_s,
                     "ttft_ms": 1e3 * statistics.median(ttft) if ttft else None}
        if "decode_tok_s" in rs[0]:  # llama.cpp's own figure for its generation phase alone
            row[name]["decode_tok_s"] = statistics.median(r["decode_tok_s"] for r in rs)
        if "split" in rs[0]:  # unikern's steps, with --split: medians over the repeats
            row[name]["split"] = medians([r["split"] for r in rs])
    ours = [r["tokens"] / r["wall"] for r in runs["unikern"]]
    for peer in ("mlx-lm", "llama.cpp"):
        if runs.get(peer):
            paired = sorted(o / (r["tokens"] / r["wall"]) for o, r in zip(ours, runs[peer], strict=True))
            row[f"vs_{peer}"] = {"median": statistics.median(paired), "range": [paired[0], paired[-1]]}
    return row


def cmd_bench(args) -> dict:
    import unikern  # first: it loads the BLAS that MLX's CPU backend should use

    # isort: split
    import anyio
    from mlx_lm import load

    from unikern.platform import current_platform

    if args.isolate:  # mlx-lm in a process of its own; this one holds unikern alone
        worker = MlxLmWorker(args.model)
        vocab, mlx_lm_run = worker.vocab, worker.run
    else:
        model, tokenizer = load(args.model)
        vocab = len(tokenizer)

        def mlx_lm_run(prompts: list[list[int]], max_tokens: int) -> dict:
            return run_mlx_lm(model, tokenizer, prompts, max_tokens)
    levels = args.concurrency
    prompts = {c: make_prompts(c, vocab, args.prompt_tokens, args.prompt_tokens, seed=c) for c in levels}
    overrides = engine_overrides(batch_room(levels, args.token_budget), args.overrides)
    runs = {c: {name: [] for name in ENGINES} for c in levels}
    llama_bin = Path(args.llama_bin) if args.llama_bin else None

    clock = None
    if args.split:
        clock = StepClock()
        clock.install()

    async def timed_unikern(engine, prompts) -> dict:
        if clock is None:
            return await run_unikern(engine, prompts, args.max_tokens)
        clock.steps.clear()
        began = time.perf_counter()
        run = await run_unikern(engine, prompts, args.max_tokens)
        return {**run, "split": clock.summary(began, time.perf_counter())}

    async def main():
        async with unikern.Engine.from_pipeline("generate", model=args.model, overrides=overrides) as engine:
            for c in levels:  # untimed: kernels built and decode steps traced for each shape
                if "mlx-lm" in args.engines:
                    mlx_lm_run(prompts[c], args.max_tokens)
                await run_unikern(engine, prompts[c], args.max_tokens)
            for r in range(args.repeats):
                for c in levels:
                    if "mlx-lm" in args.engines:
                        runs[c]["mlx-lm"].append(mlx_lm_run(prompts[c], args.max_tokens))
                    runs[c]["unikern"].append(await timed_unikern(engine, prompts[c]))
                if llama_bin and args.gguf and "llama.cpp" in args.engines:
                    for c, run in run_llama_cpp(llama_bin, args.gguf, levels, args.prompt_tokens,
                                                args.max_tokens).items():
                        runs[c]["llama.cpp"].append(run)
                print(f"repeat {r + 1}/{args.repeats}: " + "  ".join(
                    f"c={c} " + "/".join(f"{runs[c][n][-1]['tokens'] / runs[c][n][-1]['wall']:.0f}"
                                         for n in ENGINES if runs[c][n]) for c in levels), flush=True)

    anyio.run(main)
    rows = [summarize(c, runs[c]) for c in levels]
    print(f"\n{args.label or args.model}: {args.prompt_tokens}-token prompts, {args.max_tokens} new tokens, "
          f"{args.repeats} repeats (medians, min-max)")
    print(f"{'conc':>5} " + " ".join(f"{n + ' tok/s':>24}" for n in ENGINES) + f" {'vs mlx-lm':>18} {'vs llama.cpp':>18}"
          f" {'TTFT ms (m/u/l)':>20}")
    for row in rows:
        cells = []
        for n in ENGINES:
            e = row.get(n)
            cells.append(f"{e['tok_s']:>9.0f} ({e['tok_s_range'][0]:.0f}-{e['tok_s_range'][1]:.0f})"
                         if e else f"{'-':>9}")
        ratios = [f"{row[k]['median']:.2f}x ({row[k]['range'][0]:.2f}-{row[k]['range'][1]:.2f})"
                  if k in row else "-" for k in ("vs_mlx-lm", "vs_llama.cpp")]
        ttft = "/".join(f"{row[n]['ttft_ms']:.0f}" if row.get(n) and row[n]["ttft_ms"] is not None else "-"
                        for n in ENGINES)
        print(f"{row['concurrency']:>5} " + " ".join(f"{c:>24}" for c in cells)
              + f" {ratios[0]:>18} {ratios[1]:>18} {ttft:>20}")
    for row in rows:
        split = row["unikern"].get("split")
        if split:
            line = steps_line(split)
            print(f"unikern c={row['concurrency']}: in execute {split['execute_ms']:.1f} ms, gaps {split['gaps_ms']:.1f}, "
                  f"head {split['head_ms']:.1f}, tail {split['tail_ms']:.1f}" + (f"; {line}" if line else ""))
    import mlx.core as mx
    import mlx_lm

    return {"label": args.label, "model": args.model, "gguf": args.gguf, "platform": current_platform().to_stats(),
            "mlx": mx.__version__, "mlx_lm": mlx_lm.__version__, "prompt_tokens": args.prompt_tokens,
            "max_tokens": args.max_tokens, "repeats": args.repeats, "overrides": args.overrides,
            "mlx_lm_process": "own" if args.isolate else "shared", "rows": rows}


class MlxLmWorker:
    """mlx-lm in a child process (`bench --isolate`): the model loaded there once, each
    run asked for over its stdin and answered on its stdout, one JSON line each, so that
    the benchmark's process holds the unikern engine alone (as a server's would) while
    the repeats stay interleaved."""

    def __init__(self, model: str) -> None:
        self.proc = subprocess.Popen([sys.executable, "-m", __spec__.name, "mlx-lm-worker", "--model", model],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        self.vocab = self._answer()["vocab"]

    def run(self, prompts: list[list[int]], max_tokens: int) -> dict:
        self.proc.stdin.write(json.dumps({"prompts": prompts, "max_tokens": max_tokens}) + "\n")
        self.proc.stdin.flush()
        return self._answer()

    def _answer(self) -> dict:
        for line in self.proc.stdout:  # anything else it prints (logs) is not an answer
            if line.startswith(ANSWER):
                return json.loads(line[len(ANSWER):])
        raise RuntimeError(f"the mlx-lm worker exited ({self.proc.wait()}) without answering")


ANSWER = "mlx-lm-worker: "


def cmd_mlx_lm_worker(args) -> None:
    import unikern  # noqa: F401  first, as in the benchmark's process: the BLAS MLX's CPU backend should use

    # isort: split
    from mlx_lm import load

    model, tokenizer = load(args.model)
    print(ANSWER + json.dumps({"vocab": len(tokenizer)}), flush=True)
    for line in sys.stdin:
        ask = json.loads(line)
        print(ANSWER + json.dumps(run_mlx_lm(model, tokenizer, ask["prompts"], ask["max_tokens"])), flush=True)


def plot(results: list[dict], path: Path) -> None:
    """tok/s per engine and level (bars: medians, whiskers: min-max), one panel a model."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(results), figsize=(6 * len(results), 4.2), squeeze=False)
    for ax, res in zip(axes[0], results, strict=True):
        levels = [row["concurrency"] for row in res["rows"]]
        width = 0.8 / len(ENGINES)
        for k, name in enumerate(ENGINES):
            xs, ys, lo, hi = [], [], [], []
            for i, row in enumerate(res["rows"]):
                if row.get(name):
                    xs.append(i + (k - 1) * width)
                    ys.append(row[name]["tok_s"])
                    lo.append(row[name]["tok_s"] - row[name]["tok_s_range"][0])
                    hi.append(row[name]["tok_s_range"][1] - row[name]["tok_s"])
            ax.bar(xs, ys, width, yerr=[lo, hi], capsize=3, label=name)
        ax.set_xticks(range(len(levels)), [f"{c} concurrent" for c in levels])
        ax.set_ylabel("generated tokens/s")
        ax.set_title(f"{res['label'] or Path(res['model']).name} ({res['platform'].get('device_name', '')})",
                     fontsize=10)
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("models", help="random Llama weights written by MLX")
    p.add_argument("--out", required=True)
    p.add_argument("--shapes", nargs="+", default=["1b", "8b"], choices=sorted(SHAPES))
    p.add_argument("--quantize", nargs="*", default=["8b"], help="shapes also quantized to 4 bits")
    p = sub.add_parser("gguf", help="the same weights as GGUF")
    p.add_argument("--out", required=True)
    p.add_argument("--shapes", nargs="+", default=["1b", "8b"], choices=sorted(SHAPES))
    p.add_argument("--quantize", nargs="*", default=["8b"], help="shapes also quantized to Q4_0")
    p.add_argument("--llama-cpp", required=True, help="llama.cpp's source tree (its converter and gguf-py)")
    p.add_argument("--llama-bin", required=True, help="the folder holding llama-quantize")
    p = sub.add_parser("bench", help="the three engines side by side")
    p.add_argument("--model", required=True, help="the MLX model folder")
    p.add_argument("--gguf", help="the same weights as GGUF, for llama.cpp")
    p.add_argument("--llama-bin", help="the folder holding llama-batched-bench")
    p.add_argument("--label", default="")
    p.add_argument("--engines", nargs="+", default=list(ENGINES), choices=ENGINES,
                   help="unikern always runs; leave peers out for an A/B of unikern's settings")
    p.add_argument("--concurrency", type=int, nargs="+", default=[1, 16, 64])
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--prompt-tokens", type=int, default=64)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--token-budget", type=int, default=4096)
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="STAGE.PARAM=VALUE")
    p.add_argument("--split", action="store_true",
                   help="time unikern's steps too (tools/common/step_clock.py's StepClock, as tools/probe/step_gaps.py): per level, the medians of its "
                        "time inside execute, the gaps, and its decode windows' step split into build, submit, "
                        "wait and other")
    p.add_argument("--isolate", action="store_true",
                   help="mlx-lm in a process of its own (MlxLmWorker), the repeats still interleaved; by default it "
                        "runs in this one, beside the unikern engine")
    p.add_argument("--json")
    p = sub.add_parser("mlx-lm-worker")  # bench --isolate's child
    p.add_argument("--model", required=True)
    p = sub.add_parser("plot", help="one figure from bench JSON files")
    p.add_argument("json", nargs="+")
    p.add_argument("--out", required=True)
    args = parser.parse_args()
    if args.cmd == "models":
        cmd_models(args)
    elif args.cmd == "gguf":
        cmd_gguf(args)
    elif args.cmd == "mlx-lm-worker":
        cmd_mlx_lm_worker(args)
    elif args.cmd == "bench":
        result = cmd_bench(args)
        if args.json:
            Path(args.json).write_text(json.dumps(result, indent=1))
    else:
        plot([json.loads(Path(f).read_text()) for f in args.json], Path(args.out))


if __name__ == "__main__":
    main()
