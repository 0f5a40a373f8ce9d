"""The offload mover's work queue, plain synchronous code: loads (a request waits on
them) before stores, and a bound on blocks in flight."""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from unikern import messages as m


@dataclass
class Job:
    kind: str  # "load" or "store"
    blocks: tuple[m.BlockRef, ...]
    request_id: str = ""


@dataclass
class OffloadQueue:
    """Loads first (a request waits on them), then stores in arrival order, with at most
    `max_inflight_blocks` blocks being moved at once (a single larger job runs alone)."""

    max_inflight_blocks: int
    max_store_batch: int = 8
    loads: deque[Job] = field(default_factory=deque)
    stores: deque[m.BlockRef] = field(default_factory=deque)
    inflight_blocks: int = 0

    def push(self, message: m.LoadBlocks | m.StoreBlocks) -> None:
        if isinstance(message, m.LoadBlocks):
            self.loads.append(Job("load", message.blocks, message.request_id))
        else:
            self.stores.extend(message.blocks)

    def drop_stores(self) -> int:
        """Forget the stores not started yet (shutdown); returns how many blocks."""
        dropped = len(self.stores)
        self.stores.clear()
        return dropped

    def pending_blocks(self) -> int:
        return sum(len(j.blocks) for j in self.loads) + len(self.stores)

    def next_job(self) -> Job | None:
        """The next job that fits under the bound (and count it in flight), or None."""
        room = self.max_inflight_blocks - self.inflight_blocks
        if self.loads:
            job = self.loads[0]
            if len(job.blocks) > room and self.inflight_blocks:
                return None  # loads keep their priority: stores wait behind them
            self.loads.popleft()
        elif self.stores and room > 0:
            n = min(room, self.max_store_batch, len(self.stores))
            job = Job("store", tuple(self.stores.popleft() for _ in range(n)))
        else:
            return None
        self.inflight_blocks += len(job.blocks)
        return job

    def done(self, job: Job) -> None:
        self.inflight_blocks -= len(job.blocks)
