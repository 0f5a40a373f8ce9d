"""Layer groups of a mixed model (full and windowed attention layers: gemma3, gpt-oss):
the windowed layers keep block tables of their own, in their own pool and id space,
holding only the blocks their window reaches, while the full layers hold every block.
Measured through stats.kv on ~2,000-token requests (tokens: mlx-lm's), through the
scheduler's books under a fake pool that checks every read of both tables, and across
the tiers (disk files carry both groups' layers; idle trim releases both pools)."""

from __future__ import annotations

import hashlib
from types import SimpleNamespace

import anyio
import pytest

import unikern
from tests.conftest import compare_greedy, generate_sampled, reference_greedy

# the window, block, chunk and lookahead settings and bounds of the all-windowed model's test
from tests.test_window_blocks import BLOCK, DECODE_BOUND, OVERRIDES, PREFILL_BOUND, WINDOW
from unikern import messages as m
from unikern.stages.execute.model import LayerSlot
from unikern.stages.kv.blocks import BlockManager
from unikern.stages.schedule.policy import Scheduler
from unikern.stages.schedule.windows import ZERO_BLOCK

PROMPT = [(5 * j) % 1000 + 9 for j in range(1900)]
MAX_TOKENS = 100  # 2,000 tokens in all


def mixed_model(family: str = "gemma3") -> str:
    from unikern.testing.families import cached_family_model

    return str(cached_family_model(f"tiny-{family}", sliding_window=WINDOW))


