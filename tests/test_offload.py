"""The host tier and the offload mover: bookkeeping moves (no bytes), the tier planner,
the mover's queue, zero-copy block copies through the pool, and greedy parity under
memory pressure with many concurrent requests sharing prefixes."""

from __future__ import annotations

import random

import anyio
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.conftest import compare_greedy, reference_greedy
from tests.test_scheduler import Run, never_eos
from unikern import messages as m
from unikern.stages.kv.blocks import BlockManager, OutOfBlocks
from unikern.stages.schedule.policy import Scheduler
from unikern.stages.schedule.tier_planner import TierPlanner
from unikern.stages.tiers.queue import OffloadQueue

BS = 4
NS = b"test"


def committed_prompt(bm: BlockManager, tokens: list[int]) -> list[int]:
    """Allocate, commit every full block, free: the prompt's blocks end up cached."""
    blocks, _ = bm.allocate_prompt(tokens, len(tokens))
    for block_id, h in zip(blocks, bm.prefix_hashes(tokens), strict=False):
        bm.commit_full_block(block_id, h)
    bm.free(blocks)
    return blocks


def check_books(bm: BlockManager) -> None:
    """Every physical block is in exactly one state, and the budgets hold."""
    uncached, device, host = set(bm._free_uncached), set(bm._free_cached), set(bm._host_cached)
    referenced = {b for b in range(bm.reserved_blocks, len(bm.ref_counts)) if bm.ref_counts[b] > 0}
    states = [uncached, device, host, referenced]
    assert sum(map(len, states)) == bm.num_blocks + bm.host_blocks
    assert set().union(*states) == set(range(bm.reserved_blocks, len(bm.ref_counts)))
    assert len(referenced) + len(device) <= bm.num_blocks
    assert len(host) <= bm.host_blocks
    assert bm.num_used == len(referenced) and bm.num_free == bm.num_blocks - len(referenced)
    assert all(bm.block_hashes[b] is None for b in uncached)
    assert all(bm.block_hashes[b] is not None for b in device | host)
    assert {b for b in range(len(bm.ref_counts)) if bm.block_hashes[b] is not None} == set(bm.hash_to_block.values())


# ---- host tier: moves are bookkeeping ---------------------------------------------------


def test_evicted_cached_block_moves_to_host_and_comes_back_by_accounting():
    bm = BlockManager(2, BS, NS, host_blocks=4)
    a = list(range(10, 18))  # two full blocks
    blocks_a = committed_prompt(bm, a)
    # a new prompt needs both device blocks: a's cached blocks leave the device budget
    held = [bm.allocate_one(), bm.allocate_one()]
    assert set(held).isdisjoint(blocks_a)  # fresh physical blocks; a's bytes stay put
    assert [bm.is_on_host(b) for b in blocks_a] == [True, True]
    assert bm.lookup_prefix(bm.prefix_hashes(a)) == blocks_a  # still cached, same ids
    assert (bm.device_evictions, bm.evictions, bm.num_host_cached) == (2, 0, 2)
    check_books(bm)
    bm.free(held)
    blocks, cached = bm.allocate_prompt(a, 8)
    assert (blocks, cached) == (blocks_a, 8)  # the same blocks, no copy
    assert (bm.host_hits, bm.hits, bm.num_host_cached) == (2, 2, 0)
    check_books(bm)


def test_host_tier_is_lru_and_forgets_when_full():
    bm = BlockManager(1, BS, NS, host_blocks=2)
    prompts = [[i] * BS for i in range(1, 5)]
    for p in prompts:
        committed_prompt(bm, p)  # each pushes the previous one to the host tier
    check_books(bm)
    assert bm.num_host_cached == 2 and bm.host_evictions == 1 and bm.evictions == 1
    found = [bool(bm.lookup_prefix(bm.prefix_hashes(p))) for p in prompts]
    assert found == [False, True, True, True]  # the oldest was forgotten


def test_promotion_into_a_full_device_demotes_the_lru_device_block():
    bm = BlockManager(2, BS, NS, host_blocks=2)
    a, b, c = ([i] * BS for i in (1, 2, 3))
    committed_prompt(bm, a)
    committed_prompt(bm, b)
    committed_prompt(bm, c)  # device: b, c (a on host)
    hashes_a = bm.prefix_hashes(a)
    (block_a,) = bm.lookup_prefix(hashes_a)
    assert bm.is_on_host(block_a)
    bm.take([block_a])  # a pin brings it back; b (LRU) goes to the host
    (block_b,) = bm.lookup_prefix(bm.prefix_hashes(b))
    assert not bm.is_on_host(block_a) and bm.is_on_host(block_b)
    check_books(bm)
    bm.free([block_a])
    check_books(bm)


