"""Where a greedy mismatch comes from: one engine scenario run with the engine's settings
turned off one at a time, each run's tokens against mlx-lm's (the default device) and,
with --cpu-reference, against mlx-lm on MLX's CPU device as well (is the reference itself
off on this backend?).

Scenarios are the engine tests that failed on CUDA while passing on the CPU:
  gpt-oss      tests/test_family_prefix.py's windowed prompt (600 + 1 tokens, gpt-oss family:
               sliding windows with attention sinks), one request, no cache
  partial      tests/test_partial_prefix.py's followers: a prefix that ends mid-block,
               copied in part (kv.partial_prefix), six requests
  partial-off  the same requests with kv.partial_prefix off (whole blocks only)

    python -m tools.probe.probe_exact --scenario gpt-oss partial --cpu-reference \
        --set none execute.paged_attention=never execute.block_kernel=never
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
DEFAULT_SETS = ["none", "execute.paged_attention=never", "execute.block_kernel=never", "execute.fuse_blocks=never",
                "execute.fuse_projections=never", "execute.compile_prefill=never", "execute.compile_decode=never",
                "execute.fuse_elementwise=never", "env:UNIKERN_ROW_KERNEL=0", "env:UNIKERN_STEP_LAYOUT=0",
                "attr:unikern.stages.execute.paged_cache.WRITE_IN_PLACE=False"]


def scenario(name: str) -> tuple[str, dict, list[tuple[list[int], int]], int]:
    """(model dir, engine settings, each request's prompt and max_tokens, how many of them
    go one by one before the rest are sent together), as the test sets them up"""
    sys.path.insert(0, str(REPO))
    if name == "gpt-oss":
        from tests.test_families import family_model
        from tests.test_family_prefix import MAX_TOKENS, PREFIX

        return family_model("gpt-oss"), {"kv": {"kv_budget_bytes": 32 << 20}}, [(PREFIX + [42], MAX_TOKENS)], 0
    from tests.test_partial_prefix import FIRST, FOLLOWERS, engine_settings
    from unikern.testing.modelgen import cached_model

    # the request that fills the cache (2 tokens), one follower alone, the others together
    asked = [(FIRST, 2)] + [(p, 8) for p in FOLLOWERS]
    return str(cached_model("tiny-llama")), engine_settings(name == "partial"), asked, 2


def run(path: str, overrides: dict, asked: list[tuple[list[int], int]], alone: int, setting: str) -> list[list[int]]:
    import anyio

    import unikern
    from tests.conftest import complete_all
    from tools.common.runs import engine_overrides

    if setting.startswith("attr:"):  # a module's switch, set before the engine starts
        import ast
        import importlib

        name, value = setting[5:].split("=", 1)
        module, attr = name.rsplit(".", 1)
        setattr(importlib.import_module(module), attr, ast.literal_eval(value))
    sets = [] if setting == "none" or setting.startswith(("env:", "attr:")) else [setting]

    async def main():
        async with unikern.Engine.from_pipeline("generate", model=path,
                                                overrides=engine_overrides(overrides, sets)) as engine:
            out = [await engine.complete(prompt_tokens=p, max_tokens=n) for p, n in asked[:alone]]
            together = asked[alone:]  # one max_tokens among them
            out += await complete_all(engine, [p for p, _ in together], together[0][1])
            return [r.token_ids for r in out]

    return anyio.run(main)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--scenario", nargs="+", default=["gpt-oss", "partial", "partial-off"])
    parser.add_argument("--set", nargs="+", default=DEFAULT_SETS, dest="sets",
                        help="none, STAGE.KEY=VALUE, env:NAME=VALUE (set for a child process) or "
                             "attr:MODULE.NAME=LITERAL (a module's switch, set in the child)")
    parser.add_argument("--cpu-reference", action="store_true")
    parser.add_argument("--json")
    parser.add_argument("--child", nargs=2, metavar=("SCENARIO", "SETTING"), help=argparse.SUPPRESS)
    parser.add_argument("--cpu-child", metavar="SCENARIO", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.cpu_child:  # mlx-lm's greedy tokens and margins computed on MLX's CPU device
        import mlx.core as mx

        mx.set_default_device(mx.cpu)
        from mlx_lm import load

        from unikern.testing.reference import greedy_reference

        path, _, asked, _ = scenario(args.cpu_child)
        model, tokenizer = load(path)
        refs = [greedy_reference(model, tokenizer, p, n) for p, n in asked]
        print(json.dumps([{"tokens": r.tokens, "margins": r.margins} for r in refs]))
        return 0
    if args.child:  # one engine run in a process of its own (environment switches are read at import)
        print(json.dumps(run(*scenario(args.child[0]), args.child[1])))
        return 0

    import mlx.core as mx
    from mlx_lm import load

    from unikern.testing.reference import Reference, compare, greedy_reference

    report = []
    for name in args.scenario:
        path, _, asked, _ = scenario(name)
        model, tokenizer = load(path)
        refs = [greedy_reference(model, tokenizer, p, n) for p, n in asked]
        cpu_refs = None
        if args.cpu_reference:  # a process of its own: mlx-lm takes its stream's device at import
            proc = subprocess.run([sys.executable, "-m", "tools.probe.probe_exact", "--cpu-child", name],
                                  cwd=REPO, capture_output=True, text=True, check=True)
            cpu_refs = [Reference(**r) for r in json.loads(proc.stdout.strip().splitlines()[-1])]
            same = [compare(c.tokens, r)["result"] for c, r in zip(cpu_refs, refs, strict=True)]
            print(f"{name}: mlx-lm on the CPU against mlx-lm on {mx.default_device()}: {same}", flush=True)
        for setting in args.sets:
            env = dict(os.environ)
            if setting.startswith("env:"):
                key, value = setting[4:].split("=", 1)
                env[key] = value
            proc = subprocess.run([sys.executable, "-m", "tools.probe.probe_exact", "--child", name, setting],
                                  cwd=REPO, env=env, capture_output=True, text=True)
            if proc.returncode != 0:
                print(f"{name} [{setting}]: failed: {proc.stderr.strip().splitlines()[-1:]}", flush=True)
                report.append({"scenario": name, "setting": setting, "error": proc.stderr[-2000:]})
                continue
            tokens = json.loads(proc.stdout.strip().splitlines()[-1])
            rows = [compare(t, r) for t, r in zip(tokens, refs, strict=True)]
            line = {"scenario": name, "setting": setting, "rows": rows}
            results = [r["result"] if r["result"] == "exact" else f"{r['result']}@{r.get('step')}"
                       f"(margin {r.get('margin', float('nan')):.3f})" for r in rows]
            if cpu_refs is not None:
                line["against_cpu"] = [compare(t, c) for t, c in zip(tokens, cpu_refs, strict=True)]
                results.append("cpu: " + ",".join(r["result"] for r in line["against_cpu"]))
            print(f"{name} [{setting}]: {results}", flush=True)
            report.append(line)
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=1, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
