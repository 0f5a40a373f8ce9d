"""StateBooks, plain bookkeeping: request slots, checkpoints by hash, pins, LRU eviction."""

from __future__ import annotations

import mlx.core as mx

from unikern.stages.kv.state_pool import ZERO_SLOT, StateBooks, StatePool


def test_request_slots_never_include_the_zero_slot():
    books = StateBooks(max_seqs=2, num_checkpoints=1)
    slots = {books.take_request_slot(), books.take_request_slot()}
    assert slots == {1, 2} and ZERO_SLOT not in slots
    books.free_request_slot(1)
    assert books.take_request_slot() == 1


def test_checkpoints_evict_least_recently_used_but_never_a_pinned_one():
    books = StateBooks(max_seqs=1, num_checkpoints=2)
    a, b = books.reserve(), books.reserve()
    books.commit(a, b"A")
    books.commit(b, b"B")
    assert books.longest([b"A", b"B"], limit=2) == 2
    assert books.longest([b"A", b"X"], limit=2) == 1  # the chain's end must have one
    pinned = books.pin(b"A")  # being restored: A must survive
    c = books.reserve()  # full: evicts B, the only unpinned one
    assert c == b and b"B" not in books.by_hash and books.by_hash[b"A"] == pinned
    assert books.reserve() is None  # A pinned, c reserved: nothing to give
    books.commit(c, b"A")  # saved twice: the second copy goes back
    books.unpin(pinned)
    assert books.reserve() is not None


def test_state_pool_copies_slots_in_every_layer():
    pool = StatePool([[((2,), mx.float32)], [((1, 3), mx.float32)]], chunk_slots=4)
    pool.ensure_capacity(3)
    assert pool.capacity == 4
    for arrays in pool.arrays:
        arrays[0][2] = mx.ones(arrays[0].shape[1:])
    pool.copy([(2, 3), (ZERO_SLOT, 2)])
    for arrays in pool.arrays:
        assert bool(mx.all(arrays[0][3] == 1)) and not bool(mx.any(arrays[0][2]))
