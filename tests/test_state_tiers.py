"""Recurrent-state checkpoints in the disk tier: the record kind of the file format, the
state payload copied through views of the state pool, the disk tier's state files, and the
tier planner's books (a checkpoint evicted from memory is found on disk and loaded)."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from tests.test_disk_format import _rewrite_header
from tests.test_offload import committed_prompt
from unikern import messages as m
from unikern.platform.bridge import Bridge
from unikern.stages.kv.blocks import BlockManager
from unikern.stages.kv.state_pool import StatePool
from unikern.stages.schedule.states import StateTracker
from unikern.stages.schedule.tier_planner import TierPlanner
from unikern.stages.tiers.block_io import BlockLayout
from unikern.stages.tiers.disk.format import (
    BlockFormatError,
    CorruptBlockError,
    RecordKind,
    decode_block,
    encode_block,
    parse_header,
)
from unikern.stages.tiers.disk.service import DiskTier
from unikern.stages.tiers.disk.store import DiskStore
from unikern.stages.tiers.queue import OffloadQueue
from unikern.stages.tiers.state_io import StateLayout, copy_state_in, copy_state_out

BS = 4
NS = b"test"
KEY = bytes(range(16))
STATES = [[((3, 8), mx.float32), ((2, 4, 4), mx.float32)], [((3, 8), mx.float32), ((2, 4, 4), mx.float32)]]


def state_pool(chunk_slots: int = 4) -> StatePool:
    pool = StatePool(STATES, chunk_slots=chunk_slots)
    pool.ensure_capacity(4)
    return pool


# ---- file format ------------------------------------------------------------------------


def test_state_record_round_trips_and_is_never_read_as_a_kv_block():
    payload = np.random.default_rng(0).standard_normal(40).astype(np.float32)
    data = encode_block(KEY, payload, dtype="float32", shape=(40,), token_count=512, kind=RecordKind.STATE)
    header = parse_header(data)
    assert (header.kind, header.token_count) == (RecordKind.STATE, 512)
    back = decode_block(data, expected_key=KEY, expected_kind=RecordKind.STATE)
    assert np.array_equal(back.payload.view(np.float32), payload)
    with pytest.raises(CorruptBlockError, match="record kind mismatch: file holds STATE, expected KV_BLOCK"):
        decode_block(data, expected_key=KEY)
    with pytest.raises(CorruptBlockError, match="unknown record kind 7"):
        parse_header(_rewrite_header(data, kind=7))
    flipped = data[:-3] + bytes([data[-3] ^ 0x10]) + data[-2:]
    with pytest.raises(CorruptBlockError, match="checksum"):
        decode_block(flipped, expected_key=KEY, expected_kind=RecordKind.STATE)


# ---- payload: through views of the state pool ---------------------------------------------


def test_a_checkpoint_slot_copies_out_and_back_into_another_slot():
    pool, bridge = state_pool(), Bridge()
    for layer, arrays in enumerate(pool.arrays):
        for i, a in enumerate(arrays):
            a[2] = mx.arange(a[2].size, dtype=a.dtype).reshape(a.shape[1:]) + 100 * layer + 10 * i
    layout = StateLayout.of(pool)
    assert (layout.dtype, layout.shape, layout.nbytes) == ("float32", (112,), 448)
    buffer = layout.new_buffer()
    copy_state_out(pool, bridge, [2], [buffer])
    copy_state_in(pool, bridge, [9], [buffer])  # past the capacity: the pool grows first
    assert pool.capacity >= 10
    for arrays in pool.arrays:
        for a in arrays:
            assert bool(mx.array_equal(a[9], a[2])) and not bool(mx.any(a[3]))
    assert bridge.copies == 0 and bridge.zero_copy_views > 0


def test_mixed_state_dtypes_are_stored_as_bytes():
    layout = StateLayout((((2,), "bfloat16", 2), ((3,), "float32", 4)))
    assert (layout.dtype, layout.shape) == ("uint8", (16,))
    other = StateLayout((((2,), "float32", 4), ((3,), "float32", 4)))
    assert layout.key(KEY) != other.key(KEY) != KEY  # another layout never loads


# ---- the disk tier's state files ------------------------------------------------------------


def test_disk_tier_keeps_states_beside_blocks_and_drops_a_corrupt_one(tmp_path):
    pool = state_pool()
    layout = StateLayout.of(pool)
    store = DiskStore(tmp_path, "model-x", 1 << 20)
    disk = DiskTier(store, BlockLayout(1, 1, BS, 2, "float32", 4), state_layout=layout)
    payload = np.arange(layout.nbytes, dtype=np.uint8)
    assert not disk.contains_state(KEY)
    assert disk.write_state(KEY, payload, num_tokens=8)
    assert disk.contains_state(KEY) and not disk.contains(KEY)  # a state key is not a block key
    out = layout.new_buffer()
    assert disk.read_state(KEY, out, num_tokens=8) and np.array_equal(out, payload)
    assert not disk.read_state(KEY, out, num_tokens=12)  # another boundary: never used
    assert disk.stats()["shape_mismatches"] == 1 and not disk.contains_state(KEY)
    disk.write_state(KEY, payload, num_tokens=8)
    path = store.directory / (layout.key(KEY).hex() + ".ukkv")
    data = bytearray(path.read_bytes())
    data[-1] ^= 1
    path.write_bytes(bytes(data))
    assert not disk.read_state(KEY, out, num_tokens=8)
    assert (disk.stats()["corrupt_files"], disk.stats()["states"]) == (1, 0)
    disk_without_states = DiskTier(store, disk.layout)
    with pytest.raises(BlockFormatError, match="model without recurrent layers"):
        disk_without_states.write_state(KEY, payload, num_tokens=8)


# ---- the books: evicted from memory, found on disk ------------------------------------------


def request(tokens: list[int], rid: str = "r") -> m.Tokenized:
    return m.Tokenized(rid, tuple(tokens), m.SamplingParams(max_tokens=2))


def test_a_checkpoint_evicted_from_memory_is_found_on_disk_and_loaded():
    bm = BlockManager(8, BS, NS)
    tracker = StateTracker(bm, max_num_seqs=1, num_checkpoints=1)
    blocks_on_disk, states_on_disk = set(), set()
    planner = TierPlanner(bm, blocks_on_disk.__contains__, tracker, states_on_disk.__contains__)
    tokens = list(range(10, 10 + 2 * BS)) + [99]
    hashes = bm.prefix_hashes(tokens)
    kv = committed_prompt(bm, tokens[: 2 * BS])
    books = tracker.books
    slot = books.reserve()
    books.commit(slot, hashes[1], 2 * BS)  # the state after block 2, as a prefill saves it
    store = planner.plan_store()  # the committed blocks and the checkpoint, pinned
    assert store.states == (m.StateRef(slot, hashes[1], 2 * BS),) and len(store.blocks) == 2
    assert books.reserve() is None  # pinned while being copied out
    planner.stored(m.BlocksStored(store.blocks, store.states))
    blocks_on_disk.update(hashes[:2])
    states_on_disk.add(hashes[1])
    # another checkpoint takes the only slot: the state leaves memory, its file stays
    books.commit(books.reserve(), b"x" * 16, BS)
    assert hashes[1] not in books.by_hash and books.evicted == 1
    assert tracker.limit_cached(tokens, len(tokens) - 1) == 0
    hold, load = planner.plan_load(request(tokens))
    assert hold and load.blocks == ()  # the KV blocks are still in memory
    assert (load.state.block_hash, load.state.num_tokens) == (hashes[1], 2 * BS)
    ready = planner.loaded(m.BlocksLoaded("r", (), 0, load.state, state_loaded=True))
    assert ready == [("r", kv)]
    assert tracker.limit_cached(tokens, len(tokens) - 1) == 2 * BS
    assert books.pins == {load.state.slot: 1} and books.loaded == 1  # held until admission
    planner.cancel("r")
    assert books.pins == {} and planner.plan_store() is None  # loaded from disk: not stored again


def test_after_a_restart_only_the_blocks_a_checkpoint_covers_are_loaded():
    bm = BlockManager(8, BS, NS)
    tracker = StateTracker(bm, max_num_seqs=1, num_checkpoints=2)
    tokens = list(range(10, 10 + 3 * BS)) + [99]
    hashes = bm.prefix_hashes(tokens)
    # on disk: three blocks, but a checkpoint only after the second
    planner = TierPlanner(bm, set(hashes).__contains__, tracker, {hashes[1]}.__contains__)
    hold, load = planner.plan_load(request(tokens))
    assert hold and [r.block_hash for r in load.blocks] == hashes[:2]
    assert load.state.block_hash == hashes[1] and load.state.num_tokens == 2 * BS
    # a second request with the same prefix waits for those loads instead of repeating them
    hold2, load2 = planner.plan_load(request(tokens, "r2"))
    assert hold2 and load2 is None
    done = m.BlocksLoaded("r", load.blocks, 2, load.state, state_loaded=False)  # the state file was bad
    assert sorted(rid for rid, _ in planner.loaded(done)) == ["r", "r2"]
    assert planner.stats.state_load_failures == 1 and tracker.limit_cached(tokens, len(tokens) - 1) == 0
    assert tracker.books.stats()["checkpoint_slots_in_use"] == 0  # the reserved slot went back
    # no checkpoint anywhere: KV blocks alone are useless to a recurrent model, none load
    bm2 = BlockManager(8, BS, NS)
    planner2 = TierPlanner(bm2, set(hashes).__contains__, StateTracker(bm2, 1, 2), lambda h: False)
    assert planner2.plan_load(request(tokens)) == (False, None)


def test_a_checkpoint_in_memory_is_held_while_its_blocks_load():
    bm = BlockManager(8, BS, NS)
    tracker = StateTracker(bm, max_num_seqs=1, num_checkpoints=1)
    tokens = list(range(10, 10 + BS)) + [99]
    (h,) = bm.prefix_hashes(tokens)
    tracker.books.commit(tracker.books.reserve(), h, BS)  # its KV block is only on disk
    planner = TierPlanner(bm, {h}.__contains__, tracker, lambda block_hash: False)
    hold, load = planner.plan_load(request(tokens))
    assert hold and [r.block_hash for r in load.blocks] == [h] and load.state is None
    assert tracker.books.reserve() is None  # held: another prompt's save cannot evict it
    assert planner.loaded(m.BlocksLoaded("r", load.blocks, 1)) == [("r", [load.blocks[0].block_id])]
    assert tracker.limit_cached(tokens, len(tokens) - 1) == BS
    planner.cancel("r")
    assert tracker.books.reserve() is not None


def test_checkpoints_count_in_the_movers_bound_and_loads_go_first():
    q = OffloadQueue(max_inflight_blocks=3)
    state = m.StateRef(9, KEY, 8)
    q.push(m.StoreBlocks(tuple(m.BlockRef(i, bytes([i]) * 16) for i in range(2)), (state, state)))
    q.push(m.LoadBlocks("r", (), state))
    load = q.next_job()
    assert (load.kind, load.size, load.states) == ("load", 1, (state,))
    store = q.next_job()
    assert (store.kind, len(store.blocks), len(store.states)) == ("store", 2, 0) and q.next_job() is None
    q.done(load)
    assert q.next_job().states == (state,) and q.pending_blocks() == 1
    assert q.drop_stores() == 1