def test_prompt_that_does_not_fit_raises_and_leaves_host_blocks_alone():
    bm = BlockManager(2, BS, NS, host_blocks=2)
    a = list(range(8))
    blocks_a = committed_prompt(bm, a)
    held = [bm.allocate_one(), bm.allocate_one()]  # a on host now
    with pytest.raises(OutOfBlocks):
        bm.allocate_prompt(a + [9], 8)  # 2 host hits + 1 fresh: no device room
    assert all(bm.is_on_host(b) for b in blocks_a)
    check_books(bm)
    bm.free(held)
    assert bm.allocate_prompt(a, 8) == (blocks_a, 8)  # both come back from the host


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.data())
def test_random_use_keeps_the_books(data):
    bm = BlockManager(data.draw(st.integers(1, 5)), 2, NS, host_blocks=data.draw(st.integers(0, 4)))
    held: list[list[int]] = []
    tokens = st.lists(st.integers(0, 2), min_size=1, max_size=10)
    for _ in range(data.draw(st.integers(1, 40))):
        action = data.draw(st.sampled_from(["prompt", "commit_free", "free", "pin"]))
        if action in ("prompt", "commit_free"):
            t = data.draw(tokens)
            try:
                blocks, _ = bm.allocate_prompt(t, len(t) - 1)
            except OutOfBlocks:
                continue
            if action == "commit_free":
                for block_id, h in zip(blocks, bm.prefix_hashes(t), strict=False):
                    bm.commit_full_block(block_id, h)
                bm.free(blocks)
            else:
                held.append(blocks)
        elif action == "free" and held:
            bm.free(held.pop(data.draw(st.integers(0, len(held) - 1))))
        elif action == "pin" and bm.hash_to_block:
            block_id = data.draw(st.sampled_from(sorted(bm.hash_to_block.values())))
            if bm.can_allocate(0, [block_id]):
                bm.take([block_id])
                held.append([block_id])
        check_books(bm)


# ---- the scheduler over a fake pool with a host tier -----------------------------------


def workload_run(host_blocks: int, seed: int) -> Run:
    """Requests over a few shared prefixes, interleaved so a prefix is evicted from a
    two-sequence device budget before it comes back."""
    rng = random.Random(seed)
    blocks = BlockManager(8, BS, NS, host_blocks=host_blocks)
    run = Run(Scheduler(blocks, max_num_seqs=2, max_num_batched_tokens=16, eos_token_ids=[0],
                        context_length=4096), never_eos)
    heads = [[1 + (7 * g + i) % 60 for i in range(3 * BS)] for g in range(4)]
    for i in range(16):
        tail = [rng.randrange(1, 60) for _ in range(rng.randrange(1, 6))]
        run.add(f"r{i}", heads[i % 4] + tail, max_tokens=3)
    return run


@pytest.mark.parametrize("seed", range(4))
def test_host_tier_gives_the_same_tokens_and_more_cached_tokens(seed):
    # the fake pool checks every reused block still holds the right tokens
    without, with_host = workload_run(0, seed), workload_run(16, seed)
    without.drain()
    with_host.drain()
    assert {r: with_host.generated(r) for r in with_host.tokens} == {r: without.generated(r) for r in without.tokens}
    cached = [sum(f.usage.cached_tokens for f in run.finished.values()) for run in (without, with_host)]
    assert cached[1] > cached[0], cached
    assert with_host.sched.blocks.host_hits > 0
    check_books(with_host.sched.blocks)


# ---- the tier planner ------------------------------------------------------------------


def make_planner(num_blocks=16, host_blocks=0):
    bm = BlockManager(num_blocks, BS, NS, host_blocks=host_blocks)
    on_disk: set[bytes] = set()
    return bm, on_disk, TierPlanner(bm, on_disk.__contains__)


def request(rid: str, tokens: list[int]) -> m.Tokenized:
    return m.Tokenized(rid, tuple(tokens), m.SamplingParams(max_tokens=2))


