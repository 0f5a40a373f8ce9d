"""Sliding windows on the scheduler's side: a windowed block table (every attention
layer of the model windowed, or the window group of a mixed model) lets go of the blocks
that left the window of its next query, is admitted with only its window's blocks, and
is counted by what it holds at once. Plain synchronous code, called by `Scheduler`."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from unikern.stages.kv.blocks import BlockManager, OutOfBlocks

if TYPE_CHECKING:
    from unikern.stages.execute.model import ModelGeometry

ZERO_BLOCK = 0  # the pool's reserved block of zeros: what a released table entry names


def released_window(geometry: ModelGeometry | None) -> int | None:
    """The widest window when every attention layer has one; None when any layer attends
    to the whole sequence (it reads every block) or none attends at all."""
    if geometry is None:
        return None
    attention = [s for s in geometry.layers if s.kind != "state"]
    if not attention or any(s.kind != "window" for s in attention):
        return None
    return max(s.window for s in attention)


def split_window(geometry: ModelGeometry | None) -> int | None:
    """The widest window of a model that mixes full and windowed attention layers (its
    windowed layers can keep a table of their own); None otherwise."""
    if geometry is None:
        return None
    kinds = {s.kind for s in geometry.layers}
    if not {"full", "window"} <= kinds:
        return None
    return max(s.window for s in geometry.layers if s.kind == "window")


def window_blocks_at_once(window: int, block_size: int, chunk: int) -> int:
    """The most blocks a windowed table holds at once while a chunk of `chunk` tokens
    prefills (the keys its first query sees, then the chunk's own): what a windowed
    group must have free for a request to ever run, whatever its length."""
    return -(-(window - 1 + chunk) // block_size) + 1


def window_hit(blocks: BlockManager, hashes: Sequence[bytes], hit_blocks: int, window: int) -> int:
    """The longest prefix hit (in blocks, at most `hit_blocks`) that a windowed table
    can take: the first query after it sees the keys from (hit - window + 1) on, so
    every block of that stretch must still be cached; earlier ones are not needed."""
    bs = blocks.block_size
    for h in range(hit_blocks, 0, -1):
        first = max(0, h * bs - window + 1) // bs
        if all(x in blocks.hash_to_block for x in hashes[first:h]):
            return h
    return 0


def allocate_window_table(
    blocks: BlockManager, hashes: Sequence[bytes], hit_blocks: int, window: int, until: int
) -> list[int]:
    """A windowed table at admission: the zero block for what the first query (at
    hit_blocks x block) cannot see, the cached blocks of its window (taken), and fresh
    blocks up to `until` tokens (the first chunk: later ones grow chunk by chunk).
    Raises OutOfBlocks, taking nothing, when the free blocks are too few."""
    bs = blocks.block_size
    first = max(0, hit_blocks * bs - window + 1) // bs
    hits = [blocks.hash_to_block[h] for h in hashes[first:hit_blocks]]
    fresh = max(0, blocks.blocks_needed(until) - hit_blocks)
    if not blocks.can_allocate(fresh, hits):
        raise OutOfBlocks(f"a windowed table needs {fresh} free blocks, have {blocks.num_free}")
    # device hits first: promoting a host block may push a device-cached one out
    blocks.take([b for b in hits if not blocks.is_on_host(b)])
    from_host = [b for b in hits if blocks.is_on_host(b)]
    blocks.take(from_host)
    blocks.hits += len(hits)
    blocks.host_hits += len(from_host)
    blocks.misses += max(len(hashes) - hit_blocks, 0)
    return [ZERO_BLOCK] * first + hits + [blocks.allocate_one() for _ in range(fresh)]


def release_out_of_window(blocks: BlockManager, seq: Any, window: int, until: int | None = None) -> int:
    """Free `seq`'s blocks that no query from `seq.num_computed` on can see (mlx-lm's
    rule: query q sees keys q - window < k <= q), pointing their table entries at the
    zero block. A step's earliest query is num_computed, so every later one of a chunk
    or a lookahead window sees less. Full blocks were committed before they could leave
    the window, so they go back as cached blocks: a later prompt still hits the chain.
    `until` (at admission): also free the fresh blocks past that many tokens, which
    the scheduler allocates again chunk by chunk. Returns the number freed."""
    return release_table(blocks, seq.blocks, seq.num_computed, window, until)


def release_table(blocks: BlockManager, table: list[int], num_computed: int, window: int,
                  until: int | None = None) -> int:
    """release_out_of_window on one table (edited in place)."""
    freed: list[int] = []
    keep = blocks.blocks_needed(until) if until is not None else len(table)
    if len(table) > keep:
        freed = table[keep:]
        del table[keep:]
    first_seen = max(0, num_computed - window + 1)
    gone = min(first_seen // blocks.block_size, len(table))
    first = gone
    while first > 0 and table[first - 1] != ZERO_BLOCK:  # released ones lead the table
        first -= 1
    freed += table[first:gone]
    table[first:gone] = [ZERO_BLOCK] * (gone - first)
    blocks.free(freed)
    return len(freed)
