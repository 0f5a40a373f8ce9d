"""Sliding windows on the scheduler's side: when every attention layer of a model is
windowed, a sequence lets go of the blocks that left the window of its next query.
Plain synchronous code, called by `Scheduler`."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from unikern.stages.kv.blocks import BlockManager

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


def release_out_of_window(blocks: BlockManager, seq: Any, window: int, until: int | None = None) -> int:
    """Free `seq`'s blocks that no query from `seq.num_computed` on can see (mlx-lm's
    rule: query q sees keys q - window < k <= q), pointing their table entries at the
    zero block. A step's earliest query is num_computed, so every later one of a chunk
    or a lookahead window sees less. Full blocks were committed before they could leave
    the window, so they go back as cached blocks: a later prompt still hits the chain.
    `until` (at admission): also free the fresh blocks past that many tokens, which
    the scheduler allocates again chunk by chunk. Returns the number freed."""
    freed: list[int] = []
    keep = blocks.blocks_needed(until) if until is not None else len(seq.blocks)
    if len(seq.blocks) > keep:
        freed = seq.blocks[keep:]
        del seq.blocks[keep:]
    first_seen = max(0, seq.num_computed - window + 1)
    gone = min(first_seen // blocks.block_size, len(seq.blocks))
    first = gone
    while first > 0 and seq.blocks[first - 1] != ZERO_BLOCK:  # released ones lead the table
        first -= 1
    freed += seq.blocks[first:gone]
    seq.blocks[first:gone] = [ZERO_BLOCK] * (gone - first)
    blocks.free(freed)
    return len(freed)
