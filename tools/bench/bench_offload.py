"""Time to first token from each KV tier, disk throughput and compression, in one run.

    python -m tools.bench.bench_offload [--preset llama-5m] [--prompt-tokens 2048] [--repeats 3] [--json out.json]

TTFT (a generate call to its first token event) of a 2048-token prompt:
  cold            nothing cached: the whole prompt is computed (the best of the plain
                  `generate` pipeline and `generate-offload`, whose stores run alongside)
  device          the same prompt again in the same engine: its blocks are in the pool
  host            its blocks were pushed out of a one-sequence KV budget by another
                  prompt and sit in the host tier: they come back by accounting
  disk, restart   a fresh Engine (a new process would load the same files) on the disk
                  tier the cold run filled: the blocks are read, checked, decompressed
                  and copied into the pool before the request is scheduled
Every engine first serves a short unrelated prompt, so one-time costs (first graph, first
pool slab) count in none of the rows. Ratios are cold / tier (higher is better).

Disk: write and read MB/s of the block format end to end (byte shuffle, zstd, checks,
one file per block, single thread) on KV blocks a real forward pass left in the pool,
and the compression ratio of those blocks for a float16 and a bfloat16 model; plus
what copying a block out of the pool costs on the model thread against compressing it
(why the mover copies on the model thread and compresses off it).
"""

from __future__ import annotations

import argparse
import json
import random
import shutil
import statistics
import tempfile
import time
from pathlib import Path

SPEC = dict(family="llama", hidden_size=128, num_layers=2, num_heads=4, num_kv_heads=2,
            intermediate_size=256, vocab_size=1024, max_position_embeddings=4096,
            dtype="bfloat16", tie_word_embeddings=False, seed=1)
BLOCK = 256


def prompt(seed: int, n: int, vocab: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(5, vocab - 5) for _ in range(n)]


async def ttft(engine, tokens: list[int]) -> tuple[float, int]:
    """Seconds to the first token event, and the cached tokens the request reported."""
    import contextlib

    from unikern import messages as m

    start = time.perf_counter()
    first = None
    cached = 0
    async with contextlib.aclosing(engine.generate(prompt_tokens=tokens, max_tokens=1)) as events:
        async for event in events:
            if isinstance(event, m.TokenEvent) and first is None:
                first = time.perf_counter() - start
            elif isinstance(event, m.DoneEvent):
                cached = event.usage.cached_tokens
    return first, cached


TOKEN_BUDGET: int | None = None  # schedule.max_num_batched_tokens; None: the pipeline's


def engine(pipeline: str, model: str, disk: Path | None, **kv):
    import unikern

    overrides = {"kv": {"kv_budget_bytes": 64 << 20, **kv}}
    if TOKEN_BUDGET is not None:
        overrides["schedule"] = {"max_num_batched_tokens": TOKEN_BUDGET}
    if disk is not None:
        overrides["disk"] = {"path": str(disk)}
    return unikern.Engine.from_pipeline(pipeline, model=model, overrides=overrides)


async def drain(eng) -> None:
    import anyio

    while eng.stats().get("offload", {}).get("queued_blocks") or eng.stats().get("offload", {}).get("inflight_blocks"):  # noqa: ASYNC110
        await anyio.sleep(0.02)


def spec_for(preset: str | None) -> dict:
    """The default 2-layer model, or a modelgen preset with room for the prompt, in bf16."""
    from unikern.testing.modelgen import PRESETS

    if preset is None:
        return dict(SPEC)
    return {**PRESETS[preset], "max_position_embeddings": 4096, "dtype": "bfloat16"}