# gpt-oss (sinks) with every unwritten slot NaN: a released or never-written slot that
# reached an output would show
@pytest.mark.anyio
@pytest.mark.parametrize(("family", "fill"), [("gemma3", "zeros"), ("gpt-oss", "nan")])
async def test_window_group_holds_only_its_window_while_the_full_group_holds_all(family, fill):
    path = mixed_model(family)
    overrides = {**OVERRIDES, "kv": {**OVERRIDES["kv"], "unwritten_fill": fill}}
    async with unikern.Engine.from_pipeline("generate", model=path, overrides=overrides) as engine:
        groups = engine.stats()["kv"]["groups"]
        assert [(g["layers"], g["num_layers"], g["window"]) for g in groups] == [("full", 2, None),
                                                                                 ("window", 2, WINDOW)]
        # samples of (full group, window group) blocks in use
        tokens, prefill, decode = await generate_sampled(
            engine, PROMPT, MAX_TOKENS, lambda: tuple(g["blocks_used"] for g in engine.stats()["kv"]["groups"])
        )
        prefill = [window for _, window in prefill]
        # a prompt sharing 1,500 tokens hits both groups: the full one's every block, the
        # window group's blocks of the last window before the hit (cached as they left it)
        shared = PROMPT[:1500] + [9, 8, 7]
        again = await engine.complete(prompt_tokens=shared, max_tokens=16)
        kv = engine.stats()["kv"]
        assert kv["blocks_used"] == 0 and kv["groups"][1]["blocks_used"] == 0
    assert len(tokens) == MAX_TOKENS, "an early EOS: the request is no longer 2,000 tokens"
    window_used = [w for _, w in decode]
    assert max(window_used) <= DECODE_BOUND, window_used
    assert max(prefill) <= PREFILL_BOUND, prefill
    # the full group holds every block of the sequence (read after each token, so the
    # last readings may come after the request ended and freed them)
    full_used = [f for f, _ in decode]
    assert max(full_used) >= -(-(len(PROMPT) + MAX_TOKENS - 2) // BLOCK), full_used
    assert full_used[0] >= -(-len(PROMPT) // BLOCK), full_used
    print(f"{family}, {len(PROMPT)} + {MAX_TOKENS} tokens, {BLOCK}-token blocks, window {WINDOW}: window group "
          f"held at most {max(prefill)} blocks prefilling, {max(window_used)} decoding; full group {max(full_used)}")
    assert again.usage.cached_tokens == 1500 // BLOCK * BLOCK
    for prompt, ours in ((PROMPT, tokens), (shared, again.token_ids)):
        ok, note = compare_greedy(ours, reference_greedy(path, prompt, len(ours)))
        assert ok, note


# ---- the policy alone, over a fake pool --------------------------------------------------

W, BS = 10, 4
MIXED = SimpleNamespace(layers=(LayerSlot("window", 0, window=W), LayerSlot("full", 1)), has_state=False)
ALL_WINDOWED = SimpleNamespace(layers=(LayerSlot("window", 0, window=W), LayerSlot("window", 1, window=W)),
                               has_state=False)


def fake_token(request_id: str, context: tuple[int, ...]) -> int:
    digest = hashlib.blake2b(repr((request_id, context)).encode(), digest_size=8).digest()
    return 1 + int.from_bytes(digest, "little") % 60


class FakePool:
    """Writes each fed token into the slots both tables name and, for every query, reads
    the full table's whole context and the window table's last W keys back, checking
    them against the sequence's tokens: a wrong, released-too-early or reused window
    block fails here."""

    def __init__(self) -> None:
        self.full: dict[tuple[int, int], int] = {}
        self.window: dict[tuple[int, int], int] = {}
        self.tokens: dict[str, list[int]] = {}

    def run(self, sched: Scheduler, step: m.Step) -> dict[str, list[int]]:
        sampled: dict[str, list[int]] = {}
        for w in step.work:
            seq_tokens = self.tokens.setdefault(w.request_id, list(sched.by_id[w.request_id].tokens))
            feed = list(w.token_ids)
            out = []
            for i in range(step.num_steps):
                start = w.start_pos + (0 if i == 0 else len(w.token_ids) + i - 1)
                for j, token in enumerate(feed):
                    p = start + j
                    self.full[(w.block_table[p // BS], p % BS)] = token
                    if sched.window_group is not None:
                        self.window[(w.window_table[p // BS], p % BS)] = token
                    else:  # all windowed: the one table is the window's
                        assert w.block_table[p // BS] != ZERO_BLOCK
                    q = p  # this query: check what it reads
                    context = seq_tokens[: q + 1]
                    lo = max(0, q - W + 1)
                    if sched.window_group is not None:
                        assert [self.full[(w.block_table[k // BS], k % BS)] for k in range(q + 1)] == context
                        table = w.window_table
                    else:
                        table = w.block_table
                    assert all(table[k // BS] != ZERO_BLOCK for k in range(lo, q + 1)), (w.request_id, q, table)
                    got = [(self.window if sched.window_group is not None else self.full)[(table[k // BS], k % BS)]
                           for k in range(lo, q + 1)]
                    assert got == context[lo:], (w.request_id, q)
                if not w.sample:
                    break
                token = fake_token(w.request_id, tuple(seq_tokens[max(0, len(seq_tokens) - W):]))
                seq_tokens.append(token)
                out.append(token)
                feed = [token]
            if w.sample:
                sampled[w.request_id] = out
        return sampled


def drive(sched: Scheduler, pool: FakePool, watch=None) -> dict[str, m.Finished]:
    finished = {}
    while sched.has_work():
        step = sched.schedule()
        assert step is not None, "nothing schedulable while requests wait"
        if watch is not None:
            watch(step)
        outcome = sched.on_step_done(step, pool.run(sched, step))
        for f in outcome.finished:
            finished[f.request_id] = f
            pool.tokens.pop(f.request_id, None)
    return finished


def scheduler(geometry, num_blocks: int, window_blocks: int | None, **kw) -> Scheduler:
    books = BlockManager(num_blocks, BS, b"ns", reserved_blocks=2)
    wbooks = BlockManager(window_blocks, BS, b"ns/w", reserved_blocks=2) if window_blocks else None
    return Scheduler(books, max_num_seqs=4, max_num_batched_tokens=16, max_prefill_chunk=8, eos_token_ids=[0],
                     context_length=4096, decode_lookahead=2, decode_lookahead_max=4, geometry=geometry,
                     window_blocks=wbooks, **kw)


def request(rid: str, prompt: list[int], max_tokens: int) -> m.Tokenized:
    return m.Tokenized(rid, tuple(prompt), m.SamplingParams(max_tokens=max_tokens))


def test_mixed_tables_window_holds_its_window_full_holds_all_and_hits_need_both():
    sched = scheduler(MIXED, num_blocks=64, window_blocks=24)  # nothing evicted: 20 blocks in all
    pool = FakePool()
    prompt = [(3 * j) % 50 + 1 for j in range(60)]
    held: list[int] = []

    def watch(step: m.Step) -> None:
        for w in step.work:
            assert len(w.window_table) == len(w.block_table) or not w.sample  # one entry per logical block
            held.append(sum(1 for b in w.window_table if b != ZERO_BLOCK))
        assert sched.window_group.books.num_used == sum(
            sum(1 for b in s.window_blocks if b != ZERO_BLOCK) for s in sched.running)

    assert sched.add(request("a", prompt, 20)) is None
    assert drive(sched, pool, watch)["a"].usage.completion_tokens == 20
    # at most the window's blocks and a chunk (prefill), or the window's + lookahead (decode)
    assert max(held) <= -(-(W - 1 + 8) // BS) + 1, held
    assert sched.blocks.num_used == 0 and sched.window_group.books.num_used == 0
    # a hit takes the full group's chain and the window group's last window before it
    assert sched.add(request("b", prompt[:41] + [7, 7], 4)) is None
    done = drive(sched, pool)
    assert done["b"].usage.cached_tokens == 40
    # the window group's cache gone, the full group's still there: no hit at all (the
    # first computed query would read keys the window group no longer has)
    sched.window_group.books.evict_all_cached()
    assert sched.add(request("c", prompt[:41] + [8, 8], 4)) is None
    assert drive(sched, pool)["c"].usage.cached_tokens == 0


def test_a_window_group_shortens_a_hit_to_where_its_window_is_cached():
    sched = scheduler(MIXED, num_blocks=64, window_blocks=12)
    pool = FakePool()
    prompt = [(7 * j) % 50 + 1 for j in range(40)]
    assert sched.add(request("a", prompt, 1)) is None
    drive(sched, pool)
    # forget the window group's blocks 7-9 (positions 28-39): a 40-token hit needs 31-39
    wbooks = sched.window_group.books
    hashes = sched.blocks.prefix_hashes(prompt)
    for h in hashes[7:]:
        wbooks._free_cached.pop(wbooks.hash_to_block[h])
        wbooks._forget(wbooks.hash_to_block[h])
    assert sched.add(request("b", prompt + [5, 5], 2)) is None
    # the longest hit whose window (from hit - 9) is cached ends at block 7 (28 tokens)
    assert drive(sched, pool)["b"].usage.cached_tokens == 28


def test_an_all_windowed_model_admits_a_prompt_longer_than_the_pool():
    """Only the window and a chunk are held at once, so a 100-token prompt runs on 6
    blocks (24 slots); the prefix cache keeps what left the window."""
    sched = scheduler(ALL_WINDOWED, num_blocks=6, window_blocks=None)
    pool = FakePool()
    prompt = [(11 * j) % 50 + 1 for j in range(100)]
    assert sched.add(request("a", prompt, 12)) is None
    assert drive(sched, pool)["a"].usage.completion_tokens == 12
    # a prompt that needs more than the pool at once (window + a chunk) is refused, clearly
    small = scheduler(ALL_WINDOWED, num_blocks=4, window_blocks=None)
    refusal = small.add(request("b", prompt, 4))
    assert refusal is not None and refusal.code == "bad_request"
    assert "10-token window and a 8-token prefill chunk" in refusal.message and "max_prefill_chunk" in refusal.message


def test_a_window_group_too_small_for_one_window_is_refused_by_name():
    sched = scheduler(MIXED, num_blocks=64, window_blocks=3)
    refusal = sched.add(request("a", list(range(1, 30)), 4))
    assert refusal is not None and refusal.code == "bad_request"
    assert "of the windowed layers" in refusal.message
    assert sched.add(request("b", [1, 2, 3], 4)) is None  # short enough: 1 block


@pytest.mark.anyio
@pytest.mark.parametrize("family", ["gemma3", "gpt-oss"])
async def test_split_groups_store_to_disk_and_load_back_after_a_restart(family, tmp_path):
    """A disk file holds every layer of a block, in the model's layer order, whether the
    pool is split in groups or shared: a prefix stored by a split engine comes back into
    both groups of a fresh one (the window group's blocks of the last window included)
    and into a shared one, with mlx-lm's tokens."""
    path = mixed_model(family)
    prompt = PROMPT[:1000] + [42]
    kv = {"kv_budget_bytes": 32 << 20, "block_size": BLOCK, "host_bytes": 0}
    runs, stats = [], []
    for layer_groups in ("auto", "auto", "shared"):  # the second and third start with only the disk warm
        overrides = {"kv": {**kv, "layer_groups": layer_groups}, "disk": {"path": str(tmp_path / "kv")}}
        async with unikern.Engine.from_pipeline("generate-offload", model=path, overrides=overrides) as engine:
            runs.append(await engine.complete(prompt_tokens=prompt, max_tokens=8))
            deadline = anyio.current_time() + 20  # stores still queued at close are dropped: wait
            while engine.stats()["tiers"]["disk"]["files"] < 1000 // BLOCK:
                assert anyio.current_time() < deadline, engine.stats()["tiers"]
                await anyio.sleep(0.02)
            stats.append(engine.stats())
    assert [len(s["kv"]["groups"]) for s in stats] == [2, 2, 1]
    assert [r.usage.cached_tokens for r in runs] == [0, 1000 // BLOCK * BLOCK, 1000 // BLOCK * BLOCK]
    assert stats[1]["offload"]["loads_done"] == 1000 // BLOCK
    assert runs[1].token_ids == runs[0].token_ids == runs[2].token_ids
    ok, note = compare_greedy(runs[1].token_ids, reference_greedy(path, prompt, 8))
    assert ok, note


@pytest.mark.anyio
async def test_idle_trim_gives_back_both_groups_memory():
    path = mixed_model()
    overrides = {"kv": {**OVERRIDES["kv"], "idle_trim_seconds": 0.1, "idle_drop_cache_seconds": 0.3}}
    async with unikern.Engine.from_pipeline("generate", model=path, overrides=overrides) as engine:
        await engine.complete(prompt_tokens=PROMPT[:600], max_tokens=4)
        busy = engine.stats()
        deadline = anyio.current_time() + 20  # liveness only: the trim comes within a second
        while (idle := engine.stats())["memory"]["kv_resident_bytes"] or any(
            g["blocks_cached"] for g in idle["kv"]["groups"]
        ):
            assert anyio.current_time() < deadline, idle["kv"]
            await anyio.sleep(0.05)
    assert busy["kv"]["groups"][1]["blocks_cached"] > 0 and busy["memory"]["kv_resident_bytes"] > 0


@pytest.mark.parametrize(("full_blocks", "window_blocks"), [(20, 40), (64, 8), (22, 7)])
def test_many_requests_under_pressure_in_either_group_read_exactly_what_they_wrote(full_blocks, window_blocks):
    """Ten requests of mixed lengths sharing prefixes, a pool short in the full group,
    the window group or both: preemption, prefix hits and lookahead over both tables,
    every read checked by the fake pool, and the same tokens as with room to spare."""
    prompts = {f"r{i}": [(13 * j + (i % 3)) % 50 + 1 for j in range(5 + 7 * i)] for i in range(10)}

    def run(full: int, window: int) -> tuple[dict[str, list[int]], int]:
        sched = scheduler(MIXED, num_blocks=full, window_blocks=window)
        pool = FakePool()
        seen: dict[str, list[int]] = {}
        for rid, prompt in prompts.items():
            assert sched.add(request(rid, prompt, 9)) is None
        while sched.has_work():
            step = sched.schedule()
            assert step is not None
            for seq in sched.running:
                held = sum(1 for b in seq.window_blocks if b != ZERO_BLOCK)
                assert held <= -(-(W - 1 + 8) // BS) + 1, (seq.request_id, seq.window_blocks)
            outcome = sched.on_step_done(step, pool.run(sched, step))
            for out in outcome.tokens:
                seen.setdefault(out.request_id, []).append(out.token_id)
            for f in outcome.finished:
                pool.tokens.pop(f.request_id, None)
        assert sched.blocks.num_used == 0 and sched.window_group.books.num_used == 0
        return seen, sched.num_preemptions

    roomy, _ = run(256, 256)
    tight, preemptions = run(full_blocks, window_blocks)
    assert tight == roomy and preemptions > 0


def test_the_tier_planner_moves_both_groups_blocks_of_one_hash():
    """Stores pin the block of the same hash in both groups (and skip one whose window
    block is gone: its file would be partial); loads fill a block in both, the window
    group's going back to its cache once loaded."""
    from unikern.stages.schedule.tier_planner import TierPlanner

    books = BlockManager(16, BS, b"ns", reserved_blocks=2)
    wbooks = BlockManager(8, BS, b"ns/w", reserved_blocks=2)
    on_disk: set[bytes] = set()
    planner = TierPlanner(books, on_disk.__contains__, window_blocks=wbooks)
    tokens = list(range(1, 14))  # 3 full blocks
    hashes = books.prefix_hashes(tokens)
    full = [books.allocate_one() for _ in range(3)]
    window = [wbooks.allocate_one() for _ in range(2)]  # block 0's window block already gone
    for i in range(3):
        books.commit_full_block(full[i], hashes[i])
    for i in (1, 2):
        wbooks.commit_full_block(window[i - 1], hashes[i])
    store = planner.plan_store()
    assert [(r.block_id, r.window_block_id) for r in store.blocks] == [(full[1], window[0]), (full[2], window[1])]
    assert wbooks.ref_counts[window[0]] == 2  # pinned until copied out
    planner.stored(store)
    assert wbooks.ref_counts[window[0]] == 1
    books.free(full)
    wbooks.free(window)
    books.evict_all_cached()
    wbooks.evict_all_cached()
    on_disk.update(hashes)
    hold, load = planner.plan_load(m.Tokenized("r", tuple(tokens), m.SamplingParams(max_tokens=2)))
    assert hold and all(r.window_block_id >= 2 for r in load.blocks) and wbooks.num_used == 3
    ready = planner.loaded(m.BlocksLoaded("r", load.blocks, num_loaded=3))
    assert [rid for rid, _ in ready] == ["r"]
    assert wbooks.num_used == 0 and wbooks.lookup_prefix(hashes) == [r.window_block_id for r in load.blocks]


@pytest.mark.anyio
async def test_the_host_tier_keeps_both_groups_blocks_for_a_later_hit():
    """Blocks pushed out of each group's device budget move to that group's host tier
    (a host block holds a logical block in both groups), and a prefix hit brings the
    full chain and the window group's last window back from it."""
    path = mixed_model()
    per_block = 2 * 2 * BLOCK * 2 * 16 * 4  # K and V, 2 layers, 2 kv heads, head dim 16, float32
    overrides = {
        "kv": {"kv_budget_bytes": 48 * per_block, "window_blocks": 8, "host_bytes": 64 * 2 * per_block,
               "block_size": BLOCK, "kernel_block_size": 16},
        "schedule": {"max_prefill_chunk": 128, "max_num_batched_tokens": 128},
    }
    first = PROMPT[:1500]
    other = [(9 * j) % 1000 + 11 for j in range(1500)]
    async with unikern.Engine.from_pipeline("generate", model=path, overrides=overrides) as engine:
        assert [g["blocks_total"] for g in engine.stats()["kv"]["groups"]] == [40, 8]
        await engine.complete(prompt_tokens=first, max_tokens=2)
        await engine.complete(prompt_tokens=other, max_tokens=2)  # pushes the first's blocks out
        groups = engine.stats()["kv"]["groups"]
        again = await engine.complete(prompt_tokens=first + [3, 4], max_tokens=8)
        tiers = engine.stats()["tiers"]
    assert groups[0]["host_blocks"] > 0 and groups[1]["host_blocks"] > 0, groups
    assert again.usage.cached_tokens == 1500 // BLOCK * BLOCK and tiers["host"]["hits"] > 0
    ok, note = compare_greedy(again.token_ids, reference_greedy(path, first + [3, 4], 8))
    assert ok, note
