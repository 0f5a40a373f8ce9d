"""Partial prefix hits on the scheduler's side. A prefix hit shares whole cached blocks;
past its last one, the prompt's next block may still begin with tokens that a cached
block begins with too (the rest of a shared system prompt, a conversation's last turn
that ended inside a block). That block's later slots hold other tokens, so it is not
shared: its leading part, in whole `partial_unit`s, is copied into the prompt's own fresh
block by the step that first feeds the prompt (`Step.copies`), and the prompt computes
from there. The books index the parts and find the longest (`BlockManager`'s
`allocate_prompt_partial`, `keep_partial`); here the scheduler gathers the copies of the
step it plans, holds each copy's source block until the copy has run, and leaves an
ending sequence's unfilled last block cached for later hits. Plain attention only:
recurrent states and windowed tables have no such copy. Plain synchronous code, called
by `Scheduler`."""

from __future__ import annotations

from unikern.stages.kv.blocks import BlockManager
from unikern.stages.schedule.sequence import Sequence


class PartialHits:
    """The copies of the step being planned, over `blocks` (whose `partial_unit` is set)."""

    def __init__(self, blocks: BlockManager) -> None:
        self.blocks = blocks
        # partial prefix hits admitted for the step being planned: (source, dest, tokens)
        self._copies: list[tuple[int, int, int]] = []

    def allocate(self, seq: Sequence, max_cached: int) -> int:
        """Give seq its prompt's blocks and return its cached tokens, a partial hit's
        included: its copy joins the step's and its source, referenced for seq until
        `drop_copy_source`, is seq.copy_source. OutOfBlocks changes nothing."""
        seq.blocks, cached, part = self.blocks.allocate_prompt_partial(seq.tokens, max_cached)
        if part is not None:
            self._copies.append(tuple(part))
            seq.copy_source = part.source
        return cached

    def take_copies(self) -> tuple[tuple[int, int, int], ...]:
        """The planned step's copies (Step.copies); the next step's start empty."""
        copies, self._copies = tuple(self._copies), []
        return copies

    def keep_last_block(self, seq: Sequence) -> None:
        """An ending sequence's last, unfilled block stays cached for partial hits, its
        written whole units indexed (BlockManager.keep_partial): positions below
        num_computed are in the pool; a step still in flight writes only past them."""
        bs, unit = self.blocks.block_size, self.blocks.partial_unit
        i = len(seq.block_hashes)  # the first block not committed whole
        written = (seq.num_computed - i * bs) // unit * unit
        if 0 < written < bs and i < len(seq.blocks):
            parent = seq.block_hashes[-1] if seq.block_hashes else None
            self.blocks.keep_partial(seq.blocks[i], parent, seq.tokens[i * bs : i * bs + written])


def drop_copy_source(blocks: BlockManager, seq: Sequence | None) -> None:
    """Free the source block of seq's partial hit, once the step copying it is back,
    or once seq ends or is preempted: not before, while seq may still read its copy
    (a freed block can be reloaded from disk before the model thread reaches the
    copy); then, whatever the copy reads, only seq's own dropped blocks receive it."""
    if seq is not None and seq.copy_source is not None:
        blocks.free([seq.copy_source])
        seq.copy_source = None
