"""Block bookkeeping: chained hashes, prefix reuse, reference counts, the free list and
LRU eviction of cached blocks, plus a state machine over random use."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    Bundle,
    RuleBasedStateMachine,
    consumes,
    invariant,
    multiple,
    precondition,
    rule,
)

from unikern.stages.kv.blocks import HASH_BYTES, BlockManager, OutOfBlocks, block_hash

BS = 4  # tokens per block in these tests
NS = b"model-a/layout-1"


def commit_prompt(bm: BlockManager, blocks: list[int], tokens: list[int]) -> list[bytes]:
    """Register every full block of `tokens` as a computed block, as the scheduler does."""
    hashes = bm.prefix_hashes(tokens)
    for block_id, h in zip(blocks, hashes, strict=False):  # a partial tail block has no hash
        bm.commit_full_block(block_id, h)
    return hashes


def free_lists(bm: BlockManager) -> tuple[list[int], list[int]]:
    """(free uncached, free cached in LRU order): white-box view for invariants."""
    return list(bm._free_uncached), list(bm._free_cached)


# ---- hashing ----------------------------------------------------------------------------

HASH_CASES = [
    (None, [1, 2, 3, 4], b"ns"),
    (None, [0, 0, 0, 0], b""),
    (bytes(range(HASH_BYTES)), [7, 2**31, 5, 2**32 - 1], b"model-a/layout-1"),
]

CHILD = """
import json, sys
from unikern.stages.kv.blocks import BlockManager, block_hash
cases = json.loads(sys.argv[1])
out = [block_hash(bytes.fromhex(p) if p else None, t, ns.encode()).hex() for p, t, ns in cases]
bm = BlockManager(8, 4, namespace=b"model-a/layout-1")
out.append([h.hex() for h in bm.prefix_hashes(list(range(100, 113)))])
print(json.dumps(out))
"""


def test_hash_is_stable_across_processes_and_hash_seeds():
    cases = [(p.hex() if p else None, t, ns.decode()) for p, t, ns in HASH_CASES]
    here = [block_hash(p, t, ns).hex() for p, t, ns in HASH_CASES]
    here.append([h.hex() for h in BlockManager(8, 4, namespace=NS).prefix_hashes(list(range(100, 113)))])
    for seed in ("1", "2"):
        env = {**os.environ, "PYTHONHASHSEED": seed}
        child = subprocess.run(
            [sys.executable, "-c", CHILD, json.dumps(cases)],
            env=env, capture_output=True, text=True, timeout=60, check=True,
        )
        assert json.loads(child.stdout.strip().splitlines()[-1]) == here, f"PYTHONHASHSEED={seed}"
    assert all(len(bytes.fromhex(h)) == HASH_BYTES for h in here[:-1])


def test_hash_depends_on_parent_tokens_and_namespace():
    base = block_hash(None, [1, 2, 3, 4], NS)
    assert base == block_hash(None, (1, 2, 3, 4), NS)  # any sequence type, same value
    other_parent = block_hash(b"\x01" * HASH_BYTES, [1, 2, 3, 4], NS)
    variants = {
        "parent": other_parent,
        "chained parent": block_hash(base, [1, 2, 3, 4], NS),
        "token value": block_hash(None, [1, 2, 3, 5], NS),
        "token order": block_hash(None, [2, 1, 3, 4], NS),
        "token count": block_hash(None, [1, 2, 3, 4, 0], NS),
        "namespace": block_hash(None, [1, 2, 3, 4], b"model-b/layout-1"),
    }
    for what, h in variants.items():
        assert h != base, f"hash ignores the {what}"
    assert len(set(variants.values())) == len(variants)


def test_prefix_hashes_are_chained_over_full_blocks_only():
    bm = BlockManager(8, BS, namespace=NS)
    tokens = list(range(10))  # two full blocks and a partial one
    hashes = bm.prefix_hashes(tokens)
    assert len(hashes) == 2
    assert hashes[0] == block_hash(None, tokens[:4], NS)
    assert hashes[1] == block_hash(hashes[0], tokens[4:8], NS)
    # same second block after a different first block: a different chain
    assert bm.prefix_hashes([9, 9, 9, 9] + tokens[4:8])[1] != hashes[1]
    assert BlockManager(8, BS, namespace=b"other").prefix_hashes(tokens) != hashes


# ---- prefix reuse ---------------------------------------------------------------------


def test_second_prompt_reuses_two_shared_full_blocks():
    bm = BlockManager(16, BS, namespace=NS)
    a = list(range(10))
    blocks_a, cached_a = bm.allocate_prompt(a, max_cached_tokens=len(a) - 1)
    assert (blocks_a, cached_a) == ([0, 1, 2], 0)
    commit_prompt(bm, blocks_a, a)

    b = a[:8] + [99, 98, 97]
    blocks_b, cached_b = bm.allocate_prompt(b, max_cached_tokens=len(b) - 1)
    assert blocks_b[:2] == blocks_a[:2]
    assert cached_b == 2 * BS
    assert blocks_b[2] not in blocks_a
    assert [bm.ref_counts[i] for i in range(4)] == [2, 2, 1, 1]
    assert bm.hits == 2


def test_no_reuse_without_commit_or_with_a_different_head():
    bm = BlockManager(16, BS, namespace=NS)
    a = list(range(10))
    blocks_a, _ = bm.allocate_prompt(a, max_cached_tokens=9)
    # not committed yet: its KV may still be unwritten
    assert bm.allocate_prompt(a, max_cached_tokens=9)[1] == 0
    commit_prompt(bm, blocks_a, a)
    # shares block 2's tokens but not block 1's: the chain differs, nothing reused
    blocks_c, cached_c = bm.allocate_prompt([50, 51, 52, 53] + a[4:10], max_cached_tokens=9)
    assert cached_c == 0
    assert not set(blocks_c) & set(blocks_a)
    # a different namespace never sees these blocks
    assert bm.lookup_prefix(BlockManager(1, BS, namespace=b"other").prefix_hashes(a)) == []


@pytest.mark.parametrize(("max_cached", "expected_blocks"), [(12, 2), (8, 2), (7, 1), (4, 1), (3, 0), (0, 0)])
def test_max_cached_tokens_caps_reuse(max_cached, expected_blocks):
    bm = BlockManager(16, BS, namespace=NS)
    a = list(range(13))
    blocks_a, _ = bm.allocate_prompt(a, max_cached_tokens=12)
    commit_prompt(bm, blocks_a, a)
    b = a[:8] + [77] * 5
    blocks_b, cached_b = bm.allocate_prompt(b, max_cached_tokens=max_cached)
    assert cached_b == expected_blocks * BS
    assert blocks_b[:expected_blocks] == blocks_a[:expected_blocks]
    assert not set(blocks_b[expected_blocks:]) & set(blocks_a)
    assert len(blocks_b) == bm.blocks_needed(len(b))


# ---- reference counts and the cache ---------------------------------------------------


def test_shared_blocks_freed_by_one_holder_stay_allocated():
    bm = BlockManager(8, BS, namespace=NS)
    a = list(range(10))
    blocks_a, _ = bm.allocate_prompt(a, 9)
    commit_prompt(bm, blocks_a, a)
    blocks_b, _ = bm.allocate_prompt(a[:8] + [1, 1], 9)
    assert bm.num_used == 4
    bm.free(blocks_a)
    # a's private tail is free again; the two shared blocks are still b's
    assert bm.num_used == 3
    assert [bm.ref_counts[b] for b in blocks_b] == [1, 1, 1]
    for _ in range(bm.num_free):
        assert bm.allocate_one() not in blocks_b
    with pytest.raises(OutOfBlocks):
        bm.allocate_one()


def test_freed_hashed_blocks_are_cached_and_reusable_until_evicted():
    bm = BlockManager(4, BS, namespace=NS)
    a = list(range(10))
    blocks_a, _ = bm.allocate_prompt(a, 9)
    hashes = commit_prompt(bm, blocks_a, a)
    bm.free(blocks_a)
    assert (bm.num_free, bm.num_used, bm.num_cached) == (4, 0, 2)
    assert bm.lookup_prefix(hashes) == blocks_a[:2]

    blocks_b, cached_b = bm.allocate_prompt(a[:8] + [3], 8)
    assert (blocks_b[:2], cached_b, bm.evictions) == (blocks_a[:2], 8, 0)
    bm.free(blocks_b)

    # take every uncached block; the next allocations have to evict
    held = [bm.allocate_one() for _ in range(2)]
    assert bm.evictions == 0 and bm.num_cached == 2
    held.append(bm.allocate_one())
    assert bm.evictions == 1 and bm.num_cached == 1
    held.append(bm.allocate_one())
    assert bm.evictions == 2 and bm.num_cached == 0
    assert bm.lookup_prefix(hashes) == []
    assert all(bm.block_hashes[b] is None for b in held)
    bm.free(held)
    assert bm.allocate_prompt(a, 9)[1] == 0


def test_lru_eviction_order_tail_before_head_least_recently_freed_first():
    bm = BlockManager(6, BS, namespace=NS)
    p, q = list(range(8)), list(range(100, 108))
    blocks_p, _ = bm.allocate_prompt(p, 7)
    blocks_q, _ = bm.allocate_prompt(q, 7)
    commit_prompt(bm, blocks_p, p)
    commit_prompt(bm, blocks_q, q)
    bm.free(blocks_p)
    bm.free(blocks_q)
    assert free_lists(bm)[1] == [blocks_p[1], blocks_p[0], blocks_q[1], blocks_q[0]]
    # the two uncached blocks come first, lowest id first, then evictions in LRU order
    order = [bm.allocate_one() for _ in range(6)]
    assert order == [4, 5, blocks_p[1], blocks_p[0], blocks_q[1], blocks_q[0]]


def test_lru_reuse_refreshes_recency():
    bm = BlockManager(4, BS, namespace=NS)
    p, q = list(range(4)), list(range(100, 104))
    bp, _ = bm.allocate_prompt(p + [0], 4)
    bq, _ = bm.allocate_prompt(q + [0], 4)
    commit_prompt(bm, bp, p)
    commit_prompt(bm, bq, q)
    bm.free(bp)
    bm.free(bq)
    # p was freed first, but reusing it makes q the least recently used
    again, cached = bm.allocate_prompt(p + [5], 4)
    assert cached == 4 and again[0] == bp[0]
    bm.free(again)
    victims = [bm.allocate_one() for _ in range(bm.num_free)]
    cached_victims = [b for b in victims if b in (bp[0], bq[0])]
    assert cached_victims == [bq[0], bp[0]]


def test_allocation_is_lowest_id_first():
    bm = BlockManager(8, BS)
    assert [bm.allocate_one() for _ in range(5)] == [0, 1, 2, 3, 4]
    bm.free([3])
    bm.free([1])
    assert [bm.allocate_one() for _ in range(3)] == [1, 3, 5]
    blocks, _ = bm.allocate_prompt(list(range(8)), 7)
    assert blocks == [6, 7]


def test_highest_used_tracks_referenced_and_cached_blocks():
    bm = BlockManager(8, BS, namespace=NS)
    assert bm.highest_used() == 0
    blocks = [bm.allocate_one() for _ in range(3)]
    assert bm.highest_used() == 3
    bm.free([blocks[2]])
    assert bm.highest_used() == 2
    bm.commit_full_block(blocks[1], b"h" * HASH_BYTES)
    bm.free([blocks[1]])
    assert bm.highest_used() == 2  # cached blocks still hold data
    bm.evict_all_cached()
    assert bm.highest_used() == 1
    bm.free([blocks[0]])
    assert bm.highest_used() == 0


def test_freeing_more_than_allocated_raises():
    bm = BlockManager(4, BS)
    block = bm.allocate_one()
    bm.free([block])
    with pytest.raises(RuntimeError, match="freed more often"):
        bm.free([block])
    with pytest.raises(RuntimeError):
        bm.free([3])  # never allocated
    assert bm.ref_counts == [0, 0, 0, 0]


def test_prompt_that_does_not_fit_raises_and_changes_nothing():
    bm = BlockManager(3, BS, namespace=NS)
    a = list(range(8))
    blocks_a, _ = bm.allocate_prompt(a, 7)
    commit_prompt(bm, blocks_a, a)
    bm.free(blocks_a)
    held = bm.allocate_one()  # the one uncached block
    # needs its 2 cached blocks back plus 2 fresh ones: only the 2 cached are free
    before = (list(bm.ref_counts), dict(bm.hash_to_block), free_lists(bm), bm.hits, bm.misses)
    assert not bm.can_allocate(2, blocks_a)
    with pytest.raises(OutOfBlocks):
        bm.allocate_prompt(a + [1, 2, 3, 4, 5], 12)
    assert before == (list(bm.ref_counts), dict(bm.hash_to_block), free_lists(bm), bm.hits, bm.misses)
    assert held not in blocks_a
    # reusing both cached blocks and needing no fresh one does fit
    assert bm.allocate_prompt(a, 8) == (blocks_a, 8)
    assert bm.num_free == 0


def test_constructor_rejects_empty_pools():
    with pytest.raises(ValueError):
        BlockManager(0, 4)
    with pytest.raises(ValueError):
        BlockManager(4, 0)


# ---- a state machine over random use --------------------------------------------------

TOKENS = st.lists(st.integers(0, 2), min_size=1, max_size=14)  # a tiny alphabet: prefixes collide


class BlockManagerMachine(RuleBasedStateMachine):
    held = Bundle("held")

    def __init__(self) -> None:
        super().__init__()
        self.bm = BlockManager(7, 2, namespace=NS)
        self.holders: dict[int, tuple[list[int], list[int], int]] = {}  # id -> blocks, tokens, committed
        self.next_id = 0

    def _expected_refs(self) -> list[int]:
        refs = [0] * self.bm.num_blocks
        for blocks, _, _ in self.holders.values():
            for b in blocks:
                refs[b] += 1
        return refs

    def _new_holder(self, blocks: list[int], tokens: list[int], committed: int) -> int:
        self.next_id += 1
        self.holders[self.next_id] = (blocks, tokens, committed)
        return self.next_id

    @rule(target=held, tokens=TOKENS, max_cached=st.integers(0, 14))
    def allocate_prompt(self, tokens, max_cached):
        bm = self.bm
        hashes = bm.prefix_hashes(tokens)
        expected_hit = bm.lookup_prefix(hashes)[: max_cached // bm.block_size]
        before = (list(bm.ref_counts), dict(bm.hash_to_block), free_lists(bm))
        try:
            blocks, cached = bm.allocate_prompt(tokens, max_cached)
        except OutOfBlocks:
            needed = bm.blocks_needed(len(tokens)) - len(expected_hit)
            assert not bm.can_allocate(needed, expected_hit)
            assert before == (list(bm.ref_counts), dict(bm.hash_to_block), free_lists(bm))
            return multiple()  # nothing is held
        hit = cached // bm.block_size
        assert blocks[:hit] == expected_hit and cached <= max_cached
        assert len(blocks) == bm.blocks_needed(len(tokens)) == len(set(blocks))
        # reused blocks hold this prompt's own prefix; fresh ones carry no stale hash
        assert [bm.block_hashes[b] for b in blocks[:hit]] == hashes[:hit]
        assert all(bm.block_hashes[b] is None for b in blocks[hit:])
        return self._new_holder(blocks, list(tokens), hit)

    @rule(target=held)
    def allocate_one(self):
        if self.bm.num_free == 0:
            with pytest.raises(OutOfBlocks):
                self.bm.allocate_one()
            return multiple()
        block = self.bm.allocate_one()
        assert self.bm.block_hashes[block] is None
        return self._new_holder([block], [], 0)

    @rule(holder=held)
    def commit_next_full_block(self, holder):
        if holder not in self.holders:
            return
        blocks, tokens, committed = self.holders[holder]
        hashes = self.bm.prefix_hashes(tokens)
        if committed >= len(hashes):
            return
        self.bm.commit_full_block(blocks[committed], hashes[committed])
        # either this block now answers for the hash, or another one already did
        assert hashes[committed] in self.bm.hash_to_block
        self.holders[holder] = (blocks, tokens, committed + 1)

    @rule(holder=consumes(held))
    def free(self, holder):
        if holder not in self.holders:
            return
        blocks, _, _ = self.holders.pop(holder)
        self.bm.free(blocks)

    @precondition(lambda self: self.holders)
    @rule()
    def over_free_raises(self):
        free_block = next((b for b in range(self.bm.num_blocks) if self.bm.ref_counts[b] == 0), None)
        if free_block is None:
            return
        with pytest.raises(RuntimeError):
            self.bm.free([free_block])

    @invariant()
    def counts_add_up(self):
        bm = self.bm
        refs = self._expected_refs()
        assert bm.ref_counts == refs
        assert min(bm.ref_counts) >= 0
        assert bm.num_free + bm.num_used == bm.num_blocks
        assert bm.num_used == sum(1 for r in refs if r > 0)

    @invariant()
    def free_means_unreferenced(self):
        bm = self.bm
        uncached, cached = free_lists(bm)
        free = uncached + cached
        assert len(free) == len(set(free)) == bm.num_free
        assert set(free) == {b for b in range(bm.num_blocks) if bm.ref_counts[b] == 0}
        assert all(bm.block_hashes[b] is not None for b in cached)
        assert all(bm.block_hashes[b] is None for b in uncached)

    @invariant()
    def cache_index_is_consistent(self):
        bm = self.bm
        for h, b in bm.hash_to_block.items():
            assert bm.block_hashes[b] == h
        assert {b for b in range(bm.num_blocks) if bm.block_hashes[b] is not None} == set(
            bm.hash_to_block.values()
        )
        assert bm.num_cached == len(bm.hash_to_block)

    @invariant()
    def highest_used_covers_every_live_block(self):
        bm = self.bm
        live = [b for b in range(bm.num_blocks) if bm.ref_counts[b] or bm.block_hashes[b] is not None]
        assert bm.highest_used() == (max(live) + 1 if live else 0)


BlockManagerMachine.TestCase.settings = settings(
    max_examples=150, stateful_step_count=40, deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
test_block_manager_state_machine = BlockManagerMachine.TestCase
