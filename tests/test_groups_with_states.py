"""Split layer groups and recurrent-state checkpoints together (a model with full,
windowed and recurrent layers): the tier planner loads and stores both groups' blocks
and the checkpoint a prefix reaches, and the disk tier round-trips both groups' layers
and a checkpoint of one model through the mover's copies."""

from __future__ import annotations

import mlx.core as mx
import numpy as np

from unikern import messages as m
from unikern.platform.bridge import Bridge
from unikern.stages.kv.blocks import BlockManager
from unikern.stages.kv.pool import KVPool
from unikern.stages.kv.state_pool import StatePool
from unikern.stages.schedule.states import StateTracker
from unikern.stages.schedule.tier_planner import TierPlanner
from unikern.stages.tiers.block_io import BlockLayout, GroupedPools, copy_in, copy_out
from unikern.stages.tiers.disk.service import DiskTier
from unikern.stages.tiers.disk.store import DiskStore
from unikern.stages.tiers.state_io import StateLayout, copy_state_in, copy_state_out

BS = 4


def request(tokens: list[int], rid: str = "r") -> m.Tokenized:
    return m.Tokenized(rid, tuple(tokens), m.SamplingParams(max_tokens=2))


def test_the_planner_stores_and_loads_both_groups_blocks_and_the_checkpoint():
    books = BlockManager(16, BS, b"ns", reserved_blocks=2)
    wbooks = BlockManager(8, BS, b"ns/w", reserved_blocks=2)
    tracker = StateTracker(books, max_num_seqs=1, num_checkpoints=2)
    blocks_on_disk: set[bytes] = set()
    states_on_disk: set[bytes] = set()
    planner = TierPlanner(
        books, blocks_on_disk.__contains__, tracker, states_on_disk.__contains__, window_blocks=wbooks
    )
    tokens = list(range(1, 3 * BS + 2))  # 3 full blocks and a token
    hashes = books.prefix_hashes(tokens)
    full = [books.allocate_one() for _ in range(3)]
    window = [wbooks.allocate_one() for _ in range(3)]
    for i in range(3):
        books.commit_full_block(full[i], hashes[i])
        wbooks.commit_full_block(window[i], hashes[i])
    slot = tracker.books.reserve()
    tracker.books.commit(slot, hashes[1], 2 * BS)  # the state after block 2 only
    store = planner.plan_store()
    assert [(r.block_id, r.window_block_id) for r in store.blocks] == list(zip(full, window, strict=True))
    assert store.states == (m.StateRef(slot, hashes[1], 2 * BS),)
    assert tracker.books.pins == {slot: 1}  # pinned while copied out
    planner.stored(m.BlocksStored(store.blocks, store.states))
    assert all(wbooks.ref_counts[b] == 1 for b in window) and tracker.books.pins == {}
    blocks_on_disk.update(hashes)
    states_on_disk.add(hashes[1])
    # a restart: nothing in memory, everything on disk
    books2 = BlockManager(16, BS, b"ns", reserved_blocks=2)
    wbooks2 = BlockManager(8, BS, b"ns/w", reserved_blocks=2)
    tracker2 = StateTracker(books2, max_num_seqs=1, num_checkpoints=2)
    planner2 = TierPlanner(
        books2, blocks_on_disk.__contains__, tracker2, states_on_disk.__contains__, window_blocks=wbooks2
    )
    hold, load = planner2.plan_load(request(tokens))
    # only the blocks the checkpoint covers, each in both groups
    assert hold and [r.block_hash for r in load.blocks] == hashes[:2]
    assert all(r.block_id >= 2 and r.window_block_id >= 2 for r in load.blocks) and wbooks2.num_used == 2
    assert (load.state.block_hash, load.state.num_tokens) == (hashes[1], 2 * BS)
    ready = planner2.loaded(m.BlocksLoaded("r", load.blocks, 2, load.state, state_loaded=True))
    assert ready == [("r", [r.block_id for r in load.blocks])]
    assert wbooks2.num_used == 0 and wbooks2.lookup_prefix(hashes) == [r.window_block_id for r in load.blocks]
    assert books2.lookup_prefix(hashes) == [r.block_id for r in load.blocks]
    assert tracker2.limit_cached(tokens, len(tokens) - 1) == 2 * BS
    planner2.cancel("r")
    assert planner2.plan_store() is None  # loaded from disk: neither stored again


def kv_pool(num_layers: int) -> KVPool:
    return KVPool(
        num_layers=num_layers, num_kv_heads=2, head_dim=4, dtype=mx.float32, block_size=BS,
        kernel_block_size=BS, num_blocks=6, slab_blocks=2,
    )


def test_the_disk_tier_round_trips_both_groups_and_a_checkpoint(tmp_path):
    kinds = ["window", "full", "window"]  # attention layers in model order (recurrent ones apart)
    pools = GroupedPools.of(kv_pool(1), kv_pool(2), kinds)
    states = StatePool([[((3, 8), mx.float32)], [((2, 4, 4), mx.float32)]], chunk_slots=4)
    states.ensure_capacity(4)
    bridge = Bridge()
    for p, base in ((pools.pool, 1.0), (pools.window_pool, 100.0)):
        p.ensure_capacity(6)
        for layer in range(p.num_layers):
            shape = p.keys[layer].shape
            p.keys[layer] = mx.arange(int(np.prod(shape)), dtype=mx.float32).reshape(shape) + base + layer
            p.values[layer] = -p.keys[layer]
    for layer, arrays in enumerate(states.arrays):
        for a in arrays:
            a[2] = mx.ones(a.shape[1:], dtype=a.dtype) * (layer + 7)
    layout, state_layout = BlockLayout.of(pools), StateLayout.of(states)
    assert layout.num_layers == 3
    disk = DiskTier(DiskStore(tmp_path, "model-x", 1 << 20), layout, state_layout=state_layout)
    block, checkpoint = layout.new_buffer(), state_layout.new_buffer()
    copy_out(pools, bridge, [(3, 4)], [block])
    copy_state_out(states, bridge, [2], [checkpoint])
    key = bytes(range(16))
    assert disk.write(key, block) and disk.write_state(key, checkpoint, num_tokens=BS)
    assert disk.contains(key) and disk.contains_state(key)
    block2, checkpoint2 = layout.new_buffer(), state_layout.new_buffer()
    assert disk.read(key, block2) and disk.read_state(key, checkpoint2, num_tokens=BS)
    copy_in(pools, bridge, [(2, 5)], [block2])
    copy_state_in(states, bridge, [3], [checkpoint2])
    slots = lambda b: slice(b * BS, (b + 1) * BS)  # noqa: E731
    for p, src, dst in ((pools.pool, 3, 2), (pools.window_pool, 4, 5)):
        for layer in range(p.num_layers):
            assert bool(mx.array_equal(p.keys[layer][:, slots(dst)], p.keys[layer][:, slots(src)]))
            assert bool(mx.array_equal(p.values[layer][:, slots(dst)], p.values[layer][:, slots(src)]))
    for arrays in states.arrays:
        for a in arrays:
            assert bool(mx.array_equal(a[3], a[2]))
