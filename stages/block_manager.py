"""Block bookkeeping for the paged KV pool: reference counts, a free list, and a prefix
cache of full logical blocks keyed by chained hashes, evicted LRU. Plain synchronous
code; the KV manager stage owns one and lends it to the scheduler."""

from __future__ import annotations

import hashlib
import heapq
import struct
from collections import OrderedDict
from collections.abc import Sequence

HASH_BYTES = 16


def block_hash(parent: bytes | None, token_ids: Sequence[int], namespace: bytes) -> bytes:
    """Chained hash of one full block: depends on every token before it, the model and
    the layout (`namespace`). blake2b over fixed-width integers: stable across processes
    and Python versions, no pickle."""
    h = hashlib.blake2b(digest_size=HASH_BYTES, person=b"unikern-kv-v1")
    h.update(namespace)
    h.update(parent or b"\0" * HASH_BYTES)
    h.update(struct.pack(f"<{len(token_ids)}I", *token_ids))
    return h.digest()


class BlockManager:
    """Logical blocks of `block_size` tokens. Ids are handed out lowest first, so the pool
    stays compact and its tail can be given back when idle."""

    def __init__(
        self, num_blocks: int, block_size: int, namespace: bytes = b"", reserved_blocks: int = 0
    ) -> None:
        """`num_blocks` usable blocks get ids reserved_blocks .. reserved_blocks + num_blocks - 1;
        the reserved ids below them are never handed out (the pool's zero block)."""
        if num_blocks < 1 or block_size < 1:
            raise ValueError(f"need num_blocks >= 1 and block_size >= 1, got {num_blocks}, {block_size}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.namespace = namespace
        self.reserved_blocks = reserved_blocks
        total = num_blocks + reserved_blocks
        self.ref_counts = [0] * total
        self.block_hashes: list[bytes | None] = [None] * total
        self._free_uncached = list(range(reserved_blocks, total))  # a heap: lowest id first
        self._free_cached: OrderedDict[int, None] = OrderedDict()  # LRU first
        self.hash_to_block: dict[bytes, int] = {}
        self.hits = 0
        self.misses = 0
        self.evictions = 0

    # ---- queries ----------------------------------------------------------------------

    @property
    def num_free(self) -> int:
        return len(self._free_uncached) + len(self._free_cached)

    @property
    def num_used(self) -> int:
        return self.num_blocks - self.num_free

    @property
    def num_cached(self) -> int:
        return len(self.hash_to_block)

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
        raises MemoryError when the pool cannot hold it."""
        hashes = self.prefix_hashes(token_ids)
        hit = self.lookup_prefix(hashes)[: max_cached_tokens // self.block_size]
        fresh = self.blocks_needed(len(token_ids)) - len(hit)
        if not self.can_allocate(fresh, hit):
            raise MemoryError(f"need {fresh} free blocks, have {self.num_free}")
        for block_id in hit:
            self._take(block_id)
        self.hits += len(hit)
        self.misses += max(len(hashes) - len(hit), 0)
        blocks = hit + [self.allocate_one() for _ in range(fresh)]
        return blocks, len(hit) * self.block_size

    def allocate_one(self) -> int:
        if self._free_uncached:
            block_id = heapq.heappop(self._free_uncached)
        elif self._free_cached:
            block_id, _ = self._free_cached.popitem(last=False)
            del self.hash_to_block[self.block_hashes[block_id]]
            self.block_hashes[block_id] = None
            self.evictions += 1
        else:
            raise MemoryError("no free KV blocks")
        self.ref_counts[block_id] = 1
        return block_id

    def _take(self, block_id: int) -> None:
        if self.ref_counts[block_id] == 0:
            self._free_cached.pop(block_id, None)
        self.ref_counts[block_id] += 1

    def commit_full_block(self, block_id: int, block_hash_: bytes) -> None:
        """Register a block that has just been filled, so later prompts can reuse it."""
        if self.block_hashes[block_id] is not None:
            return
        if block_hash_ in self.hash_to_block:
            return  # an identical block is already cached; this one stays private
        self.block_hashes[block_id] = block_hash_
        self.hash_to_block[block_hash_] = block_id

    def free(self, blocks: Sequence[int]) -> None:
        """Drop one reference from each block; tail blocks go to the LRU end first so a
        prompt's shared head outlives its private tail."""
        for block_id in reversed(blocks):
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
        while self._free_cached:
            block_id, _ = self._free_cached.popitem(last=False)
            del self.hash_to_block[self.block_hashes[block_id]]
            self.block_hashes[block_id] = None
            heapq.heappush(self._free_uncached, block_id)
