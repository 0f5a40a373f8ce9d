"""Block bookkeeping for the paged KV pool: reference counts, a free list, and a prefix
cache of full logical blocks keyed by chained hashes, evicted LRU, with an index of their
leading parts (partial hits, copied rather than shared). Plain synchronous code; the KV
manager stage owns one and lends it to the scheduler."""

from __future__ import annotations

import hashlib
import heapq
import struct
from collections import OrderedDict
from collections.abc import Iterable, Sequence
from typing import NamedTuple

HASH_BYTES = 16


class OutOfBlocks(Exception):
    """The device budget cannot hold what was asked: the caller waits or preempts.
    Control flow of the scheduler, not Python's MemoryError (the process is fine)."""


def block_hash(parent: bytes | None, token_ids: Sequence[int], namespace: bytes) -> bytes:
    """Chained hash of one full block: depends on every token before it, the model and
    the layout (`namespace`). blake2b over fixed-width integers: stable across processes
    and Python versions, no pickle."""
    h = hashlib.blake2b(digest_size=HASH_BYTES, person=b"unikern-kv-v1")
    h.update(namespace)
    h.update(parent or b"\0" * HASH_BYTES)
    h.update(struct.pack(f"<{len(token_ids)}I", *token_ids))
    return h.digest()


def partial_hashes(parent: bytes | None, token_ids: Sequence[int], namespace: bytes, unit: int) -> list[bytes]:
    """Hashes of the leading `unit`, 2 x `unit`, ... tokens of a block (every whole unit of
    `token_ids`), chained to the block's parent as `block_hash` is. Another blake2b
    personalization: a partial hash can never equal a full block's, whatever its length."""
    h = hashlib.blake2b(digest_size=HASH_BYTES, person=b"unikern-kvpart1")
    h.update(namespace)
    h.update(parent or b"\0" * HASH_BYTES)
    data = struct.pack(f"<{len(token_ids)}I", *token_ids)
    out = []
    for start in range(0, len(token_ids) - unit + 1, unit):
        h.update(data[4 * start : 4 * (start + unit)])
        out.append(h.copy().digest())
    return out


class PartialHit(NamedTuple):
    """The leading `num_tokens` slots of cached block `source` (referenced for the caller)
    hold what a prompt's fresh block `dest` needs: copy them there before it is read."""

    source: int
    dest: int
    num_tokens: int


