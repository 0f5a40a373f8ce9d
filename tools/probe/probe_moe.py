"""gpt-oss's experts (mlx-lm's MLPBlock, layer 0) on the default device against MLX's CPU,
with element-wise fusion as the engine sets it on CUDA (off; `--fusion on`: MLX's default),
before and after `route_experts` (stages/execute/experts.py): on the real input (layer 0's
MLP input over tests/test_family_prefix.py's windowed prompt, whole and the engine's second
chunk of it) and on random inputs of several token counts. With fusion off mlx-lm's
activation leaves the down projection an input whose size-1 axis has stride 0, which MLX's
CUDA grouped GEMM takes as the row pitch (tests/test_expert_inputs.py): expected, a large
error before the routing from 32 tokens on (64 sorted pairs) and none after it.

    python -m tools.probe.probe_moe [--fusion on]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import mlx.core as mx
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--fusion", choices=("on", "off"), default="off")
    args = parser.parse_args()
    from mlx_lm import load
    from mlx_lm.models.cache import make_prompt_cache

    from tests.test_families import family_model
    from tests.test_family_prefix import PREFIX
    from unikern.platform.fusion import set_fusion
    from unikern.stages.execute.experts import route_experts

    print(f"fusion {args.fusion}: set {set_fusion(args.fusion == 'on')}", flush=True)  # before any trace
    model, _ = load(family_model("gpt-oss"))
    mlp = model.model.layers[0].mlp
    # the real input: layer 0's MLP input over the scenario's prompt, computed on the CPU
    seen = []
    original = type(mlp).__call__
    type(mlp).__call__ = lambda self, x: seen.append(x) or original(self, x)
    with mx.stream(mx.cpu):
        model(mx.array([PREFIX + [42]]), cache=make_prompt_cache(model))
        whole = seen[0]
        mx.eval(whole)
    type(mlp).__call__ = original
    inputs = [("the prompt's 601 rows", mx.array(np.array(whole))),
              ("its rows 512-600 (the engine's chunk)", mx.array(np.array(whole[:, 512:])))]
    inputs += [(f"random, T={T}", mx.random.normal((1, T, 64), key=mx.random.key(T))) for T in (1, 8, 31, 32, 89, 601)]
    wants = []
    for _, x in inputs:
        with mx.stream(mx.cpu):
            wants.append(np.array(mlp(x)))
    for routed in (False, True):
        if routed:
            print(f"route_experts: {route_experts(mlp.experts)} projections", flush=True)
        for (name, x), want in zip(inputs, wants, strict=True):
            got = np.array(mlp(x))
            print(f"{'routed' if routed else 'as loaded'}, {name}: max |device - cpu| / max |cpu| = "
                  f"{np.max(np.abs(got - want)) / np.max(np.abs(want)):.2e}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