def test_planner_holds_a_prompt_that_continues_on_disk_and_loads_after_the_hits():
    bm, on_disk, planner = make_planner()
    tokens = list(range(1, 18))  # 4 full blocks, the 5th has the last token
    hashes = bm.prefix_hashes(tokens)
    committed_prompt(bm, tokens[:BS])  # block 0 on the device, not yet on disk
    store = planner.plan_store()
    assert [ref.block_hash for ref in store.blocks] == hashes[:1]
    planner.stored(store)
    on_disk.update(hashes[1:3])  # blocks 1, 2 on disk; block 3 nowhere
    hold, load = planner.plan_load(request("r", tokens))
    assert hold and [ref.block_hash for ref in load.blocks] == hashes[1:3]
    (hit,) = bm.lookup_prefix(hashes[:1])
    assert bm.ref_counts[hit] == 1  # pinned so loading cannot evict it
    assert all(bm.ref_counts[ref.block_id] == 1 for ref in load.blocks)
    ready = planner.loaded(m.BlocksLoaded("r", load.blocks, num_loaded=2))
    assert ready == [("r", [hit, *(ref.block_id for ref in load.blocks)])]
    assert bm.lookup_prefix(hashes) == ready[0][1]  # device hit + two loaded blocks
    assert planner.plan_store() is None  # loaded blocks are on disk already


def test_planner_partial_load_frees_the_rest_and_cancel_releases_pins():
    bm, on_disk, planner = make_planner()
    tokens = list(range(1, 14))
    hashes = bm.prefix_hashes(tokens)
    on_disk.update(hashes)
    hold, load = planner.plan_load(request("r", tokens))
    assert hold and len(load.blocks) == 3
    ready = planner.loaded(m.BlocksLoaded("r", load.blocks, num_loaded=1))  # block 1 corrupt
    assert len(bm.lookup_prefix(hashes)) == 1
    assert [bm.ref_counts[ref.block_id] for ref in load.blocks] == [1, 0, 0]
    bm.free(ready[0][1])
    assert bm.num_used == 0
    # cancelled while loading: the blocks are freed when the load lands, and stay cached
    hold, load = planner.plan_load(request("s", tokens))
    planner.cancel("s")
    assert bm.num_used == len(load.blocks)  # the loads are still being written
    assert planner.loaded(m.BlocksLoaded("s", load.blocks, num_loaded=len(load.blocks))) == []
    assert bm.num_used == 0 and len(bm.lookup_prefix(hashes)) == 3


def test_planner_shares_loads_in_flight_between_requests():
    bm, on_disk, planner = make_planner()
    tokens = list(range(1, 14))
    on_disk.update(bm.prefix_hashes(tokens))
    _, first = planner.plan_load(request("a", tokens))
    hold, second = planner.plan_load(request("b", tokens + [99] * 4))
    assert hold and second is None  # waits for a's loads instead of loading twice
    ready = planner.loaded(m.BlocksLoaded("a", first.blocks, num_loaded=3))
    assert sorted(rid for rid, _ in ready) == ["a", "b"]


def test_planner_loads_only_what_the_device_budget_holds():
    bm, on_disk, planner = make_planner(num_blocks=3)
    tokens = list(range(1, 22))
    on_disk.update(bm.prefix_hashes(tokens))
    held = bm.allocate_one()
    _, load = planner.plan_load(request("r", tokens))
    assert len(load.blocks) == 2 and bm.num_free == 0
    planner.loaded(m.BlocksLoaded("r", load.blocks, num_loaded=2))
    bm.free([held])
    assert planner.plan_load(request("x", [5] * 3)) == (False, None)  # nothing on disk


def test_planner_stores_new_commits_once_and_pins_until_copied():
    bm, on_disk, planner = make_planner()
    tokens = list(range(1, 10))
    blocks, _ = bm.allocate_prompt(tokens, 8)
    hashes = bm.prefix_hashes(tokens)
    for block_id, h in zip(blocks, hashes, strict=False):
        bm.commit_full_block(block_id, h)
    on_disk.add(hashes[0])
    store = planner.plan_store()
    assert [ref.block_hash for ref in store.blocks] == hashes[1:]
    bm.free(blocks)  # the request ends: the pinned block keeps its memory
    assert bm.ref_counts[blocks[1]] == 1
    assert planner.plan_store() is None
    planner.stored(m.BlocksStored(store.blocks))
    assert bm.num_used == 0 and not planner.storing


