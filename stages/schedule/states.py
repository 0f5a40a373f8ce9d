"""The scheduler's side of recurrent state: a state slot per admitted sequence, zeroed or
restored from a checkpoint at admission, and a checkpoint at every logical-block
boundary a prompt's prefill crosses. Plain synchronous code, called by `Scheduler`."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from unikern.stages.kv.blocks import BlockManager
from unikern.stages.kv.state_pool import ZERO_SLOT, StateBooks


@dataclass
class _Admitted:
    slot: int
    start: int  # num_computed at admission: the first chunk starts here
    source: int  # slot its state starts from: ZERO_SLOT or a pinned checkpoint
    hashes: list[bytes]  # of the prompt's full blocks


class StateTracker:
    def __init__(self, blocks: BlockManager, max_num_seqs: int, num_checkpoints: int | None = None) -> None:
        self.blocks = blocks
        self.books = StateBooks(max_num_seqs, num_checkpoints or max(64, 2 * max_num_seqs))
        self.admitted: dict[str, _Admitted] = {}
        self.pending: list[tuple[str, int, int, bytes]] = []  # (request, position, slot, hash)
        # the checkpoint a held request (its prefix loading from a lower tier) will restore
        # from: pinned until it is admitted or dropped
        self.held: dict[str, int] = {}

    def limit_cached(self, tokens: list[int], max_cached_tokens: int) -> int:
        """How many prompt tokens a prefix hit may cover: whole blocks up to the last
        one that has a state checkpoint. The KV of the attention layers comes from the
        blocks, the recurrent state from the checkpoint, both named by the same chained
        block hash."""
        bs = self.blocks.block_size
        hashes = self.blocks.prefix_hashes(tokens)
        hits = len(self.blocks.lookup_prefix(hashes))
        return self.books.longest(hashes, min(hits, max_cached_tokens // bs)) * bs

    def admit(self, seq: Any, cached_tokens: int) -> None:
        bs = self.blocks.block_size
        hashes = self.blocks.prefix_hashes(seq.tokens[: seq.num_prompt_tokens])
        source = self.books.pin(hashes[cached_tokens // bs - 1]) if cached_tokens else ZERO_SLOT
        self.admitted[seq.request_id] = _Admitted(self.books.take_request_slot(), cached_tokens, source, hashes)
        self.drop_hold(seq.request_id)  # its own pin (source) keeps what it restores

    def hold(self, request_id: str, block_hash: bytes) -> None:
        """Keep the checkpoint after `block_hash` (loaded for this waiting request, or in
        memory while its blocks load) from eviction until it is admitted or dropped."""
        self.drop_hold(request_id)
        slot = self.books.by_hash[block_hash]
        self.books.hold(slot)
        self.held[request_id] = slot

    def drop_hold(self, request_id: str) -> None:
        slot = self.held.pop(request_id, None)
        if slot is not None:
            self.books.unpin(slot)

    def fields(self, seq: Any, start: int, num_tokens: int) -> dict[str, Any]:
        """The SeqWork fields of a chunk [start, start + num_tokens)."""
        a = self.admitted[seq.request_id]
        bs = self.blocks.block_size
        saves = []
        first = start // bs + 1
        for boundary in range(first * bs, min(start + num_tokens, seq.num_prompt_tokens) + 1, bs):
            block_hash = a.hashes[boundary // bs - 1]
            if block_hash in self.books.by_hash:
                continue
            slot = self.books.reserve()
            if slot is None:
                break
            saves.append((boundary, slot))
            self.pending.append((seq.request_id, boundary, slot, block_hash))
        return {"state_slot": a.slot, "state_from": a.source if start == a.start else -1, "state_saves": tuple(saves)}

    def flush(self, by_id: dict[str, Any]) -> None:
        """Once the step in flight is back: keep the checkpoints its sequences reached,
        and unpin the checkpoints their first chunks restored from. So checkpoints written
        by a step become visible at the next `schedule()` (one step is in flight at a
        time), and only if their sequence got there."""
        for request_id, boundary, slot, block_hash in self.pending:
            seq = by_id.get(request_id)
            if seq is not None and request_id in self.admitted and seq.num_computed >= boundary:
                self.books.commit(slot, block_hash, boundary)
            else:
                self.books.drop(slot)
        self.pending = []
        for request_id, a in self.admitted.items():
            seq = by_id.get(request_id)
            if a.source != ZERO_SLOT and seq is not None and seq.num_computed > a.start:
                self.books.unpin(a.source)
                a.source = ZERO_SLOT  # restored; a later chunk never restores again

    def release(self, request_id: str) -> None:
        """The sequence finished or was preempted: its slot goes back."""
        a = self.admitted.pop(request_id, None)
        if a is None:
            return
        self.books.free_request_slot(a.slot)
        if a.source != ZERO_SLOT:
            self.books.unpin(a.source)
