"""gpt-oss's experts (mlx-lm's MLPBlock, layer 0) on the default device against MLX's CPU:
first on the real input (layer 0's MLP input over tests/test_family_prefix.py's windowed
prompt, and the engine's second chunk of it), then on random inputs of several token
counts, contiguous and not: where the engine's 89-token chunk parted from mlx-lm on an
H100 (probe_layers: attention exact, the MLP's output 0.98 off).

    python -m tools.probe.probe_moe
"""

from __future__ import annotations

import argparse
import sys
import threading
from pathlib import Path

import mlx.core as mx
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))


def main() -> int:
    argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter).parse_args()
    from mlx_lm import load
    from mlx_lm.models.cache import make_prompt_cache

    from tests.test_families import family_model
    from tests.test_family_prefix import PREFIX

    model, _ = load(family_model("gpt-oss"))
    mlp = model.model.layers[0].mlp
    # the real input: layer 0's MLP input over the scenario's prompt, computed on the CPU,
    # and the engine's second chunk of it (positions 512-600)
    seen = []
    original = type(mlp).__call__
    type(mlp).__call__ = lambda self, x: seen.append(x) or original(self, x)
    with mx.stream(mx.cpu):
        model(mx.array([PREFIX + [42]]), cache=make_prompt_cache(model))
        whole = seen[0]
        mx.eval(whole)
    type(mlp).__call__ = original
    for name, x in (("the prompt's 601 rows", whole), ("its rows 512-600 (the engine's chunk)", whole[:, 512:])):
        x = mx.array(np.array(x))
        with mx.stream(mx.cpu):
            want = np.array(mlp(x)[:, -1])
        for where in ("this thread", "a thread of its own (as the engine's model thread)"):
            got: list[np.ndarray] = []

            def run(x=x, got=got) -> None:
                got.append(np.array(mlp(x)[:, -1]))

            if where == "this thread":
                run()
            else:
                worker = threading.Thread(target=run)
                worker.start()
                worker.join()
            print(f"{name}, {where}: the last row, max |device - cpu| / max |cpu| = "
                  f"{np.max(np.abs(got[0] - want)) / np.max(np.abs(want)):.2e}", flush=True)
    for T in (1, 8, 31, 32, 33, 64, 89, 512, 601):
        x = mx.random.normal((1, T, 64), key=mx.random.key(T))
        mx.eval(x)
        for kind, inp in (("contiguous", x), ("strided", mx.concatenate([x, x], axis=2)[..., ::2])):
            got = mlp(inp)
            with mx.stream(mx.cpu):
                want = mlp(inp)
            g, w = np.array(got), np.array(want)
            print(f"T={T:4d} {kind:10s}: max |device - cpu| / max |cpu| = "
                  f"{np.max(np.abs(g - w)) / np.max(np.abs(w)):.2e}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