def test_scheduler_held_request_waits_and_pins_are_released_when_stuck():
    bm = BlockManager(4, BS, NS)
    sched = Scheduler(bm, max_num_seqs=4, max_num_batched_tokens=64, eos_token_ids=[0], context_length=99)
    sched.add(request("held", [1] * 5))
    sched.hold("held")
    sched.add(request("next", [2] * 5))
    step = sched.schedule()
    assert [w.request_id for w in step.work] == ["next"]  # the held one is skipped
    assert sched.release("held", [])
    # a waiting request's pins block the head, nothing runs: they are given up
    sched2 = Scheduler(BlockManager(2, BS, NS), max_num_seqs=4, max_num_batched_tokens=64,
                       eos_token_ids=[0], context_length=99)
    pins = [sched2.blocks.allocate_one(), sched2.blocks.allocate_one()]
    sched2.add(request("big", [3] * 6))
    sched2.add(request("pinned", [4] * 5), pinned=pins)
    step = sched2.schedule()
    assert [w.request_id for w in step.work] == ["big"]


# ---- the mover's queue -----------------------------------------------------------------


def refs(n: int, base: int = 0) -> tuple[m.BlockRef, ...]:
    return tuple(m.BlockRef(base + i, bytes([base + i]) * 16) for i in range(n))


def test_queue_runs_loads_before_stores_within_the_bound():
    q = OffloadQueue(max_inflight_blocks=4, max_store_batch=2)
    q.push(m.StoreBlocks(refs(5)))
    q.push(m.LoadBlocks("r", refs(3, 10)))
    first = q.next_job()
    assert first.kind == "load" and q.inflight_blocks == 3
    second = q.next_job()
    assert second.kind == "store" and len(second.blocks) == 1  # the bound leaves room for 1
    assert q.next_job() is None
    q.push(m.LoadBlocks("s", refs(2, 20)))
    q.done(second)
    assert q.next_job() is None  # a waiting load is not overtaken by stores
    q.done(first)
    load = q.next_job()
    assert load.kind == "load"
    q.done(load)
    assert [len(q.next_job().blocks), len(q.next_job().blocks)] == [2, 2]
    assert q.next_job() is None and q.pending_blocks() == 0


def test_queue_runs_an_oversized_load_alone():
    q = OffloadQueue(max_inflight_blocks=2)
    q.push(m.LoadBlocks("r", refs(5)))
    job = q.next_job()
    assert job.kind == "load" and len(job.blocks) == 5


# ---- block copies through zero-copy views of the pool ---------------------------------


@pytest.mark.parametrize("dtype", ["bfloat16", "float16", "float32"])
def test_block_copies_are_byte_exact_zero_copy_and_keep_the_pool_in_place(dtype):
    import mlx.core as mx
    import numpy as np

    from unikern.platform.bridge import Bridge, mlx_buffer
    from unikern.stages.kv.pool import KVPool
    from unikern.stages.tiers.block_io import BlockLayout, copy_in, copy_out

    pool = KVPool(num_layers=2, num_kv_heads=2, head_dim=8, dtype=getattr(mx, dtype), block_size=4,
                  kernel_block_size=2, num_blocks=16, slab_blocks=4)
    pool.ensure_capacity(4)
    for layer in range(2):
        pool.keys[layer] = mx.random.normal(pool.keys[layer].shape).astype(pool.dtype)
        pool.values[layer] = mx.random.normal(pool.values[layer].shape).astype(pool.dtype)
    mx.eval(pool.keys, pool.values)
    bridge = Bridge(strict=True)
    layout = BlockLayout.of(pool)
    out = [layout.new_buffer(), layout.new_buffer()]
    copy_out(pool, bridge, [2, 3], out)
    bits = {2: mx.uint16, 4: mx.uint32}[pool.dtype.size]
    expected = np.stack([np.stack([np.array(a.view(bits))[:, 8:12] for a in arrays])
                         for arrays in (pool.keys, pool.values)])
    assert out[0].tobytes() == expected.tobytes()
    copy_in(pool, bridge, [9, 5], out)  # beyond capacity: the pool grows first
    assert pool.capacity_blocks >= 10
    for layer in range(2):
        for src, dst in ((2, 9), (3, 5)):
            for arrays in (pool.keys, pool.values):
                a = arrays[layer].view(bits)
                assert mx.array_equal(a[:, src * 4 : src * 4 + 4], a[:, dst * 4 : dst * 4 + 4]).item()
    assert bridge.copies == 0 and bridge.zero_copy_views == 2 * 2 * 2
    # the views are gone: a scatter into the pool still updates it in place
    address = mlx_buffer(pool.keys[0])[0]
    pool.keys[0][:, mx.array([1, 2])] = mx.zeros((2, 2, 8), dtype=pool.dtype)
    mx.eval(pool.keys[0])
    assert mlx_buffer(pool.keys[0])[0] == address


