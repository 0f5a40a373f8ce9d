"""Partial-block prefix reuse: past a prefix hit's last whole block, the longest cached
leading part of the next block (whole kernel blocks) is copied into the prompt's own
block. The books' partial index, the scheduler's copies and their source references,
the pool's in-place copy, and the engine end to end against mlx-lm."""

from __future__ import annotations

import pytest

from tests.conftest import compare_greedy, complete_all, reference_greedy
from tests.test_scheduler import Run, never_eos, prompt
from unikern import messages as m
from unikern.stages.kv.blocks import (
    BlockManager,
    OutOfBlocks,
    PartialHit,
    block_hash,
    partial_hashes,
)
from unikern.stages.schedule.policy import Scheduler

BS, UNIT = 8, 2  # tokens per block and per partial unit in the book tests
NS = b"model-a/layout-1"


def books(num_blocks: int = 16, unit: int = UNIT) -> BlockManager:
    return BlockManager(num_blocks, BS, NS, partial_unit=unit)


def commit(bm: BlockManager, blocks: list[int], tokens: list[int]) -> None:
    """Register every full block of `tokens` with its tokens, as the scheduler does."""
    parent = None
    for i, h in enumerate(bm.prefix_hashes(tokens)):
        bm.commit_full_block(blocks[i], h, parent, tokens[i * BS : (i + 1) * BS])
        parent = h


def cached_prompt(bm: BlockManager, tokens: list[int]) -> list[int]:
    """A prompt allocated, computed and finished: its full blocks stay cached."""
    blocks, _, part = bm.allocate_prompt_partial(tokens, len(tokens) - 1)
    commit(bm, blocks, tokens)
    bm.free(blocks + ([part.source] if part else []))
    return blocks


A = list(range(100, 120))  # 20 tokens: blocks 0 and 1 full, then 4 more


# ---- the books ---------------------------------------------------------------------------


def test_longest_registered_part_of_the_next_block_is_reused():
    bm = books()
    blocks_a = cached_prompt(bm, A)
    # the first 13 tokens are A's: block 0 whole, then 5 tokens of block 1, 2 whole units
    b = A[:13] + [1, 2, 3, 4, 5]
    blocks_b, cached, part = bm.allocate_prompt_partial(b, len(b) - 1)
    assert blocks_b[0] == blocks_a[0] and blocks_b[1] != blocks_a[1]
    assert part == PartialHit(source=blocks_a[1], dest=blocks_b[1], num_tokens=4)
    assert cached == BS + 4
    assert (bm.partial_hits, bm.partial_hit_tokens) == (1, 4)


def test_max_cached_tokens_bounds_the_part():
    bm = books()
    blocks_a = cached_prompt(bm, A)
    _, cached, part = bm.allocate_prompt_partial(A[:13] + [1, 2, 3], 11)
    assert (cached, part.num_tokens, part.source) == (10, 2, blocks_a[1])


def test_a_block_aligned_prompt_reuses_all_but_its_last_unit_of_a_whole_cached_block():
    """Its last token must be computed, so the whole-block hit stops one block short."""
    bm = books()
    blocks_a = cached_prompt(bm, A)
    _, cached, part = bm.allocate_prompt_partial(A[:16], 15)
    assert cached == BS + BS - UNIT and part.source == blocks_a[1]


def test_no_part_without_a_unit_or_a_match():
    bm = books()
    cached_prompt(bm, A)
    assert bm.allocate_prompt_partial(A[:9] + [7, 7, 7], 11)[1:] == (BS, None)  # 1 token: less than a unit
    assert bm.allocate_prompt_partial([9] * 12, 11)[1:] == (0, None)  # block 0 differs: no chain
    off = books(unit=0)
    cached_prompt(off, A)
    assert off.allocate_prompt_partial(A[:13] + [1, 2], 13)[1:] == (BS, None)
    assert not off.partial_to_block


