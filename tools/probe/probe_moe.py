"""gpt-oss's experts (mlx-lm's MLPBlock, layer 0) on the default device against MLX's CPU
for inputs of several token counts, contiguous and not: where the engine's 89-token chunk
parted from mlx-lm on an H100 (probe_layers: attention exact, the MLP's output 0.98 off).

    python -m tools.probe.probe_moe
"""

from __future__ import annotations

import sys
from pathlib import Path

import mlx.core as mx
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))


def main() -> int:
    from mlx_lm import load

    from tests.test_families import family_model

    model, _ = load(family_model("gpt-oss"))
    mlp = model.model.layers[0].mlp
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
