"""Per-token cost of single-stream decode: mlx-lm's generate loop against unikern's
ModelRunner, and the runner with one piece changed at a time, in one process.

    python -m tools.probe.profile_decode --model llama-80m [--tokens 64] [--repeats 5] [--json out.json]

Rows (ms per token, median of repeats; lower is better):
  mlx-lm generate_step      mlx_lm.generate.generate_step, greedy, dense KVCache
  runner                    ModelRunner.run on decode_lookahead windows of 32, as the engine runs it
  runner, big pool          the same with the pool grown to 64x the blocks the request uses
                            (does writing one slot cost the whole layer array?)
  runner, no pool writes    the adapter skips its two slice updates (wrong tokens; timing only)
  forward only              the runner's forward and argmax with one layout reused, no sampling
                            params, no per-step layout or adapter objects
  mlx-lm, head-major cache  mlx-lm's loop with a cache that keeps each layer's keys/values
                            as unikern's pool does, [kv_heads, slots, head_dim] (one row
                            written per token through a slice), instead of [1, H, S, D]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="llama-5m", help="a modelgen preset or a model directory")
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--prompt", type=int, default=64, help="prompt tokens before decoding")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--json")
    args = parser.parse_args()

    import unikern.platform.blas

    unikern.platform.blas.preload()  # before mlx loads, as the engine does

    import mlx.core as mx
    from mlx_lm import load
    from mlx_lm.generate import generate_step

    from unikern import messages as m
    from unikern.stages.execute import layouts, paged_cache
    from unikern.stages.execute.model import ModelGeometry
    from unikern.stages.execute.runner import ModelRunner
    from unikern.stages.kv.pool import KVPool
    from unikern.testing.modelgen import cached_model

    path = args.model if Path(args.model).exists() else str(cached_model(args.model))
    model, _ = load(path)
    geo = ModelGeometry(model)
    prompt = [(7 * j) % 1000 + 5 for j in range(args.prompt)]
    block_size = 16
    used_blocks = -(-(args.prompt + args.tokens + 1) // block_size)

    def mlx_lm_run() -> float:
        start = time.perf_counter()
        for _ in zip(range(args.tokens), generate_step(mx.array(prompt), model, max_tokens=args.tokens), strict=False):
            pass
        return time.perf_counter() - start

    def make_runner(pool_blocks: int) -> ModelRunner:
        pool = KVPool(num_layers=geo.num_layers, num_kv_heads=geo.num_kv_heads, head_dim=geo.head_dim,
                      dtype=geo.dtype, block_size=block_size, kernel_block_size=16,
                      num_blocks=pool_blocks + 2, slab_blocks=pool_blocks + 2)
        return ModelRunner(model, pool, None, cpu_kernels=mx.default_device() == mx.cpu)

    def runner_run(pool_blocks: int) -> float:
        runner = make_runner(pool_blocks)
        table = tuple(range(2, 2 + used_blocks))
        params = m.SamplingParams(max_tokens=args.tokens)
        start = time.perf_counter()
        out = runner.run(m.Step(1, (m.SeqWork("r", tuple(prompt), 0, table, True, params),), 1), {})
        last, pos, done = out["r"][-1], len(prompt), 1
        while done < args.tokens:
            k = min(32, args.tokens - done)
            work = m.SeqWork("r", (last,), pos, table, True, params, num_generated=done)
            out = runner.run(m.Step(2, (work,), k), {})
            last, pos, done = out["r"][-1], pos + k, done + k
        return time.perf_counter() - start

    def without_writes(fn):
        original = paged_cache.PagedLayerCache.update_and_fetch

        def update_and_fetch(self, keys, values):
            lay = self.layout
            if lay.span is not None:
                base, _, end = lay.span
                return self.pool.keys[self.layer][None, :, base : base + end], self.pool.values[self.layer][None, :, base : base + end]
            return original(self, keys, values)

        paged_cache.PagedLayerCache.update_and_fetch = update_and_fetch
        try:
            return fn()
        finally:
            paged_cache.PagedLayerCache.update_and_fetch = original

    def forward_only() -> float:
        runner = make_runner(used_blocks)
        pool = runner.pool
        pool.ensure_capacity(used_blocks + 2)
        table = tuple(range(2, 2 + used_blocks))
        token = mx.array([[5]], dtype=mx.int32)
        start = time.perf_counter()
        outs = []
        for i in range(args.tokens):
            layout = layouts.BatchLayout.build(pool, [(table, len(prompt) + i, 1)])
            logits = model(token, cache=runner._caches(layout))[:, -1, :]
            token = mx.argmax(logits, axis=-1)[:, None]
            mx.async_eval(token)
            outs.append(token)
        mx.eval(outs)
        return time.perf_counter() - start

    class HeadMajorCache:
        """mlx-lm's KVCache contract over [H, S, D] arrays, written as the pool is."""

        def __init__(self) -> None:
            shape = (geo.num_kv_heads, args.prompt + args.tokens + 16, geo.head_dim)
            self.keys, self.values = mx.zeros(shape, geo.dtype), mx.zeros(shape, geo.dtype)
            self.offset = 0

        def update_and_fetch(self, keys, values):
            _, H, T, D = keys.shape
            start, self.offset = self.offset, self.offset + T
            self.keys[:, start : self.offset] = keys.reshape(H, T, D)
            self.values[:, start : self.offset] = values.reshape(H, T, D)
            return self.keys[None, :, : self.offset], self.values[None, :, : self.offset]

        def make_mask(self, N, return_array=False, window_size=None):
            return "causal" if N > 1 else None

        @property
        def state(self):
            return self.keys, self.values

        def is_trimmable(self):
            return False

    def mlx_lm_head_major() -> float:
        cache = [HeadMajorCache() for _ in range(geo.num_layers)]
        mx.eval([c.state for c in cache])
        start = time.perf_counter()
        steps = generate_step(mx.array(prompt), model, max_tokens=args.tokens, prompt_cache=cache)
        for _ in zip(range(args.tokens), steps, strict=False):
            pass
        return time.perf_counter() - start

    variants = {
        "mlx-lm generate_step": mlx_lm_run,
        "runner": lambda: runner_run(used_blocks),
        "runner, big pool": lambda: runner_run(64 * used_blocks),
        "runner, no pool writes": lambda: without_writes(lambda: runner_run(used_blocks)),
        "forward only": forward_only,
        "mlx-lm, head-major cache": mlx_lm_head_major,
    }
    for fn in variants.values():  # warm-up: first graphs, kernels compiled for these shapes
        fn()
    times: dict[str, list[float]] = {name: [] for name in variants}
    for _ in range(args.repeats):  # interleaved, so noise hits every variant alike
        for name, fn in variants.items():
            times[name].append(fn() / args.tokens * 1e3)
    rows = {name: statistics.median(t) for name, t in times.items()}
    print(f"model {args.model}: {args.prompt}-token prompt, {args.tokens} tokens, device {mx.default_device()}")
    base = rows["mlx-lm generate_step"]
    for name, ms in rows.items():
        print(f"  {name:<26} {ms:7.3f} ms/token   {ms / base:5.2f}x mlx-lm")
    if args.json:
        Path(args.json).write_text(json.dumps({"model": args.model, "device": str(mx.default_device()),
                                               "ms_per_token": rows, "all": times}, indent=1))


if __name__ == "__main__":
    main()
