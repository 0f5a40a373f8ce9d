"""Whether a prompt chunk's keys and values reach the pool: a fresh prompt's chunk run
through the runner, sampled or not, traced (compile_prefill) or built op by op, with the
pool write kernel on (WRITE_IN_PLACE, CUDA) and with MLX's scatter, then every layer's
pool at the chunk's slots against the scatter's. The write kernel writes the pool arrays
in place, which MLX does not see: whatever reads them back must take its marker, and a
chunk that samples nothing evaluates only the pool arrays themselves.

    python -m tools.probe.probe_pool_writes [--tokens 512]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[2]


def pool_after(model, tokens: list[int], sample: bool, compiled: bool, in_place: bool) -> list[np.ndarray]:
    import mlx.core as mx

    from unikern import messages as m
    from unikern.stages.execute import paged_cache
    from unikern.stages.execute.layouts import block_slots
    from unikern.stages.execute.model import ModelGeometry
    from unikern.stages.execute.runner import ModelRunner
    from unikern.stages.kv.pool import KVPool

    paged_cache.WRITE_IN_PLACE = in_place
    geo = ModelGeometry(model)
    bs = 256
    n = -(-len(tokens) // bs)
    # blocks in descending order: not consecutive, so the forward writes by slots (the
    # kernel), not through slices as one row over consecutive blocks would
    blocks = tuple(range(1 + n, 1, -1))
    pool = KVPool(num_layers=geo.num_layers, num_kv_heads=geo.num_kv_heads, head_dim=geo.head_dim, dtype=geo.dtype,
                  block_size=bs, kernel_block_size=16, num_blocks=2 + n, slab_blocks=2 + n)
    runner = ModelRunner(model, pool, paged_attention=True, geometry=geo, compile_decode=True,
                         compile_prefill=compiled)
    params = m.SamplingParams(max_tokens=4)
    runner.run(m.Step(0, (m.SeqWork("a", tuple(tokens), 0, blocks, sample, params),), 1), {})
    slots = mx.array(block_slots(blocks, bs)[: len(tokens)])
    return [np.array(a[:, slots].astype(mx.float32)) for a in pool.keys + pool.values]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, default=512)
    args = parser.parse_args()
    sys.path.insert(0, str(REPO))
    import mlx.core as mx
    from mlx_lm import load

    from unikern.testing.modelgen import cached_model

    model, _ = load(str(cached_model("tiny-llama")))
    tokens = [(11 * j) % 1000 + 7 for j in range(args.tokens)]
    want = pool_after(model, tokens, True, False, in_place=False)
    print(f"device {mx.default_device()}, {args.tokens} tokens; max |pool - MLX scatter's| over the layers:")
    for compiled in (False, True):
        for sample in (True, False):
            got = pool_after(model, tokens, sample, compiled, in_place=True)
            worst = max(float(np.max(np.abs(g - w))) for g, w in zip(got, want, strict=True))
            zero = sum(int(not g.any()) for g in got)
            print(f"  {'traced' if compiled else 'op by op'}, {'sampled' if sample else 'unsampled'}: "
                  f"{worst:.3g} ({zero} of {len(got)} layer arrays all zeros)", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
