"""Where in the model a prompt's last position parts from mlx-lm's: every decoder block's
and attention's output at the prompt's last token, the engine's last prefill forward
against mlx-lm's forward of the whole prompt, on the default device and (in a process
of its own) on MLX's CPU device. The first layer where the engine and mlx-lm part on
the GPU while they agree on the CPU is where to look (probe_exact.py says which
setting, this says which layer and whether attention or the MLP).

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
import subprocess
import sys
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[2]
# (module, block class, attention class) of the scenarios' families
HOOKED = [("mlx_lm.models.llama", "TransformerBlock", "Attention"),
          ("mlx_lm.models.gpt_oss", "TransformerBlock", "AttentionBlock")]


class Recorder:
    """Each hooked call's output at its last position, for calls of several tokens (a
    prefill), kept lazy until the forward is evaluated; `forwards()` splits them into
    forwards (a block seen again starts the next)."""

    def __init__(self) -> None:
        self.calls: list[tuple[int, str, object]] = []
        self.on = True

    def hook(self) -> None:
        import importlib

        for module, block, attention in HOOKED:
            mod = importlib.import_module(module)
            for name, kind in ((block, "block"), (attention, "attn")):
                self._wrap(getattr(mod, name), kind)

    def _wrap(self, cls: type, kind: str) -> None:
        import mlx.core as mx

        original = cls.__call__
        recorder = self

        def call(self, x, *args, **kwargs):
            out = original(self, x, *args, **kwargs)
            if recorder.on and x.ndim == 3 and x.shape[1] > 1:
                record = out[:, -1].astype(mx.float32)
                recorder.calls.append((id(self), kind, record))
                # evaluated with the forward (on its thread), its values untouched
                out = mx.depends([out], [record])[0]
            return out

        cls.__call__ = call

    def last_forward(self) -> dict[str, np.ndarray]:
        """The last forward's outputs (an earlier chunk's last layers may never have been
        evaluated: a chunk that samples nothing evaluates only the pool)."""
        return {k: np.array(v) for k, v in self.forwards()[-1].items()}

    def forwards(self) -> list[dict[str, object]]:
        out: list[dict[str, np.ndarray]] = []
        seen: dict[tuple[int, str], int] = {}
        for key, kind, array in ((c[0], c[1], c[2]) for c in self.calls):
            if (key, kind) in seen or not out:
                out.append({})
                seen = {}
            layer = sum(1 for k in seen if k[1] == kind)
            seen[(key, kind)] = layer
            out[-1][f"{kind}{layer}"] = array
        return out


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
            recorder.calls.clear()
            result = await engine.complete(prompt_tokens=prompt, max_tokens=1)
            return list(result.token_ids), recorder.last_forward()

    tokens, engine_layers = anyio.run(engine_run)
    recorder.calls.clear()
    model, _ = mlx_lm.load(path)
    logits = model(mx.array([prompt]), cache=make_prompt_cache(model))[0, -1].astype(mx.float32)
    mx.eval(logits)
    ref_layers = recorder.last_forward()
    top = np.argsort(np.array(logits))[::-1][:2]
    np.savez(out / f"{name}.npz", **{f"engine.{k}": v for k, v in engine_layers.items()},
             **{f"ref.{k}": v for k, v in ref_layers.items()})
    (out / f"{name}.json").write_text(json.dumps({"engine_token": tokens[0], "ref_top2": [int(t) for t in top],
                                                  "ref_margin": float(logits[top[0]] - logits[top[1]]),
                                                  "device": str(mx.default_device())}))


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
        keys = sorted({k.split(".", 1)[1] for k in arrays}, key=lambda k: (int(k.lstrip("abcdefghijklmnopqrstuvwxyz")), k))
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
