"""The window group of a mixed model (full and windowed attention layers, e.g. gemma3,
gpt-oss): its windowed layers keep a block table of their own, in an id space of their
own (their own books over their own pool), holding only the blocks their window
reaches, while the full layers' table (`Sequence.blocks`) keeps every block. Plain
synchronous code, called by `Scheduler`."""

from __future__ import annotations

from collections.abc import Sequence

from unikern.stages.kv.blocks import BlockManager
from unikern.stages.schedule.windows import (
    ZERO_BLOCK,
    allocate_window_table,
    release_table,
    window_blocks_at_once,
    window_hit,
)


class WindowGroup:
    """Books and window of the windowed layers; a sequence's table is `seq.window_blocks`,
    one entry per logical block as in the full table, released entries naming the zero
    block."""

    def __init__(self, books: BlockManager, window: int) -> None:
        self.books = books
        self.window = window

    def hit(self, hashes: Sequence[bytes], hit_blocks: int) -> int:
        return window_hit(self.books, hashes, hit_blocks, self.window)

    def needs_at_once(self, num_tokens: int, chunk: int) -> int:
        """Blocks a request of `num_tokens` tokens holds at most at once in this group."""
        return min(self.books.blocks_needed(num_tokens), window_blocks_at_once(self.window, self.books.block_size, chunk))

    def check_room(self, hashes: Sequence[bytes], hit_blocks: int, until: int) -> bool:
        bs = self.books.block_size
        first = max(0, hit_blocks * bs - self.window + 1) // bs
        hits = [self.books.hash_to_block[h] for h in hashes[first:hit_blocks]]
        return self.books.can_allocate(max(0, self.books.blocks_needed(until) - hit_blocks), hits)

    def admit(self, seq, hashes: Sequence[bytes], hit_blocks: int, until: int) -> None:
        seq.window_blocks = allocate_window_table(self.books, hashes, hit_blocks, self.window, until)

    def release(self, seq) -> None:
        release_table(self.books, seq.window_blocks, seq.num_computed, self.window)

    def missing(self, seq, num_tokens: int) -> int:
        return self.books.blocks_needed(num_tokens) - len(seq.window_blocks)

    def grow(self, seq, num_tokens: int) -> None:
        for _ in range(max(self.missing(seq, num_tokens), 0)):
            seq.window_blocks.append(self.books.allocate_one())

    def commit(self, seq, index: int, block_hash: bytes) -> None:
        block_id = seq.window_blocks[index]
        if block_id != ZERO_BLOCK:
            self.books.commit_full_block(block_id, block_hash)

    def free(self, seq) -> None:
        self.books.free(seq.window_blocks)
        seq.window_blocks = []