async def tier_ttfts(spec: dict, model: str, n: int, repeats: int, root: Path) -> dict:
    vocab = spec["vocab_size"]
    head_dim = spec["hidden_size"] // spec["num_heads"]
    bytes_per_block = 2 * spec["num_layers"] * BLOCK * spec["num_kv_heads"] * head_dim * 2
    rows: dict[str, list[float]] = {"cold_plain": [], "cold_offload": [], "device": [], "host": [], "disk": []}
    cached: dict[str, list[int]] = {k: [] for k in rows}
    warm = prompt(999, 32, vocab)
    prompts = [prompt(i, n, vocab) for i in range(repeats)]

    async with engine("generate", model, None) as eng:
        await ttft(eng, warm)
        for p in prompts:
            t, c = await ttft(eng, p)
            rows["cold_plain"].append(t)
            cached["cold_plain"].append(c)

    # one sequence of device budget (plus a spare block) and a host tier: a second long
    # prompt pushes the first one's blocks to the host tier
    one_seq = (n // BLOCK + 2) * bytes_per_block
    for i, p in enumerate(prompts):
        disk = root / f"disk-{i}"
        async with engine("generate-offload", model, disk, kv_budget_bytes=one_seq,
                          host_bytes=64 * bytes_per_block) as eng:
            await ttft(eng, warm)
            t, c = await ttft(eng, p)
            rows["cold_offload"].append(t)
            cached["cold_offload"].append(c)
            t, c = await ttft(eng, p)
            rows["device"].append(t)
            cached["device"].append(c)
            await ttft(eng, prompt(1000 + i, n, vocab))  # pushes p's blocks to the host tier
            host_hits = eng.stats()["tiers"]["host"]["hits"]
            t, c = await ttft(eng, p)
            assert eng.stats()["tiers"]["host"]["hits"] > host_hits, "expected host-tier hits"
            rows["host"].append(t)
            cached["host"].append(c)
            await drain(eng)
        async with engine("generate-offload", model, disk) as eng:  # the restart
            await ttft(eng, warm)
            t, c = await ttft(eng, p)
            rows["disk"].append(t)
            cached["disk"].append(c)
            stats = eng.stats()
    result = {k: statistics.median(v) for k, v in rows.items()}
    result["cold"] = min(result["cold_plain"], result["cold_offload"])
    result["cached_tokens"] = {k: v[-1] for k, v in cached.items()}
    result["restart_offload_stats"] = stats["offload"]
    return result


async def capture_blocks(model: str, n: int, vocab: int, root: Path) -> tuple[list, object]:
    """KV blocks a real forward pass of an n-token prompt leaves in the pool."""
    from unikern.platform import shared_bridge
    from unikern.stages.tiers.block_io import BlockLayout, copy_out

    async with engine("generate-offload", model, root) as eng:
        tokens = prompt(7, n, vocab)
        await eng.complete(prompt_tokens=tokens, max_tokens=1)
        kv = eng._router.stages["kv"].kv
        ids = [kv.blocks.hash_to_block[h] for h in kv.blocks.prefix_hashes(tokens)]
        layout = BlockLayout.of(kv.pool)
        buffers = [layout.new_buffer() for _ in ids]
        thread = eng._router.resources["model"].thread
        bridge = shared_bridge()
        await thread.run(copy_out, kv.pool, bridge, ids, buffers)  # warm
        copies = []
        for _ in range(5):
            start = time.perf_counter()
            await thread.run(copy_out, kv.pool, bridge, ids, buffers)
            copies.append((time.perf_counter() - start) / len(ids))
        hashes = kv.blocks.prefix_hashes(tokens)
    return list(zip(hashes, buffers, strict=True)), (layout, min(copies))


def disk_throughput(blocks, layout, root: Path, level: int) -> dict:
    from unikern.stages.tiers.disk.store import DiskStore

    store = DiskStore(root, "bench", 1 << 34, level=level)
    raw = sum(b.nbytes for _, b in blocks)
    start = time.perf_counter()
    for h, b in blocks:
        store.put(h, b, dtype=layout.dtype, shape=layout.shape, token_count=layout.block_size)
    write_s = time.perf_counter() - start
    out = layout.new_buffer()
    start = time.perf_counter()
    for h, b in blocks:
        assert store.get(h, out=out) is not None
        assert out.tobytes() == b.tobytes(), "decompression is not byte-exact"
    read_s = time.perf_counter() - start
    stats = store.stats()
    return {
        "write_MB_s": raw / write_s / 1e6,
        "read_MB_s": raw / read_s / 1e6,
        "compression_ratio": stats["compression_ratio"],
        "encode_s_per_block": write_s / len(blocks),
    }


async def bench(args) -> dict:
    from unikern.platform import current_platform
    from unikern.testing.modelgen import cached_model

    root = Path(tempfile.mkdtemp(prefix="unikern-bench-offload-"))
    try:
        spec = spec_for(args.preset)
        model = str(cached_model(spec))
        result = {"model": spec, "prompt_tokens": args.prompt_tokens, "blas": current_platform().blas,
                  "token_budget": args.token_budget}
        result["ttft"] = await tier_ttfts(spec, model, args.prompt_tokens, args.repeats, root)
        result["disk"] = {}
        for dtype in ("bfloat16", "float16"):
            dmodel = str(cached_model({**spec, "dtype": dtype}))
            blocks, (layout, copy_s) = await capture_blocks(dmodel, args.prompt_tokens, spec["vocab_size"], root / f"cap-{dtype}")
            row = disk_throughput(blocks, layout, root / f"tp-{dtype}", args.level)
            row["copy_out_s_per_block"] = copy_s
            row["block_bytes"] = layout.nbytes
            result["disk"][dtype] = row
    finally:
        shutil.rmtree(root, ignore_errors=True)
    return result


def report(r: dict) -> None:
    t = r["ttft"]
    print(f"model {r['model']['family']} {r['model']['num_layers']} layers x {r['model']['hidden_size']}, "
          f"{r['model']['dtype']}; prompt {r['prompt_tokens']} tokens; token budget "
          f"{r['token_budget'] or 'of the pipeline'}; BLAS {r['blas']}")
    print(f"{'TTFT':<16}{'seconds':>10}{'cached':>8}{'cold / tier':>13}")
    for name, key in [("cold (plain)", "cold_plain"), ("cold (offload)", "cold_offload"),
                      ("device tier", "device"), ("host tier", "host"), ("disk, restart", "disk")]:
        ratio = t["cold"] / t[key]
        print(f"{name:<16}{t[key]:>10.3f}{t['cached_tokens'][key]:>8}{ratio:>12.2f}x")
    print(f"{'disk KV':<10}{'ratio':>7}{'write MB/s':>12}{'read MB/s':>11}{'copy-out us':>13}{'encode us':>11}  (per {r['disk']['bfloat16']['block_bytes'] // 1024} KiB block)")
    for dtype, d in r["disk"].items():
        print(f"{dtype:<10}{d['compression_ratio']:>7.3f}{d['write_MB_s']:>12.1f}{d['read_MB_s']:>11.1f}"
              f"{d['copy_out_s_per_block'] * 1e6:>13.0f}{d['encode_s_per_block'] * 1e6:>11.0f}")
    verdict = "met" if t["cold"] / t["disk"] >= 3 else "NOT met"
    print(f"target: TTFT from disk after a restart >= 3x lower than cold: {t['cold'] / t['disk']:.2f}x ({verdict})")


def main() -> None:
    import anyio

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", help="a modelgen preset (run in bfloat16) instead of the 2-layer default")
    parser.add_argument("--prompt-tokens", type=int, default=2048)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--level", type=int, default=3, help="zstd level of the throughput rows")
    parser.add_argument("--token-budget", type=int, help="schedule.max_num_batched_tokens (prefill chunk)")
    parser.add_argument("--json", help="write the results here")
    args = parser.parse_args()
    global TOKEN_BUDGET
    TOKEN_BUDGET = args.token_budget
    result = anyio.run(bench, args)
    report(result)
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2, default=str))


if __name__ == "__main__":
    main()
