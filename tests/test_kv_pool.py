"""The KV pool's memory: growing commits only what is written, idle blocks go back at any
id, the books say what is committed, trimming waits for idleness, parity holds across."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
import time

import anyio
import mlx.core as mx
import numpy as np
import pytest

import unikern
from tests.conftest import compare_greedy, complete_all, reference_greedy
from unikern import messages as m
from unikern.platform import current_platform

GiB = 1 << 30
MiB = 1 << 20
cpu_only = pytest.mark.skipif(
    current_platform().backend != "cpu", reason="madvise and mincore reach MLX's CPU buffers only"
)

# Writes 2 GiB into an empty pool through the paged cache, as steps of the runner do,
# then gives it all back; prints /proc figures. A process of its own, so RSS is the pool's.
GROW_AND_RELEASE = textwrap.dedent("""
    import json
    import mlx.core as mx
    from unikern.stages.execute.layouts import BatchLayout
    from unikern.stages.execute.paged_cache import PagedLayerCache
    from unikern.stages.kv.pool import KVPool

    def status():
        fields = dict(line.split(":", 1) for line in open("/proc/self/status"))
        return {k: int(fields[k].split()[0]) * 1024 for k in ("VmRSS", "VmHWM")}

    L, H, D, bs = 8, 4, 64, 256
    pool = KVPool(num_layers=L, num_kv_heads=H, head_dim=D, dtype=mx.float16, block_size=bs,
                  kernel_block_size=16, num_blocks=2 + (2 << 30) // (2 * L * H * D * 2 * bs), slab_blocks=32)
    out = {"start": status(), "resident_start": pool.resident_bytes}
    for first in range(2, pool.num_blocks, 4):
        blocks = list(range(first, min(first + 4, pool.num_blocks)))
        if first % 8 == 2:  # one row over consecutive blocks: written through a slice
            rows = [(tuple(blocks), 0, bs * len(blocks))]
        else:  # one row per block: scattered
            rows = [((b,), 0, bs) for b in blocks]
        pool.ensure_capacity(max(blocks) + 1)
        layout = BatchLayout.build(pool, rows)
        new = mx.ones((len(rows), H, layout.num_tokens, D), dtype=mx.float16)
        for layer in range(L):
            PagedLayerCache(pool, layer, layout).update_and_fetch(new, new)
        mx.eval(pool.keys, pool.values)
    out.update(grown=status(), written=(pool.num_blocks - 2) * pool.bytes_per_block,
               resident_grown=pool.resident_bytes, blocks_grown=pool.committed_blocks())
    out["released"] = pool.release(keep=())
    out.update(after=status(), resident_after=pool.resident_bytes, blocks_after=pool.committed_blocks(),
               relocations=pool.relocations)
    print(json.dumps(out))
""")


@cpu_only
def test_growing_to_2_gib_peaks_at_the_final_size_and_release_returns_it():
    proc = subprocess.run([sys.executable, "-c", GROW_AND_RELEASE], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    grown, after = out["grown"], out["after"]
    assert out["resident_start"] == 0
    assert grown["VmRSS"] - out["start"]["VmRSS"] >= 0.95 * out["written"]  # the writes did land
    # no copy while growing: the peak is the final size, not old + new
    assert grown["VmHWM"] <= 1.15 * grown["VmRSS"], {k: v / GiB for k, v in grown.items()}
    # the books say what is committed: the written blocks, not the virtual size
    assert abs(out["resident_grown"] - out["written"]) <= 0.01 * out["written"]
    assert out["blocks_grown"] == out["written"] // (2 * 8 * 4 * 64 * 2 * 256)
    # given back: the process's memory drops by what was written, and the books say zero
    assert grown["VmRSS"] - after["VmRSS"] >= 0.95 * out["written"], (grown["VmRSS"] / GiB, after["VmRSS"] / GiB)
    assert out["released"] >= 0.99 * out["written"]
    assert out["resident_after"] == 0 and out["blocks_after"] == 0
    assert out["relocations"] == 0


@cpu_only
def test_release_frees_blocks_at_any_id_and_keeps_the_named_ones():
    import mlx.core as mx

    from unikern.stages.kv.pool import KVPool

    # a block of one head is 4 KiB (one page): each block's memory is its own
    pool = KVPool(num_layers=2, num_kv_heads=2, head_dim=32, dtype=mx.float32, block_size=32,
                  kernel_block_size=16, num_blocks=64, slab_blocks=8)
    assert pool.resident_bytes == 0 and pool.committed_blocks() == 0
    written = [2, 3, 4, 40, 62, 63]
    slots = mx.array([b * 32 + i for b in written for i in range(32)])
    for arrays in (pool.keys, pool.values):
        for layer in range(2):
            arrays[layer][:, slots] = mx.full((2, len(slots), 32), 1.0 + layer)
    mx.eval(pool.keys, pool.values)
    assert pool.committed_blocks() == len(written)
    assert pool.resident_bytes == len(written) * pool.bytes_per_block
    keep = {3, 62}  # e.g. prefix-cache blocks, one of them near the top
    released = pool.release(keep)
    assert released == (len(written) - len(keep)) * pool.bytes_per_block
    assert pool.committed_blocks() == len(keep)
    assert pool.resident_bytes == len(keep) * pool.bytes_per_block
    for layer in range(2):
        for block in written:
            expected = 1.0 + layer if block in keep else 0.0
            for array in (pool.keys[layer], pool.values[layer]):
                assert mx.all(array[:, block * 32 : (block + 1) * 32] == expected).item(), (layer, block)
    # a released block is written again like a fresh one
    pool.keys[0][:, 40 * 32 : 41 * 32] = mx.full((2, 32, 32), 7.0)
    mx.eval(pool.keys[0])
    assert mx.all(pool.keys[0][:, 40 * 32 : 41 * 32] == 7.0).item()
    assert pool.relocations == 0


def test_idle_trim_decisions():
    from unikern.stages.kv.service import IdleTrim

    trim = IdleTrim(idle_seconds=2.0, drop_cache_seconds=10.0)
    assert trim.decide(0.0, 0, 0) is None  # nothing written yet
    assert trim.decide(100.0, 0, 0) is None
    # a request runs: however long it takes, nothing is given back while blocks are in use
    for t in range(101, 200):
        assert trim.decide(float(t), 3, 7 + t // 10) is None
    assert trim.decide(200.0, 3, 7 + 20) is None
    assert trim.decide(201.0, 0, 7 + 20) is None  # idle from here
    assert trim.decide(202.9, 0, 7 + 20) is None
    assert trim.decide(203.0, 0, 7 + 20) == "free"
    assert trim.decide(205.0, 0, 7 + 20) is None  # once per idle spell
    assert trim.decide(211.0, 0, 7 + 20) == "all"
    assert trim.decide(300.0, 0, 7 + 20) is None
    # blocks taken without a step yet (a request waiting on the model thread) reset the clock
    assert trim.decide(301.0, 0, 28) is None
    assert trim.decide(302.0, 1, 28) is None
    assert trim.decide(303.5, 0, 28) is None
    assert trim.decide(304.0, 0, 28) is None
    assert trim.decide(305.5, 0, 28) == "free"
    keep = IdleTrim(idle_seconds=0.0, drop_cache_seconds=None)  # keep the prefix cache
    assert keep.decide(0.0, 0, 1) is None
    assert [keep.decide(t, 0, 1) for t in (1.0, 2.0, 3.0, 1000.0)] == [None, "free", None, None]


def kv_of(engine):
    return engine._router.stages["kv"].kv


async def wait_for_release(engine, count: int) -> None:
    for _ in range(3000):  # liveness only: up to a minute for what takes well under a second
        if kv_of(engine).pool.shrink_events >= count:
            return
        await anyio.sleep(0.02)
    raise AssertionError(f"the pool gave memory back {kv_of(engine).pool.shrink_events} times, expected {count}")


@cpu_only
@pytest.mark.anyio
async def test_trimming_waits_until_no_request_is_in_flight(tiny_llama):
    bytes_per_block = 2 * 4 * 16 * 2 * 32 * 4  # tiny-llama: layers x block x kv heads x head dim x f32
    overrides = {
        "kv": {"kv_budget_bytes": 64 << 20, "block_size": 16, "kernel_block_size": 16,
               "slab_bytes": bytes_per_block, "idle_trim_seconds": 0.0, "idle_drop_cache_seconds": None},
        "schedule": {"decode_lookahead": 2},
    }
    async with unikern.Engine.from_pipeline("generate", model=tiny_llama, overrides=overrides) as engine:
        pool = kv_of(engine).pool
        # a short request finishes first, leaving free blocks while the long one goes on
        short = [(3 * j) % 900 + 9 for j in range(40)]
        seen: list[tuple[int, int]] = []

        async def long_request():
            async for event in engine.generate(prompt_tokens=[5, 6, 7], max_tokens=200, temperature=0.0):
                if isinstance(event, m.TokenEvent):
                    seen.append((pool.shrink_events, kv_of(engine).blocks.num_used))

        async with anyio.create_task_group() as tg:
            tg.start_soon(long_request)
            await engine.complete(prompt_tokens=short, max_tokens=2)
        in_flight = [releases for releases, used in seen if used]
        assert len(in_flight) >= 150 and in_flight[0] == in_flight[-1], "memory given back mid-request"
        await wait_for_release(engine, in_flight[-1] + 1)  # and once idle, it is
        stats = engine.stats()
    assert stats["kv"]["blocks_used"] == 0
    assert stats["memory"]["kv_resident_bytes"] <= stats["kv"]["blocks_cached"] * bytes_per_block


@cpu_only
@pytest.mark.anyio
async def test_parity_across_release_and_reuse(tiny_llama):
    """Requests before and after the pool gave its memory back, with prefix hits on kept
    blocks and fresh writes on released ones, on a budget that forces preemption."""
    bytes_per_block = 2 * 4 * 32 * 2 * 32 * 4
    overrides = {
        "kv": {"kv_budget_bytes": 12 * bytes_per_block, "block_size": 32, "kernel_block_size": 16,
               "slab_bytes": 2 * bytes_per_block, "idle_trim_seconds": 0.0, "idle_drop_cache_seconds": None},
        "schedule": {"max_num_batched_tokens": 64, "decode_lookahead": 4},
    }
    prefix = [(11 * j) % 900 + 7 for j in range(70)]
    waves = [
        [prefix + [20 + i] for i in range(4)] + [[(5 * i + 3 * j) % 900 + 9 for j in range(20 + 9 * i)] for i in range(4)],
        [prefix + [40 + i] for i in range(3)] + [[(7 * i + 2 * j) % 900 + 9 for j in range(33 + 5 * i)] for i in range(3)],
    ]
    async with unikern.Engine.from_pipeline("generate", model=tiny_llama, overrides=overrides) as engine:
        results = []
        for wave, prompts in enumerate(waves):
            with anyio.fail_after(120):
                results.append(await complete_all(engine, prompts, 16))
            await wait_for_release(engine, wave + 1)
            assert engine.stats()["memory"]["kv_resident_bytes"] <= kv_of(engine).blocks.num_cached * bytes_per_block
        stats = engine.stats()
    assert stats["schedule"]["preemptions"] > 0
    assert sum(r.usage.cached_tokens for r in results[1]) >= 3 * 64  # hits on blocks kept across the release
    for prompts, wave_results in zip(waves, results, strict=True):
        for prompt, result in zip(prompts, wave_results, strict=True):
            ok, note = compare_greedy(result.token_ids, reference_greedy(tiny_llama, prompt, 16))
            assert ok, note


# A worker with a 256 MiB pool: RSS after a burst of requests and after the idle trim
# that drops the prefix cache too.
def worker_memory_around_idle(model: str) -> tuple[dict, dict]:
    proc = subprocess.Popen(
        [sys.executable, "-m", "unikern", "worker", "--model", model,
         "--set", f"kv.kv_budget_bytes={256 << 20}", "--set", "kv.idle_trim_seconds=0.2",
         "--set", "kv.idle_drop_cache_seconds=0.5"],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
    )
    assert json.loads(proc.stdout.readline())["event"] == "ready"

    def send(op: dict) -> None:
        proc.stdin.write(json.dumps(op) + "\n")
        proc.stdin.flush()

    def stats() -> dict:
        send({"op": "stats"})
        while (event := json.loads(proc.stdout.readline()))["event"] != "stats":
            pass
        return event

    for i in range(8):
        send({"op": "generate", "id": f"r{i}", "prompt_tokens": [(i + 7 * j) % 900 + 5 for j in range(2000)],
              "max_tokens": 4})
    done = 0
    while done < 8:
        done += json.loads(proc.stdout.readline())["event"] == "done"
    busy = stats()
    deadline = time.monotonic() + 60  # liveness only: the trim comes within a second or so
    while (idle := stats())["kv"]["blocks_cached"] or idle["memory"]["kv_resident_bytes"]:
        assert time.monotonic() < deadline, idle["kv"]
        time.sleep(0.05)
    # the process' RSS a few times more once the books say zero: the lowest, so that a
    # moment's allocation elsewhere in the worker is not read as KV memory kept
    samples = [idle["memory"]["rss_bytes"]]
    for _ in range(4):
        time.sleep(0.1)
        samples.append(stats()["memory"]["rss_bytes"])
    idle["rss_samples"] = samples
    idle["memory"]["rss_bytes"] = min(samples)
    proc.stdin.close()
    assert proc.wait(60) == 0
    proc.stdout.close()
    return busy, idle


@cpu_only
def test_idle_worker_gives_its_kv_memory_back(tiny_llama):
    busy, idle = worker_memory_around_idle(tiny_llama)
    written = 8 * 2000 * 2 * 4 * 2 * 32 * 4  # tokens x (K and V, layers, kv heads, head dim, f32)
    assert busy["memory"]["kv_resident_bytes"] >= 0.9 * written
    assert idle["kv"]["blocks_cached"] == 0 and idle["memory"]["kv_resident_bytes"] == 0
    dropped = busy["memory"]["rss_bytes"] - idle["memory"]["rss_bytes"]
    assert dropped >= 0.9 * busy["memory"]["kv_resident_bytes"], (
        f"RSS dropped by {dropped / MiB:.1f} MiB: busy {busy['memory']['rss_bytes'] / MiB:.1f} MiB, "
        f"idle {[round(r / MiB, 1) for r in idle['rss_samples']]} MiB")


def test_slab_pools_grow_and_shrink_through_power_of_two_capacities():
    """Each capacity is a shape the compiled steps trace anew: a slab pool meets few, and
    the same ones whenever it grows back."""
    import mlx.core as mx

    from unikern.stages.kv.pool import KVPool

    pool = KVPool(num_layers=1, num_kv_heads=1, head_dim=4, dtype=mx.float32, block_size=4, kernel_block_size=4,
                  num_blocks=100, slab_blocks=3, backend="metal")
    seen = []
    for blocks in (1, 4, 7, 8, 13, 25, 40, 49, 99, 100):
        pool.ensure_capacity(blocks)
        seen.append(pool.capacity_blocks)
    assert seen == [3, 6, 12, 12, 24, 48, 48, 96, 100, 100]
    assert pool.keys[0].shape[1] == 100 * 4
    pool.release(keep=[10])  # blocks 0-10 stay: 11 blocks, 4 slabs' class
    assert pool.capacity_blocks == 12
    pool.release()
    assert pool.capacity_blocks == 0
    pool.ensure_capacity(5)
    assert pool.capacity_blocks == 6


def test_slot_rows_reads_the_pool_at_the_slots_in_the_token_ids_dtype():
    """slot_rows gives pool[:, slots] by one single-index gather whose indices are in the
    token ids' dtype (on CUDA, MLX compiles a gather kernel per index dtype and count)."""
    from unikern.stages.execute.paged_cache import TOKEN_DTYPE
    from unikern.stages.kv.pool import SLOT_INDEX_DTYPE, slot_rows

    assert SLOT_INDEX_DTYPE == TOKEN_DTYPE
    pool = mx.arange(3 * 10 * 4, dtype=mx.float32).reshape(3, 10, 4)
    slots = mx.array([[9, 0, 4], [2, 2, 7]], dtype=mx.int32)
    got = slot_rows(pool, slots)
    assert got.shape == (3, 2, 3, 4)
    np.testing.assert_array_equal(np.array(got), np.array(pool)[:, np.array(slots)])
