"""Tiering policy, plain synchronous code: what to load before a request is scheduled,
what to store, and in which order the offload mover works."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from unikern import messages as m
from unikern.stages.kv.blocks import BlockManager
from unikern.stages.schedule.states import StateTracker


@dataclass
class Staged:
    request_id: str
    pins: list[int]  # hit blocks, then own blocks once loaded
    waiting_on: set[bytes]  # hashes whose loads are in flight (own or another request's)
    waiting_states: set[bytes] = field(default_factory=set)  # state checkpoints likewise


@dataclass
class TierStats:
    loads_requested: int = 0  # blocks asked of the disk tier
    loads_done: int = 0  # blocks that came back verified
    load_failures: int = 0  # missing or corrupt: recomputed
    stores_requested: int = 0
    state_loads_requested: int = 0  # recurrent-state checkpoints, likewise
    state_loads_done: int = 0
    state_load_failures: int = 0
    state_stores_requested: int = 0


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
    those its window needs, or shortens the hit.

    Recurrent models (`states`): a prefix hit reaches only as far as a state checkpoint, so
    the load goes to the last block boundary whose checkpoint is in memory or on disk
    (`state_on_disk`), and a checkpoint found only on disk is loaded with the blocks into a
    reserved checkpoint slot, pinned for the request until admission. Checkpoints are
    stored like blocks: pinned until copied out."""

    def __init__(
        self,
        blocks: BlockManager,
        on_disk: Callable[[bytes], bool],
        states: StateTracker | None = None,
        state_on_disk: Callable[[bytes], bool] | None = None,
        window_blocks: BlockManager | None = None,
    ) -> None:
        self.blocks = blocks
        self.window_blocks = window_blocks
        self.on_disk = on_disk
        self.states = states
        self.state_on_disk = state_on_disk or (lambda block_hash: False)
        self.staged: dict[str, Staged] = {}
        self.loading: dict[bytes, str] = {}  # hash -> request loading it
        self.loading_states: dict[bytes, str] = {}  # hash -> request loading its checkpoint
        self.storing: set[bytes] = set()
        self.storing_states: set[bytes] = set()
        self.stats = TierStats()
        blocks.track_commits()
        if states is not None:
            states.books.track_commits()

    # ---- loads ------------------------------------------------------------------------

    def plan_load(self, request: m.Tokenized) -> tuple[bool, m.LoadBlocks | None]:
        """(hold the request?, what to load). Held requests wait for `loaded`."""
        blocks = self.blocks
        tokens = request.prompt_tokens
        usable = (len(tokens) - 1) // blocks.block_size  # the last token is always computed
        hashes = blocks.prefix_hashes(tokens[: usable * blocks.block_size])
        hits = blocks.lookup_prefix(hashes)
        room = blocks.num_free - sum(1 for b in hits if blocks.ref_counts[b] == 0)
        if self.window_blocks is not None:  # a loaded block takes a block in both groups
            room = min(room, self.window_blocks.num_free)
        if room < 0:
            return False, None
        chain: list[bytes] = []  # the blocks after the hits that will be in the pool
        num_to_load = 0
        for h in hashes[len(hits) :]:
            if h not in self.loading and not (num_to_load < room and self.on_disk(h)):
                break
            num_to_load += h not in self.loading
            chain.append(h)
        state_ref, state_wait, end = None, None, 0
        if self.states is not None:  # only as far as a checkpoint reaches
            end, state_ref, state_wait = self._plan_state(hashes, len(hits) + len(chain))
            chain = chain[: max(end - len(hits), 0)]
        to_load = [h for h in chain if h not in self.loading]
        waiting_on = set(chain) - set(to_load)
        if not to_load and not waiting_on and state_ref is None and state_wait is None:
            return False, None
        rid = request.request_id
        blocks.take(hits)
        window = self.window_blocks
        refs = tuple(
            m.BlockRef(blocks.allocate_one(), h, window.allocate_one() if window is not None else -1) for h in to_load
        )
        for h in to_load:
            self.loading[h] = rid
        staged = self.staged[rid] = Staged(rid, list(hits), waiting_on | set(to_load))
        self.stats.loads_requested += len(refs)
        if state_ref is not None:
            self.loading_states[state_ref.block_hash] = rid
            staged.waiting_states.add(state_ref.block_hash)
            self.stats.state_loads_requested += 1
        if state_wait is not None:
            staged.waiting_states.add(state_wait)
        elif state_ref is None and end:  # the checkpoint is in memory: keep it there until admission
            self.states.hold(rid, hashes[end - 1])
        return True, (m.LoadBlocks(rid, refs, state_ref) if refs or state_ref else None)

    def _plan_state(self, hashes: list[bytes], reach: int) -> tuple[int, m.StateRef | None, bytes | None]:
        """(blocks worth loading, the checkpoint to load, the one another load brings):
        the last boundary <= reach with a checkpoint in memory, in flight or on disk."""
        books = self.states.books
        in_memory = books.longest(hashes, reach)
        for n in range(reach, in_memory, -1):
            h = hashes[n - 1]
            if h in self.loading_states:
                return n, None, h
            if self.state_on_disk(h):
                slot = books.reserve()
                if slot is None:  # every checkpoint slot pinned: what memory has
                    break
                return n, m.StateRef(slot, h, n * self.blocks.block_size), None
        return in_memory, None, None

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
        finished_states = self._state_loaded(done, owner is not None)
        ready = []
        for rid, staged in list(self.staged.items()):
            staged.waiting_on -= finished
            staged.waiting_states -= finished_states
            if not staged.waiting_on and not staged.waiting_states:
                del self.staged[rid]
                ready.append((rid, staged.pins))
        return ready

    def _state_loaded(self, done: m.BlocksLoaded, owner_waits: bool) -> set[bytes]:
        """Commit (or give back) the checkpoint slot a load filled; a request still
        waiting for it holds it until admission. Returns the hashes no longer loading."""
        ref = done.state
        if ref is None or self.states is None:
            return set()
        self.loading_states.pop(ref.block_hash, None)
        books = self.states.books
        if not done.state_loaded:
            books.drop(ref.slot)
            self.stats.state_load_failures += 1
            return {ref.block_hash}
        books.commit(ref.slot, ref.block_hash, ref.num_tokens, loaded=True)
        self.stats.state_loads_done += 1
        if owner_waits:
            self.states.hold(done.request_id, ref.block_hash)
        return {ref.block_hash}

    def cancel(self, request_id: str) -> None:
        """A held request ended, or is gone: drop its pins (its own loads are freed or left
        cached, unpinned, when they land)."""
        staged = self.staged.pop(request_id, None)
        if staged is not None:
            self.blocks.free(staged.pins)
        if self.states is not None:
            self.states.drop_hold(request_id)

    # ---- stores -----------------------------------------------------------------------

    def plan_store(self) -> m.StoreBlocks | None:
        """Pin and send every newly committed block (and state checkpoint) that is not on
        disk yet."""
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
        states = self._plan_state_store()
        if not refs and not states:
            return None
        blocks.take(ref.block_id for ref in refs)
        if window is not None:
            window.take(ref.window_block_id for ref in refs)
        self.stats.stores_requested += len(refs)
        return m.StoreBlocks(tuple(refs), states)

    def _plan_state_store(self) -> tuple[m.StateRef, ...]:
        if self.states is None:
            return ()
        books = self.states.books
        refs = []
        for slot, h, num_tokens in books.drain_commits():
            if h in self.storing_states or books.hash_of.get(slot) != h or self.state_on_disk(h):
                continue
            books.hold(slot)  # until copied out
            refs.append(m.StateRef(slot, h, num_tokens))
            self.storing_states.add(h)
        self.stats.state_stores_requested += len(refs)
        return tuple(refs)

    def stored(self, done: m.BlocksStored) -> None:
        self.blocks.free([ref.block_id for ref in done.blocks])
        if self.window_blocks is not None:
            self.window_blocks.free([ref.window_block_id for ref in done.blocks])
        self.storing.difference_update(ref.block_hash for ref in done.blocks)
        for ref in done.states:
            self.states.books.unpin(ref.slot)
            self.storing_states.discard(ref.block_hash)