# ---- the engine: 16 concurrent requests over a two-sequence budget ----------------------

PRESSURE_HEADS = 4


def pressure_prompts() -> list[list[int]]:
    rng = random.Random(5)
    heads = [[rng.randrange(5, 1000) for _ in range(64)] for _ in range(PRESSURE_HEADS)]
    return [heads[i % PRESSURE_HEADS] + [rng.randrange(5, 1000) for _ in range(rng.randrange(8, 40))]
            for i in range(16)]


async def run_pressure(path: str, host_blocks: int, pipeline: str = "generate", **extra):
    import unikern

    # block 16: a sequence here is at most 7 blocks; the budget holds two of them
    bytes_per_block = 2 * 4 * 16 * 2 * 32 * 4  # tiny-llama: 4 layers, 2 KV heads, dim 32, f32
    overrides = {
        "kv": {"block_size": 16, "kernel_block_size": 16, "kv_budget_bytes": 14 * bytes_per_block,
               "host_bytes": host_blocks * bytes_per_block},
        "schedule": {"max_num_seqs": 16, "max_num_batched_tokens": 64},
        **extra,
    }
    async with unikern.Engine.from_pipeline(pipeline, model=path, overrides=overrides) as engine:
        assert engine.stats()["kv"]["blocks_total"] == 14
        results: dict[int, object] = {}

        async def one(i, tokens):
            await anyio.sleep(0.02 * i)  # arrivals in order, overlapping
            results[i] = await engine.complete(prompt_tokens=tokens, max_tokens=6)

        async with anyio.create_task_group() as tg:
            for i, tokens in enumerate(pressure_prompts()):
                tg.start_soon(one, i, tokens)
        stats = engine.stats()
    return [results[i] for i in range(16)], stats


@pytest.mark.anyio
async def test_memory_pressure_host_tier_parity_and_more_cached_tokens(tiny_llama):
    without, _ = await run_pressure(tiny_llama, host_blocks=0)
    with_host, stats = await run_pressure(tiny_llama, host_blocks=64)
    prompts = pressure_prompts()
    for i, result in enumerate(with_host):
        ok, why = compare_greedy(result.token_ids, reference_greedy(tiny_llama, prompts[i], 6))
        assert ok, f"request {i}: {why}"
    cached = [sum(r.usage.cached_tokens for r in results) for results in (without, with_host)]
    assert cached[1] > cached[0], cached
    host = stats["tiers"]["host"]
    assert host["hits"] > 0 and stats["tiers"]["device"]["evictions"] > 0
    assert stats["kv"]["blocks_used"] == 0


@pytest.mark.anyio
async def test_memory_pressure_with_the_disk_tier_keeps_parity_across_a_restart(tiny_llama, tmp_path):
    """The same workload on generate-offload: stores pin blocks and loads hold requests
    on a budget of two sequences; a second engine on the same files loads from disk."""
    disk = {"disk": {"path": str(tmp_path / "kv")}}
    first, _ = await run_pressure(tiny_llama, host_blocks=64, pipeline="generate-offload", **disk)
    second, stats = await run_pressure(tiny_llama, host_blocks=64, pipeline="generate-offload", **disk)
    prompts = pressure_prompts()
    for i in range(16):
        assert compare_greedy(first[i].token_ids, reference_greedy(tiny_llama, prompts[i], 6))[0], i
        assert second[i].token_ids == first[i].token_ids
    assert stats["tiers"]["disk"]["hits"] > 0 and stats["offload"]["load_failures"] == 0
    assert sum(r.usage.cached_tokens for r in second) > sum(r.usage.cached_tokens for r in first)
