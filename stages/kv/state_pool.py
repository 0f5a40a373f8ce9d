"""Recurrent state (mlx-lm ArraysCache layers: Mamba, gated delta nets) beside the paged
KV pool: one slot per running request plus checkpoint slots keyed by a logical block's
chained hash, so a prefix hit restores the state instead of recomputing it."""

from __future__ import annotations

import heapq
from collections import OrderedDict
from collections.abc import Sequence
from typing import Any

import mlx.core as mx

from unikern.stages.kv.cache_kinds import new_state

ZERO_SLOT = 0


class StateBooks:
    """Request slots 1..max_seqs; checkpoint slots above them, evicted LRU once unpinned.

    The plain bookkeeping the scheduler owns (`StatePool` holds the arrays, lent by the KV
    service). A request slot is zeroed on admission; a checkpoint slot holds the state at a
    logical-block boundary of a prompt, keyed by that block's chained hash. A checkpoint
    evicted here may still be on the disk tier (the tier planner looks there)."""

    def __init__(self, max_seqs: int, num_checkpoints: int) -> None:
        self.max_seqs = max_seqs
        self.num_checkpoints = num_checkpoints
        self._free_requests = list(range(1, max_seqs + 1))  # a heap: lowest first
        first = max_seqs + 1
        self._free_checkpoints = list(range(first, first + num_checkpoints))
        self.by_hash: dict[bytes, int] = {}
        self.hash_of: dict[int, bytes] = {}
        self._lru: OrderedDict[int, None] = OrderedDict()  # unpinned checkpoints, LRU first
        self.pins: dict[int, int] = {}
        self.saved = 0
        self.restored = 0
        self.evicted = 0
        self.loaded = 0  # from a lower tier
        # (slot, hash, tokens) of every commit, while a consumer (the tier planner) tracks
        # them to store them; None: not recorded
        self._committed: list[tuple[int, bytes, int]] | None = None

    @property
    def num_slots(self) -> int:
        return 1 + self.max_seqs + self.num_checkpoints

    # ---- request slots ------------------------------------------------------------------

    def take_request_slot(self) -> int:
        if not self._free_requests:
            raise RuntimeError("more running sequences than state slots (max_num_seqs)")
        return heapq.heappop(self._free_requests)

    def free_request_slot(self, slot: int) -> None:
        heapq.heappush(self._free_requests, slot)

    # ---- checkpoints ---------------------------------------------------------------------

    def longest(self, hashes: Sequence[bytes], limit: int) -> int:
        """The most blocks (<= limit) of this chain whose end has a checkpoint."""
        for n in range(min(limit, len(hashes)), 0, -1):
            if hashes[n - 1] in self.by_hash:
                return n
        return 0

    def pin(self, block_hash: bytes) -> int:
        """Pin the checkpoint a request restores from (counted as restored)."""
        slot = self.by_hash[block_hash]
        self.hold(slot)
        self.restored += 1
        return slot

    def hold(self, slot: int) -> None:
        """One more pin on a committed checkpoint (being stored, or loaded for a request
        not admitted yet): it is not evicted until `unpin`."""
        self.pins[slot] = self.pins.get(slot, 0) + 1
        self._lru.pop(slot, None)

    def unpin(self, slot: int) -> None:
        self.pins[slot] -= 1
        if not self.pins[slot]:
            del self.pins[slot]
            if slot in self.hash_of:
                self._lru[slot] = None
            else:  # replaced while pinned
                self._free_checkpoints.append(slot)

    def reserve(self) -> int | None:
        """A checkpoint slot to write into (pinned until `commit` or `drop`), evicting the
        least recently used checkpoint if none is free; None when all are pinned."""
        if self._free_checkpoints:
            slot = self._free_checkpoints.pop()
        elif self._lru:
            slot, _ = self._lru.popitem(last=False)
            del self.by_hash[self.hash_of.pop(slot)]
            self.evicted += 1
        else:
            return None
        self.pins[slot] = 1
        return slot

    def commit(self, slot: int, block_hash: bytes, num_tokens: int = 0, loaded: bool = False) -> None:
        """The state written into `slot` is the state after the block named `block_hash`
        (the first `num_tokens` tokens); `loaded`: it came from a lower tier."""
        if block_hash in self.by_hash:  # another request saved it first
            self.drop(slot)
            return
        self.by_hash[block_hash] = slot
        self.hash_of[slot] = block_hash
        if loaded:
            self.loaded += 1
        else:
            self.saved += 1
        if self._committed is not None:
            self._committed.append((slot, block_hash, num_tokens))
        self.unpin(slot)

    def track_commits(self) -> None:
        """Start recording commits for `drain_commits`."""
        if self._committed is None:
            self._committed = []

    def drain_commits(self) -> list[tuple[int, bytes, int]]:
        """(slot, hash, tokens) of the checkpoints committed since the last drain."""
        drained, self._committed = self._committed or [], [] if self._committed is not None else None
        return drained

    def drop(self, slot: int) -> None:
        del self.pins[slot]
        self._free_checkpoints.append(slot)

    def stats(self) -> dict[str, int]:
        return {"request_slots": self.max_seqs, "request_slots_in_use": self.max_seqs - len(self._free_requests),
                "checkpoint_slots": self.num_checkpoints,
                "checkpoint_slots_in_use": self.num_checkpoints - len(self._free_checkpoints),
                "checkpoints": len(self.by_hash), "saved": self.saved, "restored": self.restored,
                "evicted": self.evicted, "loaded": self.loaded}


class StatePool:
    """Per recurrent layer, per state array: one MLX array [slots, ...], grown in chunks
    as slots are first used; zeros, because a recurrence reads all of its state. Slot 0 is
    never written: it stays zero and is what admission copies (the `needs_zeroing` rule
    of cache_kinds)."""

    def __init__(self, layer_states: Sequence[Sequence[tuple[tuple[int, ...], Any]]], chunk_slots: int = 16) -> None:
        self.layer_states = [list(s) for s in layer_states]
        self.chunk_slots = chunk_slots
        self.capacity = 0
        self.arrays: list[list[mx.array]] = [[] for _ in self.layer_states]

    def ensure_capacity(self, num_slots: int) -> None:
        if num_slots <= self.capacity:
            return
        target = -(-max(num_slots, self.capacity * 3 // 2) // self.chunk_slots) * self.chunk_slots
        extra = target - self.capacity
        for layer, states in enumerate(self.layer_states):
            fresh = [new_state((extra, *shape), dtype, "ArraysCache") for shape, dtype in states]
            if self.capacity:
                self.arrays[layer] = [mx.concatenate([a, f]) for a, f in zip(self.arrays[layer], fresh, strict=True)]
            else:
                self.arrays[layer] = fresh
        self.capacity = target
        mx.eval(self.arrays)

    def copy(self, pairs: Sequence[tuple[int, int]]) -> None:
        """slot dst <- slot src for each (src, dst), in every layer (one gather/scatter)."""
        if not pairs:
            return
        src = mx.array([s for s, _ in pairs])
        dst = mx.array([d for _, d in pairs])
        for arrays in self.arrays:
            for a in arrays:
                a[dst] = a[src]

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for arrays in self.arrays for a in arrays)