class BlockManager:
    """Logical blocks of `block_size` tokens. Ids are handed out lowest first, so the pool
    stays compact and its tail can be given back when idle.

    Host tier: with `host_blocks` > 0 the pool has that many more physical blocks, and a
    cached block pushed out of the device budget moves to a host LRU instead of being
    forgotten. On unified memory both tiers are the same RAM, so the move is a change of
    books, not of bytes; a prefix hit on a host block brings it back the same way. The
    device budget (`num_blocks`) bounds referenced + device-cached blocks.

    Partial hits (`partial_unit` > 0): each committed block also registers the hashes of
    its leading 1, 2, ... (block_size / partial_unit - 1) units. A prompt whose full-block
    hit ends at block k can then reuse the longest cached leading part of the block at k
    (`allocate_prompt_partial`): that block is shared and its later slots hold other
    tokens, so the part is copied into the prompt's own fresh block, not shared."""

    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        namespace: bytes = b"",
        reserved_blocks: int = 0,
        host_blocks: int = 0,
        partial_unit: int = 0,
    ) -> None:
        """`num_blocks` device blocks plus `host_blocks` host blocks get ids from
        reserved_blocks up; the reserved ids below them are never handed out (the pool's
        zero block). `partial_unit`: the tokens of a partial hit come in whole units of
        it (a divisor of block_size; 0: no partial hits)."""
        if num_blocks < 1 or block_size < 1 or host_blocks < 0:
            raise ValueError(
                f"need num_blocks >= 1, block_size >= 1 and host_blocks >= 0, got "
                f"{num_blocks}, {block_size}, {host_blocks}"
            )
        if partial_unit < 0 or (partial_unit and block_size % partial_unit):
            raise ValueError(f"partial_unit must be 0 or a divisor of block_size {block_size}, got {partial_unit}")
        self.num_blocks = num_blocks
        self.host_blocks = host_blocks
        self.block_size = block_size
        self.namespace = namespace
        self.reserved_blocks = reserved_blocks
        self._physical_blocks = num_blocks + host_blocks
        total = self._physical_blocks + reserved_blocks
        self.ref_counts = [0] * total
        self.block_hashes: list[bytes | None] = [None] * total
        self._free_uncached = list(range(reserved_blocks, total))  # a heap: lowest id first
        self._free_cached: OrderedDict[int, None] = OrderedDict()  # device tier, LRU first
        self._host_cached: OrderedDict[int, None] = OrderedDict()  # host tier, LRU first
        self.hash_to_block: dict[bytes, int] = {}
        # partial hashes -> the block that registered each first, and each block's own
        # entries (dropped when the block is forgotten)
        self.partial_unit = partial_unit if partial_unit < block_size else 0
        self.partial_to_block: dict[bytes, int] = {}
        self._partials_of: dict[int, list[bytes]] = {}
        self.hits = 0  # prefix-hit blocks, any tier
        self.misses = 0
        self.partial_hits = 0  # prompts that reused the leading part of a cached block
        self.partial_hit_tokens = 0  # the tokens they reused that way
        self.kept_partial = 0  # ended sequences' last blocks kept for partial hits (keep_partial)
        self.evictions = 0  # cached blocks forgotten
        self.host_hits = 0
        self.host_misses = 0
        self.host_evictions = 0
        self.device_evictions = 0  # cached blocks leaving the device budget (to host or gone)
        # (block id, hash) of every block commit_full_block registers, while a consumer
        # (the tier planner) tracks commits; None: not recorded
        self._committed: list[tuple[int, bytes]] | None = None

    # ---- queries ----------------------------------------------------------------------

    @property
    def num_used(self) -> int:
        """Referenced blocks: what the device budget cannot give to anyone else."""
        return (
            self._physical_blocks
            - len(self._free_uncached)
            - len(self._free_cached)
            - len(self._host_cached)
        )

    @property
    def num_free(self) -> int:
        """Device blocks free to allocate: uncached, or cached and evictable."""
        return self.num_blocks - self.num_used

    @property
    def num_cached(self) -> int:
        return len(self.hash_to_block)

    @property
    def num_host_cached(self) -> int:
        return len(self._host_cached)

    def is_on_host(self, block_id: int) -> bool:
        return block_id in self._host_cached

    def highest_used(self) -> int:
        """1 + the highest block id that is referenced or cached (0 when none)."""
        for block_id in range(len(self.ref_counts) - 1, self.reserved_blocks - 1, -1):
            if self.ref_counts[block_id] or self.block_hashes[block_id] is not None:
                return block_id + 1
        return 0

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def prefix_hashes(self, token_ids: Sequence[int]) -> list[bytes]:
        """Chained hashes of every full block of `token_ids`."""
        hashes: list[bytes] = []
        parent = None
        bs = self.block_size
        for start in range(0, len(token_ids) - bs + 1, bs):
            parent = block_hash(parent, token_ids[start : start + bs], self.namespace)
            hashes.append(parent)
        return hashes

    def lookup_prefix(self, hashes: Sequence[bytes]) -> list[int]:
        """Block ids of the longest cached prefix (no state change)."""
        found = []
        for h in hashes:
            block_id = self.hash_to_block.get(h)
            if block_id is None:
                break
            found.append(block_id)
        return found

    # ---- allocation -------------------------------------------------------------------

    def can_allocate(self, num_blocks: int, reuse: Sequence[int] = ()) -> bool:
        # reused blocks that are free and cached come out of the free count too
        reclaimed = sum(1 for b in reuse if self.ref_counts[b] == 0)
        return self.num_free - reclaimed >= num_blocks

    def allocate_prompt(self, token_ids: Sequence[int], max_cached_tokens: int) -> tuple[list[int], int]:
        """Blocks for a prompt: cached full blocks reused (at most `max_cached_tokens`
        tokens' worth), the rest fresh. Returns (block ids, cached token count), or
        raises OutOfBlocks when the pool cannot hold it."""
        blocks, cached, _ = self._allocate(token_ids, max_cached_tokens, partial=False)
        return blocks, cached

    def allocate_prompt_partial(
        self, token_ids: Sequence[int], max_cached_tokens: int
    ) -> tuple[list[int], int, PartialHit | None]:
        """`allocate_prompt`, then, past the full-block hit, the longest cached leading
        part of the next block (whole `partial_unit`s, within `max_cached_tokens`): the
        cached count includes it, and the PartialHit says what to copy. Its source block
        holds one more reference for the caller, to `free` once the copy has run."""
        return self._allocate(token_ids, max_cached_tokens, partial=self.partial_unit > 0)

    def _allocate(
        self, token_ids: Sequence[int], max_cached_tokens: int, partial: bool
    ) -> tuple[list[int], int, PartialHit | None]:
        hashes = self.prefix_hashes(token_ids)
        hit = self.lookup_prefix(hashes)[: max_cached_tokens // self.block_size]
        fresh = self.blocks_needed(len(token_ids)) - len(hit)
        source, part = self._lookup_partial(token_ids, hashes, len(hit), max_cached_tokens) if partial else (None, 0)
        reuse = hit + [source] if source is not None else hit
        if not self.can_allocate(fresh, reuse):
            raise OutOfBlocks(f"need {fresh} free blocks, have {self.num_free}")
        from_host = [b for b in hit if b in self._host_cached]
        # device hits first: promoting a host block may push a device-cached block out,
        # and it must not be one of this prompt's own hits
        self.take([b for b in hit if b not in self._host_cached])
        self.take(from_host)
        if source is not None:  # after the hits, for the same reason
            self.take([source])
        self.hits += len(hit)
        self.misses += max(len(hashes) - len(hit), 0)
        self.host_hits += len(from_host)
        if self.host_blocks:
            self.host_misses += max(len(hashes) - len(hit), 0)
        blocks = hit + [self.allocate_one() for _ in range(fresh)]
        cached = len(hit) * self.block_size
        if source is None:
            return blocks, cached, None
        self.partial_hits += 1
        self.partial_hit_tokens += part
        return blocks, cached + part, PartialHit(source, blocks[len(hit)], part)

    def _lookup_partial(
        self, token_ids: Sequence[int], hashes: Sequence[bytes], num_hit: int, max_cached_tokens: int
    ) -> tuple[int | None, int]:
        """(cached block, tokens) of the longest registered leading part of the block at
        position `num_hit`, or (None, 0)."""
        unit, start = self.partial_unit, num_hit * self.block_size
        end = min(start + self.block_size - unit, max_cached_tokens)  # a whole block is a full hit
        if end - start < unit:
            return None, 0
        parent = hashes[num_hit - 1] if num_hit else None
        candidates = partial_hashes(parent, token_ids[start:end], self.namespace, unit)
        for j in range(len(candidates), 0, -1):  # entries of a forgotten block leave gaps: longest first
            block_id = self.partial_to_block.get(candidates[j - 1])
            if block_id is not None:
                return block_id, j * unit
        return None, 0

    def allocate_one(self) -> int:
        self._make_device_room(adding=1)
        block_id = heapq.heappop(self._free_uncached)
        self.ref_counts[block_id] = 1
        return block_id

    def take(self, block_ids: Iterable[int]) -> None:
        """One more reference to each block (a prefix hit, or a pin that keeps a block's
        memory from reuse); a host block comes back to the device by accounting."""
        for block_id in block_ids:
            if block_id in self._host_cached:
                del self._host_cached[block_id]  # now counted as device-resident
                try:
                    self._make_device_room(adding=0)
                except OutOfBlocks:
                    self._host_cached[block_id] = None
                    self._host_cached.move_to_end(block_id, last=False)
                    raise
            elif self.ref_counts[block_id] == 0:
                self._free_cached.pop(block_id, None)
            self.ref_counts[block_id] += 1

    def _make_device_room(self, adding: int) -> None:
        """Keep referenced + device-cached blocks within the device budget, demoting the
        least recently used device-cached blocks to the host tier (or forgetting them)."""
        while self._device_resident() + adding > self.num_blocks:
            if not self._free_cached:
                raise OutOfBlocks("no free KV blocks")
            block_id, _ = self._free_cached.popitem(last=False)
            self.device_evictions += 1
            if not self.host_blocks:
                self._forget(block_id)
                continue
            if len(self._host_cached) >= self.host_blocks:
                victim, _ = self._host_cached.popitem(last=False)
                self.host_evictions += 1
                self._forget(victim)
            self._host_cached[block_id] = None

    def _device_resident(self) -> int:
        """Referenced plus device-cached blocks."""
        return self._physical_blocks - len(self._free_uncached) - len(self._host_cached)

    def _forget(self, block_id: int, count: bool = True) -> None:
        for h in self._partials_of.pop(block_id, ()):
            del self.partial_to_block[h]
        del self.hash_to_block[self.block_hashes[block_id]]
        self.block_hashes[block_id] = None
        heapq.heappush(self._free_uncached, block_id)
        self.evictions += count

    def commit_full_block(
        self, block_id: int, block_hash_: bytes, parent: bytes | None = None, token_ids: Sequence[int] | None = None
    ) -> None:
        """Register a block that has just been filled, so later prompts can reuse it; with
        its tokens (and its parent's hash), its leading parts too (partial hits)."""
        if self.block_hashes[block_id] is not None:
            return
        if block_hash_ in self.hash_to_block:
            return  # an identical block is already cached; this one stays private
        self.block_hashes[block_id] = block_hash_
        self.hash_to_block[block_hash_] = block_id
        if self.partial_unit and token_ids is not None:
            self._index_parts(block_id, parent, token_ids[: self.block_size - self.partial_unit])
        if self._committed is not None:
            self._committed.append((block_id, block_hash_))

    def keep_partial(self, block_id: int, parent: bytes | None, token_ids: Sequence[int]) -> bool:
        """A sequence's last block as the sequence ends, its first len(token_ids) slots
        written (fewer than a block): kept cached, with its leading whole units indexed, so
        a later prompt can copy them (the rest of a shared system prompt that never filled
        the block, a conversation's next turn), and evicted as any cached block. It is cached
        under its longest part's hash, which no whole block's can equal, and never committed
        to a lower tier. False, and nothing kept, where partial hits are off, the block is
        shared or cached already, or no unit of it is new to the index."""
        if not self.partial_unit or self.ref_counts[block_id] != 1 or self.block_hashes[block_id] is not None:
            return False
        own = self._index_parts(block_id, parent, token_ids)
        if not own:
            return False
        self.block_hashes[block_id] = own[-1]
        self.hash_to_block[own[-1]] = block_id
        self.kept_partial += 1
        return True

    def _index_parts(self, block_id: int, parent: bytes | None, token_ids: Sequence[int]) -> list[bytes]:
        """Index the leading whole units of `token_ids` (a block's first slots) under their
        partial hashes, pointing at `block_id`; the first registrant keeps an entry. The
        hashes this block now holds, dropped with it in `_forget`."""
        own = [h for h in partial_hashes(parent, token_ids, self.namespace, self.partial_unit)
               if h not in self.partial_to_block]
        for h in own:
            self.partial_to_block[h] = block_id
        if own:
            self._partials_of[block_id] = own
        return own

    def track_commits(self) -> None:
        """Start recording committed blocks for `drain_commits`."""
        if self._committed is None:
            self._committed = []

    def drain_commits(self) -> list[tuple[int, bytes]]:
        """(block id, hash) of the blocks committed since the last drain."""
        drained, self._committed = self._committed or [], [] if self._committed is not None else None
        return drained

    def free(self, blocks: Sequence[int]) -> None:
        """Drop one reference from each block (reserved ids are skipped); tail blocks go
        to the LRU end first so a prompt's shared head outlives its private tail."""
        for block_id in reversed(blocks):
            if block_id < self.reserved_blocks:
                continue  # a windowed table's released entry: it names the zero block
            count = self.ref_counts[block_id] - 1
            if count < 0:
                raise RuntimeError(f"block {block_id} freed more often than allocated")
            self.ref_counts[block_id] = count
            if count == 0:
                if self.block_hashes[block_id] is not None:
                    self._free_cached[block_id] = None
                else:
                    heapq.heappush(self._free_uncached, block_id)

    def evict_all_cached(self) -> None:
        for cached in (self._free_cached, self._host_cached):
            while cached:
                block_id, _ = cached.popitem(last=False)
                self._forget(block_id, count=False)
