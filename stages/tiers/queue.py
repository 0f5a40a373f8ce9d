"""The offload mover's work queue, plain synchronous code: loads (a request waits on
them) before stores, and a bound on blocks in flight (a state checkpoint counts as one)."""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from unikern import messages as m


@dataclass
class Job:
    kind: str  # "load" or "store"
    blocks: tuple[m.BlockRef, ...]
    request_id: str = ""
    states: tuple[m.StateRef, ...] = ()  # a load: LoadBlocks.state, if any; a store: checkpoints

    @property
    def size(self) -> int:
        return len(self.blocks) + len(self.states)


@dataclass
class OffloadQueue:
    """Loads first (a request waits on them), then stores in arrival order, with at most
    `max_inflight_blocks` blocks being moved at once (a single larger job runs alone)."""

    max_inflight_blocks: int
    max_store_batch: int = 8
    loads: deque[Job] = field(default_factory=deque)
    stores: deque[m.BlockRef] = field(default_factory=deque)
    state_stores: deque[m.StateRef] = field(default_factory=deque)
    inflight_blocks: int = 0

    def push(self, message: m.LoadBlocks | m.StoreBlocks) -> None:
        if isinstance(message, m.LoadBlocks):
            state = (message.state,) if message.state is not None else ()
            self.loads.append(Job("load", message.blocks, message.request_id, state))
        else:
            self.stores.extend(message.blocks)
            self.state_stores.extend(message.states)

    def drop_stores(self) -> int:
        """Forget the stores not started yet (shutdown); returns how many blocks and states."""
        dropped = len(self.stores) + len(self.state_stores)
        self.stores.clear()
        self.state_stores.clear()
        return dropped

    def pending_blocks(self) -> int:
        return sum(j.size for j in self.loads) + len(self.stores) + len(self.state_stores)

    def next_job(self) -> Job | None:
        """The next job that fits under the bound (and count it in flight), or None."""
        room = self.max_inflight_blocks - self.inflight_blocks
        if self.loads:
            job = self.loads[0]
            if job.size > room and self.inflight_blocks:
                return None  # loads keep their priority: stores wait behind them
            self.loads.popleft()
        elif (self.stores or self.state_stores) and room > 0:
            n = min(room, self.max_store_batch, len(self.stores))
            k = min(room - n, self.max_store_batch - n, len(self.state_stores))
            blocks = tuple(self.stores.popleft() for _ in range(n))
            job = Job("store", blocks, states=tuple(self.state_stores.popleft() for _ in range(k)))
        else:
            return None
        self.inflight_blocks += job.size
        return job

    def done(self, job: Job) -> None:
        self.inflight_blocks -= job.size
