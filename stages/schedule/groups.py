"""Windowed block tables in the scheduler's books. A mixed model's windowed layers
(gemma3, gpt-oss) keep a table of their own (`WindowGroup`), in an id space of their
own (their own books over their own pool), holding only the blocks their window
reaches, while the full layers' table (`Sequence.blocks`) keeps every block; admission
and the never-fits check count each table by what it holds at once. Plain synchronous
code, called by `Scheduler`."""

from __future__ import annotations

from collections.abc import Sequence

from unikern.stages.kv.blocks import BlockManager, OutOfBlocks
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


def never_fits(blocks: BlockManager, window: int | None, group: WindowGroup | None, num_tokens: int,
               max_prefill_chunk: int) -> str | None:
    """Why a sequence of `num_tokens` tokens could never be held, even alone in an empty
    pool; None if it can. A windowed table (`window`: the one table is windowed; `group`:
    a mixed model's window group) holds at most its window and a chunk at once, whatever
    the length; a full one holds every block."""
    bs = blocks.block_size
    chunk = min(num_tokens, max_prefill_chunk)
    tables = [("", blocks, window)]
    if group is not None:
        tables.append((" of the windowed layers", group.books, group.window))
    for name, books, table_window in tables:
        if table_window is None:
            need = books.blocks_needed(num_tokens)
            what = f"{num_tokens} tokens"
        else:
            need = min(books.blocks_needed(num_tokens), window_blocks_at_once(table_window, bs, chunk))
            what = f"its {table_window}-token window and a {chunk}-token prefill chunk"
        if need > books.num_blocks:
            return (
                f"the prompt needs {need * bs} KV slots{name} at once ({what}; {need} blocks of {bs}) "
                f"but the whole KV pool{name} holds {books.num_blocks * bs} ({books.num_blocks} blocks); "
                f"raise kv.memory_fraction or kv.kv_budget_bytes"
                + (", or lower schedule.max_prefill_chunk" if table_window else "")
            )
    return None


def allocate_windowed(seq, blocks: BlockManager, window: int | None, group: WindowGroup | None, states,
                      max_cached: int, max_prefill_chunk: int) -> int:
    """Admission when a table is windowed: a prefix hit as long as every table has
    what the first computed query reads (a full table: every block before it; a
    windowed one: the blocks of its window), windowed tables holding only those and
    the first chunk's blocks. Returns the cached token count; OutOfBlocks takes nothing."""
    bs = blocks.block_size
    hashes = blocks.prefix_hashes(seq.tokens)
    hit = max_cached // bs
    while True:  # shorter hits, until every table (and a state checkpoint) has it
        h = hit
        if window is None:
            h = min(h, len(blocks.lookup_prefix(hashes[:h])))
        else:
            h = window_hit(blocks, hashes, h, window)
        if group is not None:
            h = group.hit(hashes, h)
        if states is not None:
            h = states.limit_cached(seq.tokens, h * bs) // bs
        if h == hit:
            break
        hit = h
    until = min(len(seq.tokens), hit * bs + max_prefill_chunk)
    if group is not None and not group.check_room(hashes, hit, until):
        raise OutOfBlocks("the windowed layers' pool is full")
    if window is None:
        seq.blocks, cached = blocks.allocate_prompt(seq.tokens, hit * bs)
    else:
        seq.blocks = allocate_window_table(blocks, hashes, hit, window, until)
        cached = hit * bs
    if group is not None:
        group.admit(seq, hashes, hit, until)
    return cached
