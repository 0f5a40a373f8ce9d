"""Tiering policy, plain synchronous code: what to load before a request is scheduled,
what to store, and in which order the offload mover works."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from unikern import messages as m
from unikern.stages.kv.blocks import BlockManager


@dataclass
class Staged:
    request_id: str
    pins: list[int]  # hit blocks, then own blocks once loaded
    waiting_on: set[bytes]  # hashes whose loads are in flight (own or another request's)


@dataclass
class TierStats:
    loads_requested: int = 0  # blocks asked of the disk tier
    loads_done: int = 0  # blocks that came back verified
    load_failures: int = 0  # missing or corrupt: recomputed
    stores_requested: int = 0


class TierPlanner:
    """The schedule side of tiering. A prompt whose chained block hashes continue on
    disk after its device/host hits is held back: its hits are pinned (so loading cannot
    evict them), fresh blocks are allocated and pinned for the disk blocks, and one
    LoadBlocks asks the mover to fill them. When they are in, the loaded blocks are
    committed to the prefix cache and the request becomes admissible, holding its pins
    until admission, where they turn into prefix hits. Committed blocks not yet on disk are
    pinned and sent to be stored; the pin is dropped once the mover has copied them out.

    Split layer groups (`window_blocks`: a mixed model's windowed layers' books): a file
    holds every layer, so each load fills a block in both groups and each store copies
    the block of the same hash from both (a block the window group no longer caches is
    not stored). Loaded window blocks go back to its cache once loaded; admission takes
    those its window needs, or shortens the hit."""

    def __init__(
        self, blocks: BlockManager, on_disk: Callable[[bytes], bool], window_blocks: BlockManager | None = None
    ) -> None:
        self.blocks = blocks
        self.window_blocks = window_blocks
        self.on_disk = on_disk
        self.staged: dict[str, Staged] = {}
        self.loading: dict[bytes, str] = {}  # hash -> request loading it
        self.storing: set[bytes] = set()
        self.stats = TierStats()
        blocks.track_commits()

    # ---- loads ------------------------------------------------------------------------

    def plan_load(self, request: m.Tokenized) -> tuple[bool, m.LoadBlocks | None]:
        """(hold the request?, what to load). Held requests wait for `loaded`."""
        blocks = self.blocks
        tokens = request.prompt_tokens
        usable = (len(tokens) - 1) // blocks.block_size  # the last token is always computed
        hashes = blocks.prefix_hashes(tokens[: usable * blocks.block_size])
        hits = blocks.lookup_prefix(hashes)
        to_load: list[bytes] = []
        waiting_on: set[bytes] = set()
        for h in hashes[len(hits) :]:
            if h in self.loading:
                waiting_on.add(h)
            elif self.on_disk(h):
                to_load.append(h)
            else:
                break
        room = blocks.num_free - sum(1 for b in hits if blocks.ref_counts[b] == 0)
        if self.window_blocks is not None:
            room = min(room, self.window_blocks.num_free)
        to_load = to_load[: max(room, 0)]
        if room < 0 or (not to_load and not waiting_on):
            return False, None
        blocks.take(hits)
        window = self.window_blocks
        refs = tuple(
            m.BlockRef(blocks.allocate_one(), h, window.allocate_one() if window is not None else -1) for h in to_load
        )
        for h in to_load:
            self.loading[h] = request.request_id
        self.staged[request.request_id] = Staged(request.request_id, list(hits), waiting_on | set(to_load))
        self.stats.loads_requested += len(refs)
        return True, (m.LoadBlocks(request.request_id, refs) if refs else None)

    def loaded(self, done: m.BlocksLoaded) -> list[tuple[str, list[int]]]:
        """Commit what loaded, free what did not; returns (request id, pins) of every
        request that no longer waits for anything."""
        blocks = self.blocks
        good, bad = done.blocks[: done.num_loaded], done.blocks[done.num_loaded :]
        for ref in good:
            blocks.commit_full_block(ref.block_id, ref.block_hash)
            if self.window_blocks is not None:
                self.window_blocks.commit_full_block(ref.window_block_id, ref.block_hash)
        self.stats.loads_done += len(good)
        self.stats.load_failures += len(bad)
        blocks.free([ref.block_id for ref in bad])  # never committed: back to the free list
        if self.window_blocks is not None:  # cached now (or free, if bad): admission takes what it needs
            self.window_blocks.free([ref.window_block_id for ref in done.blocks])
        owner = self.staged.get(done.request_id)
        if owner is not None:
            owner.pins += [ref.block_id for ref in good]
        else:  # cancelled while loading: the loaded blocks stay cached, unpinned
            blocks.free([ref.block_id for ref in good])
        finished = {ref.block_hash for ref in done.blocks}
        for h in finished:
            self.loading.pop(h, None)
        ready = []
        for rid, staged in list(self.staged.items()):
            staged.waiting_on -= finished
            if not staged.waiting_on:
                del self.staged[rid]
                ready.append((rid, staged.pins))
        return ready

    def cancel(self, request_id: str) -> None:
        """A held request ended: drop its pins (its own loads are freed when they land)."""
        staged = self.staged.pop(request_id, None)
        if staged is not None:
            self.blocks.free(staged.pins)

    # ---- stores -----------------------------------------------------------------------

    def plan_store(self) -> m.StoreBlocks | None:
        """Pin and send every newly committed block that is not on disk yet."""
        blocks = self.blocks
        window = self.window_blocks
        refs = []
        for block_id, h in blocks.drain_commits():
            if h in self.storing or blocks.block_hashes[block_id] != h or self.on_disk(h):
                continue
            window_id = -1
            if window is not None:
                window_id = window.hash_to_block.get(h, -1)
                if window_id < 0:
                    continue  # its windowed layers' block is gone: the file would be partial
            refs.append(m.BlockRef(block_id, h, window_id))
            self.storing.add(h)
        if not refs:
            return None
        blocks.take(ref.block_id for ref in refs)
        if window is not None:
            window.take(ref.window_block_id for ref in refs)
        self.stats.stores_requested += len(refs)
        return m.StoreBlocks(tuple(refs))

    def stored(self, done: m.BlocksStored) -> None:
        self.blocks.free([ref.block_id for ref in done.blocks])
        if self.window_blocks is not None:
            self.window_blocks.free([ref.window_block_id for ref in done.blocks])
        self.storing.difference_update(ref.block_hash for ref in done.blocks)