def test_commit_registers_every_leading_unit_but_the_whole_block():
    bm = books()
    blocks_a = cached_prompt(bm, A)
    # per full block: BS / UNIT - 1 parts (the whole block is the full hash's)
    assert sorted(bm.partial_to_block.values()) == sorted(blocks_a[:2] * (BS // UNIT - 1))
    # without its tokens (a block loaded from disk) a commit registers no parts
    bm2 = books()
    blocks, _ = bm2.allocate_prompt(A, 19)
    for block_id, h in zip(blocks, bm2.prefix_hashes(A), strict=False):
        bm2.commit_full_block(block_id, h)
    assert not bm2.partial_to_block


def test_a_partial_hash_never_equals_a_full_block_hash():
    parent = block_hash(None, A[:BS], NS)
    tokens = A[BS : 2 * BS]
    parts = partial_hashes(parent, tokens, NS, UNIT)
    assert len(parts) == BS // UNIT
    assert parts[-1] != block_hash(parent, tokens, NS)  # the same tokens, all of them
    assert len(set(parts)) == len(parts)
    bm = books()
    cached_prompt(bm, A)
    assert not set(bm.partial_to_block) & set(bm.hash_to_block)
    # a prompt of exactly one cached block plus a token: a full hit, no part on top of it
    assert bm.allocate_prompt_partial(A[:BS] + [5], BS)[1:] == (BS, None)


def test_the_source_is_held_for_the_caller_and_cannot_be_evicted_until_freed():
    bm = books(num_blocks=4)
    blocks_a = cached_prompt(bm, A)  # 3 blocks: 2 cached, 1 free
    source = blocks_a[1]
    b = A[:13] + [1, 2, 3]
    blocks_b, _, part = bm.allocate_prompt_partial(b, len(b) - 1)  # block 0 shared, 1 fresh
    assert part.source == source and bm.ref_counts[source] == 1
    # the pool holds 4: blocks_b's 2 and the source are referenced; one more fits, a second
    # would have to evict the source
    bm.allocate_one()
    with pytest.raises(OutOfBlocks):
        bm.allocate_one()
    bm.free([source])
    assert bm.ref_counts[source] == 0 and source in bm.hash_to_block.values()
    bm.allocate_one()  # now the source goes
    assert source not in bm.hash_to_block.values()
    assert source not in bm.partial_to_block.values()
    assert blocks_b[0] in bm.partial_to_block.values()  # still referenced, still indexed


def test_forgetting_a_block_drops_its_parts_and_a_later_registrant_still_matches():
    bm = books(num_blocks=4)
    first = A[:BS] + [1, 2, 3, 4, 50, 51, 52, 53]  # block 1: 1 2 3 4 50 51 52 53
    second = A[:BS] + [1, 2, 3, 4, 60, 61, 62, 63]  # shares block 1's first 2 units
    blocks_1 = cached_prompt(bm, first + [0])
    blocks_2 = cached_prompt(bm, second + [0])
    # the first registrant keeps the shared parts; the second holds its longer ones
    assert sorted(bm.partial_to_block.values()).count(blocks_1[1]) == 3
    assert sorted(bm.partial_to_block.values()).count(blocks_2[1]) == 1
    probe = A[:BS] + [1, 2, 3, 4, 60, 61, 99]
    assert bm.allocate_prompt_partial(probe, 14)[2].source == blocks_2[1]
    bm.evict_all_cached()  # drops every unreferenced cached block
    assert set(bm.partial_to_block.values()) <= {b for b in range(len(bm.ref_counts)) if bm.ref_counts[b]}
    assert blocks_1[1] not in bm.partial_to_block.values()


def test_an_ended_sequences_unfilled_last_block_is_kept_for_partial_hits():
    bm = books(num_blocks=4)
    tokens = A[:BS] + [1, 2, 3, 4, 5]  # block 1 holds 5 tokens: 2 whole units written
    blocks, _, _ = bm.allocate_prompt_partial(tokens, len(tokens) - 1)
    commit(bm, blocks, tokens)
    parent = bm.prefix_hashes(tokens)[0]
    assert bm.keep_partial(blocks[1], parent, tokens[BS : BS + 2 * UNIT])
    assert not bm.keep_partial(blocks[1], parent, tokens[BS : BS + 2 * UNIT])  # cached already
    bm.free(blocks)
    assert bm.num_used == 0 and bm.num_cached == 2 and bm.kept_partial == 1
    # the next turn: the same tokens and more
    later = tokens + [6, 7, 8, 9]
    got, cached, part = bm.allocate_prompt_partial(later, len(later) - 1)
    assert got[0] == blocks[0] and part == PartialHit(blocks[1], got[1], 2 * UNIT) and cached == BS + 2 * UNIT
    assert bm.block_hashes[got[1]] is None  # the prompt's own copy is fresh
    bm.free(got + [part.source])
    bm.evict_all_cached()  # a kept block goes as any cached block does, its parts with it
    assert bm.num_cached == 0 and not bm.partial_to_block


def test_nothing_is_kept_where_partial_hits_are_off_the_block_is_shared_or_adds_no_unit():
    off = books(unit=0)
    (block,) = off.allocate_prompt_partial([1, 2, 3], 2)[0]
    assert not off.keep_partial(block, None, [1, 2])
    bm = books()
    blocks = cached_prompt(bm, A)  # block 2 (4 tokens) freed uncached
    shared = blocks[0]
    bm.take([shared])
    assert not bm.keep_partial(shared, None, A[:UNIT])  # cached whole already, and not private
    fresh = bm.allocate_one()
    assert not bm.keep_partial(fresh, None, A[:UNIT])  # its one unit is indexed already (block 0's)
    assert bm.block_hashes[fresh] is None


def test_a_host_tier_source_comes_back_to_the_device_by_accounting():
    bm = BlockManager(3, BS, NS, host_blocks=4, partial_unit=UNIT)
    blocks_a = cached_prompt(bm, A)
    cached_prompt(bm, [7] * 20)  # pushes A's blocks to the host tier
    assert bm.is_on_host(blocks_a[1])
    _, cached, part = bm.allocate_prompt_partial(A[:13] + [1, 2], 13)
    assert cached == BS + 4 and part.source == blocks_a[1]
    assert not bm.is_on_host(blocks_a[1]) and bm.ref_counts[blocks_a[1]] == 1


# ---- the scheduler ------------------------------------------------------------------------


class PartialRun(Run):
    """The scheduler test's fake pool, which also runs each step's copies before the
    step's checks and reads (the execute stage runs them before the forward)."""

    def schedule(self) -> m.Step | None:
        step = self.sched.schedule()
        if step is not None:
            for source, dest, n in step.copies:
                assert self.sched.blocks.ref_counts[source] >= 1, "the copy's source is not held"
                for offset in range(n):
                    self.slots[(dest, offset)] = self.slots[(source, offset)]
            self.check_step(step)
            self.steps.append(step)
        return step


def make_partial_run(num_blocks: int = 16, block_size: int = 256, unit: int = 16, **kw) -> PartialRun:
    blocks = BlockManager(num_blocks, block_size, b"test", partial_unit=unit)
    sched = Scheduler(blocks, max_num_seqs=kw.pop("max_num_seqs", 8),
                      max_num_batched_tokens=kw.pop("max_num_batched_tokens", 512), eos_token_ids=(0,),
                      context_length=4096)
    return PartialRun(sched, kw.pop("sample_fn", never_eos))


SYSTEM = prompt(1, 1000)


def test_a_1000_token_shared_prefix_starts_at_992_and_the_step_carries_the_copy():
    run = make_partial_run()
    run.add("first", SYSTEM + prompt(2, 100), max_tokens=4)
    run.drain()
    source = run.steps[0].work[0].block_table[3]  # first's block 3: tokens 768-1023
    run.add("second", SYSTEM + prompt(3, 40), max_tokens=4)
    step = run.schedule()
    (work,) = step.work
    assert work.start_pos == 992  # 3 whole blocks and 14 of block 3's 16 kernel blocks, not 768
    assert step.copies == ((source, work.block_table[3], 224),)
    assert run.sched.blocks.ref_counts[source] == 1  # held while the step is in flight
    run.done(step, run.execute(step))
    assert run.sched.blocks.ref_counts[source] == 0  # released when the step came back
    run.drain()
    assert run.finished["second"].usage.cached_tokens == 992
    assert run.sched.blocks.partial_hit_tokens == 224


def test_a_request_ended_while_its_copy_runs_gives_the_source_back_at_once():
    """Whatever its copy then reads, only the ended request's own dropped block gets it."""
    run = make_partial_run()
    run.add("first", SYSTEM + prompt(2, 100), max_tokens=4)
    run.drain()
    run.add("second", SYSTEM + prompt(3, 40), max_tokens=4)
    step = run.schedule()
    (source, _, _), = step.copies
    assert run.sched.blocks.ref_counts[source] == 1
    run.abort("second")
    assert run.sched.blocks.ref_counts[source] == 0 and run.sched.blocks.num_used == 0
    run.done(step, run.execute(step))  # the step comes back after: nothing freed twice
    run.check_idle()


def test_partial_hits_give_the_tokens_of_whole_block_hits_under_load():
    """Prompts sharing prefixes of many lengths, in flight together, with preemption (a
    small pool): the fake pool's tokens depend on every position read through the
    tables, so a wrong copy changes them. Same tokens as with whole-block reuse only."""
    other = prompt(4, 1000)
    prompts = {f"r{i}": (SYSTEM, other)[i % 2][: 40 + 29 * i] + prompt(10 + i, 5 + 3 * (i % 4)) for i in range(24)}

    def run_all(unit: int) -> tuple[dict[str, list[int]], PartialRun]:
        run = make_partial_run(num_blocks=14, block_size=64, unit=unit, max_num_seqs=4, max_num_batched_tokens=96)
        for seed in (SYSTEM, other):  # cached first, then the prompts that reuse them
            run.add("seed", seed[:800], max_tokens=2)
            run.drain()
            del run.tokens["seed"], run.finished["seed"]
        for rid, p in prompts.items():
            assert run.add(rid, p, max_tokens=60) is None
        run.drain()
        return {rid: run.generated(rid) for rid in prompts}, run

    whole, _ = run_all(unit=0)
    partial, run = run_all(unit=16)
    assert partial == whole
    assert run.sched.num_preemptions > 0
    assert run.sched.blocks.partial_hits >= 5
    assert any(s.copies for s in run.steps) and run.sched.blocks.num_used == 0


def test_several_copies_in_one_step():
    run = make_partial_run(block_size=64)
    run.add("seed", SYSTEM[:300], max_tokens=1)
    run.drain()
    for i in range(3):
        run.add(f"r{i}", SYSTEM[: 150 + 40 * i] + [7, 7], max_tokens=2)
    step = run.schedule()
    assert len(step.copies) == 3 and [w.start_pos for w in step.work] == [144, 176, 224]
    run.done(step, run.execute(step))
    run.drain()


# ---- the pool ------------------------------------------------------------------------------


def test_the_pool_copies_a_blocks_leading_slots_in_place():
    import mlx.core as mx

    from unikern.platform.bridge import mlx_buffer
    from unikern.stages.kv.pool import KVPool

    pool = KVPool(num_layers=2, num_kv_heads=2, head_dim=8, dtype=mx.float32, block_size=32,
                  kernel_block_size=16, num_blocks=16, slab_blocks=4)
    pool.ensure_capacity(12)  # (a GPU's pool grows in slabs: none before the first step)
    for arrays in (pool.keys, pool.values):
        for layer in range(2):
            arrays[layer][:, 3 * 32 : 4 * 32] = mx.random.normal((2, 32, 8))
            arrays[layer][:, 9 * 32 : 10 * 32] = mx.full((2, 32, 8), -1.0)
    mx.eval(pool.keys, pool.values)
    addresses = [mlx_buffer(a)[0] for a in pool.keys + pool.values]
    pool.copy_prefixes([(3, 9, 16), (3, 11, 32)])
    for arrays in (pool.keys, pool.values):
        for a in arrays:
            assert mx.array_equal(a[:, 9 * 32 : 9 * 32 + 16], a[:, 3 * 32 : 3 * 32 + 16]).item()
            assert mx.all(a[:, 9 * 32 + 16 : 10 * 32] == -1.0).item()  # past the part: untouched
            assert mx.array_equal(a[:, 11 * 32 : 12 * 32], a[:, 3 * 32 : 4 * 32]).item()
    assert [mlx_buffer(a)[0] for a in pool.keys + pool.values] == addresses  # written in place


# ---- end to end ----------------------------------------------------------------------------

PREFIX = [(11 * j) % 1000 + 7 for j in range(600)]
# the first request fills blocks 0-2 (768 tokens), so block 2 (512-767) is cached whole
FIRST = PREFIX + [(13 * j) % 900 + 5 for j in range(200)]
FOLLOWERS = [PREFIX + [20 + i, 30 + i] for i in range(6)]


def engine_settings(partial: bool) -> dict:
    return {"kv": {"kv_budget_bytes": 64 << 20, "block_size": 256, "partial_prefix": partial},
            "schedule": {"max_num_batched_tokens": 512}}


async def run_engine(tiny_llama: str, partial: bool) -> tuple[list, dict]:
    import unikern

    async with unikern.Engine.from_pipeline("generate", model=tiny_llama, overrides=engine_settings(partial)) as engine:
        await engine.complete(prompt_tokens=FIRST, max_tokens=2)
        alone = await engine.complete(prompt_tokens=FOLLOWERS[0], max_tokens=8)
        together = await complete_all(engine, FOLLOWERS[1:], 8)  # in flight together: several copies a step
        stats = engine.stats()
    return [alone, *together], stats


@pytest.mark.anyio
async def test_requests_sharing_a_prefix_that_ends_mid_block_match_mlx_lm(tiny_llama):
    results, stats = await run_engine(tiny_llama, partial=True)
    # 2 whole blocks and 5 of block 2's 16-token kernel blocks (the shared part is 88 tokens)
    assert [r.usage.cached_tokens for r in results] == [512 + 80] * len(FOLLOWERS)
    assert stats["tiers"]["device"]["partial_hits"] == len(FOLLOWERS)
    assert stats["tiers"]["device"]["partial_hit_tokens"] == 80 * len(FOLLOWERS)
    assert stats["kv"]["blocks_used"] == 0  # every source reference went back
    for p, result in zip(FOLLOWERS, results, strict=True):
        ok, note = compare_greedy(result.token_ids, reference_greedy(tiny_llama, p, 8))
        assert ok, note


@pytest.mark.anyio
async def test_a_conversations_next_turn_copies_the_unfilled_block_the_last_one_left(tiny_llama):
    """The first turn ends inside its second block; the next turn (its prompt, the reply,
    a new message) reuses the first block whole and the second one's written units."""
    import unikern

    first = [(7 * j) % 900 + 5 for j in range(300)]
    overrides = {"kv": {"kv_budget_bytes": 64 << 20, "block_size": 256}}
    async with unikern.Engine.from_pipeline("generate", model=tiny_llama, overrides=overrides) as engine:
        reply = await engine.complete(prompt_tokens=first, max_tokens=20)
        turn = first + list(reply.token_ids) + [11, 12, 13, 14, 15]
        second = await engine.complete(prompt_tokens=turn, max_tokens=8)
        stats = engine.stats()
    # 300 + 19 positions written (the last token sampled, not fed): 63 in block 1, 3 units
    assert second.usage.cached_tokens == 256 + 48
    assert stats["tiers"]["device"]["kept_partial"] >= 1 and stats["kv"]["blocks_used"] == 0
    ok, note = compare_greedy(second.token_ids, reference_greedy(tiny_llama, turn, 8))
    assert ok, note


@pytest.mark.anyio
async def test_partial_prefix_off_reuses_whole_blocks_only(tiny_llama):
    results, stats = await run_engine(tiny_llama, partial=False)
    assert [r.usage.cached_tokens for r in results] == [512] * len(FOLLOWERS)
    assert stats["tiers"]["device"]["partial_hits"] == 0
    for p, result in zip(FOLLOWERS, results, strict=True):  # the whole blocks hold what mlx-lm computes
        ok, note = compare_greedy(result.token_ids, reference_greedy(tiny_llama, p, 8))
        assert ok, note
