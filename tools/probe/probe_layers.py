"""Where in the model a prompt's last position parts from mlx-lm's: each decoder block's
outputs at the prompt's last token (Recorder: RoPE, SDPA, attention, the MLP's input and
output, the block), the engine's last prefill forward against mlx-lm's forward of the
whole prompt, on the default device and (in a process of its own) on MLX's CPU device.
The first layer where the engine and mlx-lm part on the GPU while they agree on the CPU
is where to look (probe_exact.py says which setting, this says which layer and whether
attention or the MLP).

Scenarios as probe_exact.py's, one request each (max_tokens 1):
  gpt-oss   tests/test_family_prefix.py's windowed prompt, no cache
  partial   tests/test_partial_prefix.py: the first request, then a follower whose
            prefix ends mid-block (its 80 cached slots copied)

    python -m tools.probe.probe_layers --scenario gpt-oss partial --out /tmp/layers
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[2]
# (module, block class, attention class, MLP class) of the scenarios' families
HOOKED = [("mlx_lm.models.llama", "TransformerBlock", "Attention", "MLP"),
          ("mlx_lm.models.gpt_oss", "TransformerBlock", "AttentionBlock", "MLPBlock")]


class Recorder:
    """Outputs at the last position of each call of several tokens (a prefill): each
    block's (`block3`), its attention and MLP modules' (`attn3`, `mlp3`; the MLP's input,
    `mlpin3`), and inside the block each `mx.fast.rope` (`rope3.0` the queries, `rope3.1`
    the keys) and `mx.fast.scaled_dot_product_attention` (`sdpa3.0`). Kept lazy and
    evaluated with the forward (through `mx.depends`, on the forward's thread); a block
    seen again starts the next forward."""

    def __init__(self) -> None:
        self.forwards: list[dict[str, object]] = []
        self._seen: set[int] = set()
        self._layer = -1
        self._counts: dict[str, int] = {}
        # layer 0's MLP of each forward, whole: (the module, its input, its output), to
        # run again on the same input (replay_first_mlp)
        self.first_mlp: list[tuple[object, object, object]] = []

    def clear(self) -> None:
        self.forwards, self._seen, self._layer, self.first_mlp = [], set(), -1, []

    def last_forward(self) -> dict[str, np.ndarray]:
        """The last forward's outputs (an earlier chunk's last layers may never have been
        evaluated: a chunk that samples nothing evaluates only the pool)."""
        return {k: np.array(v) for k, v in self.forwards[-1].items()}

    def _record(self, name: str, out, axis: int):
        import mlx.core as mx

        if self._layer < 0:
            return out
        index = self._counts.get(name, 0)
        self._counts[name] = index + 1
        key = f"{name}{self._layer}" if name in ("block", "attn", "mlpin", "mlp") else f"{name}{self._layer}.{index}"
        record = mx.take(out, out.shape[axis] - 1, axis=axis).reshape(-1).astype(mx.float32)
        self.forwards[-1][key] = record
        return mx.depends([out], [record])[0]

    def hook(self) -> None:
        import importlib

        import mlx.core as mx

        for module, block, attention, mlp in HOOKED:
            mod = importlib.import_module(module)
            self._wrap_block(getattr(mod, block))
            self._wrap_module(getattr(mod, attention), "attn")
            self._wrap_module(getattr(mod, mlp), "mlp")
        for name, short in (("rope", "rope"), ("scaled_dot_product_attention", "sdpa")):
            self._wrap_function(mx.fast, name, short)

    def _wrap_block(self, cls: type) -> None:
        original, recorder = cls.__call__, self

        def call(self, x, *args, **kwargs):
            if x.ndim != 3 or x.shape[1] == 1:
                return original(self, x, *args, **kwargs)
            if id(self) in recorder._seen or not recorder.forwards:
                recorder.forwards.append({})
                recorder._seen = set()
            recorder._seen.add(id(self))
            recorder._layer, recorder._counts = len(recorder._seen) - 1, {}
            out = original(self, x, *args, **kwargs)
            out = recorder._record("block", out, 1)
            recorder._layer = -1
            return out

        cls.__call__ = call

    def _wrap_module(self, cls: type, name: str) -> None:
        original, recorder = cls.__call__, self

        def call(self, x, *args, **kwargs):
            if name == "mlp":  # its input too: the residual stream, which RMS norms hide the scale of
                x = recorder._record("mlpin", x, 1)
            out = original(self, x, *args, **kwargs)
            if name == "mlp" and recorder._layer == 0:
                recorder.first_mlp.append((self, x, out))
            return recorder._record(name, out, 1)

        cls.__call__ = call

    def _wrap_function(self, owner, name: str, short: str) -> None:
        original, recorder = getattr(owner, name), self

        def call(x, *args, **kwargs):
            return recorder._record(short, original(x, *args, **kwargs), 2)

        setattr(owner, name, call)


def replay_first_mlp(recorder: Recorder) -> dict[str, object]:
    """Layer 0's MLP of the last forward run again on its very input, on this thread and
    the default device, and on MLX's CPU: whether the engine's MLP output follows from its
    input (the same module on the same input gives it again) or the forward computed it
    otherwise (another stream, another thread's state)."""
    import mlx.core as mx

    module, x, out = recorder.first_mlp[-1]
    x_np, out_np = np.array(x), np.array(out)  # evaluated with the forward
    x = mx.array(x_np)
    again = np.array(module(x))
    with mx.stream(mx.cpu):
        cpu = np.array(module(x))
    return {"input_shape": list(x_np.shape), "input_finite": bool(np.isfinite(x_np).all()),
            "forward_vs_again": diff(out_np, again), "forward_vs_cpu": diff(out_np, cpu),
            "again_vs_cpu": diff(again, cpu),
            "last_row": {"forward_vs_again": diff(out_np[:, -1], again[:, -1]),
                         "forward_vs_cpu": diff(out_np[:, -1], cpu[:, -1])}}


def scenario(name: str):
    """(model dir, engine settings, requests before the probed one, the probed prompt)"""
    sys.path.insert(0, str(REPO))
    if name == "gpt-oss":
        from tests.test_families import family_model
        from tests.test_family_prefix import PREFIX

        return family_model("gpt-oss"), {"kv": {"kv_budget_bytes": 32 << 20}}, [], PREFIX + [42]
    from tests.test_partial_prefix import FIRST, FOLLOWERS, engine_settings
    from unikern.testing.modelgen import cached_model

    return str(cached_model("tiny-llama")), engine_settings(True), [FIRST], FOLLOWERS[0]


def child(name: str, out: Path) -> None:
    import anyio
    import mlx.core as mx

    if os.environ.get("PROBE_DEVICE") == "cpu":
        mx.set_default_device(mx.cpu)
    import mlx_lm
    from mlx_lm.models.cache import make_prompt_cache

    import unikern

    recorder = Recorder()
    recorder.hook()
    path, overrides, before, prompt = scenario(name)

    async def engine_run():
        async with unikern.Engine.from_pipeline("generate", model=path, overrides=overrides) as engine:
            for p in before:
                await engine.complete(prompt_tokens=p, max_tokens=2)
            recorder.clear()
            result = await engine.complete(prompt_tokens=prompt, max_tokens=1)
            return list(result.token_ids), recorder.last_forward()

    tokens, engine_layers = anyio.run(engine_run)
    replay = replay_first_mlp(recorder) if recorder.first_mlp else None
    recorder.clear()
    model, _ = mlx_lm.load(path)
    logits = model(mx.array([prompt]), cache=make_prompt_cache(model))[0, -1].astype(mx.float32)
    mx.eval(logits)
    ref_layers = recorder.last_forward()
    top = np.argsort(np.array(logits))[::-1][:2]
    np.savez(out / f"{name}.npz", **{f"engine.{k}": v for k, v in engine_layers.items()},
             **{f"ref.{k}": v for k, v in ref_layers.items()})
    (out / f"{name}.json").write_text(json.dumps({"engine_token": tokens[0], "ref_top2": [int(t) for t in top],
                                                  "ref_margin": float(logits[top[0]] - logits[top[1]]),
                                                  "device": str(mx.default_device()),
                                                  "engine_first_mlp_replay": replay}))


STAGES = ["rope", "sdpa", "attn", "mlpin", "mlp", "block"]  # their order inside a block


def order(key: str) -> tuple[int, int, str]:
    """(layer, where in the block, which call): rope3.1 -> (3, 0, "1")."""
    match = re.fullmatch(r"([a-z]+)(\d+)(?:\.(\d+))?", key)
    assert match is not None, key
    return int(match[2]), STAGES.index(match[1]), match[3] or ""


def common(arrays: dict[str, np.ndarray]) -> set[str]:
    """The records both the engine and mlx-lm made (the engine's routed attention may
    not call mx.fast's SDPA)."""
    names = {side: {k.split(".", 1)[1] for k in arrays if k.startswith(side + ".")} for side in ("engine", "ref")}
    return names["engine"] & names["ref"]


def diff(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.max(np.abs(a - b)) / max(1e-30, float(np.max(np.abs(b)))))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--scenario", nargs="+", default=["gpt-oss", "partial"])
    parser.add_argument("--out", required=True)
    parser.add_argument("--no-cpu", action="store_true", help="skip the CPU device's run")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args()
    out = Path(args.out)
    if args.child:
        child(args.child, out)
        return 0
    report = {}
    for name in args.scenario:
        runs = {}
        for device in ["default"] + ([] if args.no_cpu else ["cpu"]):
            folder = out / device
            folder.mkdir(parents=True, exist_ok=True)
            env = dict(os.environ, PROBE_DEVICE=device)
            proc = subprocess.run([sys.executable, "-m", "tools.probe.probe_layers", "--child", name, "--out",
                                   str(folder)], cwd=REPO, env=env, capture_output=True, text=True)
            if proc.returncode != 0:
                print(f"{name} [{device}]: failed: {proc.stderr[-1500:]}", flush=True)
                continue
            runs[device] = (dict(np.load(folder / f"{name}.npz")), json.loads((folder / f"{name}.json").read_text()))
            print(f"{name} [{device}]: {runs[device][1]}", flush=True)
        if "default" not in runs:
            continue
        arrays, _ = runs["default"]
        cpu = runs.get("cpu", (None, None))[0]
        rows = []
        keys = sorted({k.split(".", 1)[1] for k in arrays if k.split(".", 1)[1] in common(arrays)}, key=order)
        for k in keys:
            row = {"what": k, "engine_vs_ref": diff(arrays[f"engine.{k}"], arrays[f"ref.{k}"])}
            if cpu is not None:
                row["ref_vs_ref_cpu"] = diff(arrays[f"ref.{k}"], cpu[f"ref.{k}"])
                row["engine_vs_engine_cpu"] = diff(arrays[f"engine.{k}"], cpu[f"engine.{k}"])
            rows.append(row)
            print(f"{name} {k:>8}: " + "  ".join(f"{n} {v:.2e}" for n, v in row.items() if n != "what"), flush=True)
        report[name] = {"runs": {d: r[1] for d, r in runs.items()}, "layers": rows}
    (out / "report.json").write_text(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
