"""offload_mover: moves logical KV blocks between the pool and the disk tier.

Loads (a request is held until they land) go before stores, and at most
`max_inflight_blocks` blocks move at once (`OffloadQueue`). The pool is touched only on
the model thread, between steps, in pieces of at most `max_blocks_per_call` blocks:
one strided memcpy per layer through zero-copy views (`block_io`). Compression,
checksums and file I/O run on worker threads, off the model thread, so a step never
waits for zstd. Measured on these CPUs (tools/bench_offload.py): copying a block out
costs a few percent of compressing it.

A store's blocks stay pinned (by the schedule stage) until their bytes have been copied
out; then BlocksStored unpins them and the copy goes to disk. At shutdown, copies
already taken are still written (up to `drain_timeout_s`).
"""

from __future__ import annotations

import time
from typing import Any

import anyio
import numpy as np
import structlog

from unikern import messages as m
from unikern.platform import shared_bridge
from unikern.stage import StageBase, StageContext, StageParams, serve_inbox
from unikern.stages.tiers.block_io import BlockLayout, copy_in, copy_out
from unikern.stages.tiers.queue import Job, OffloadQueue

log = structlog.get_logger("unikern")


class OffloadParams(StageParams, frozen=True):
    max_inflight_blocks: int = 16  # blocks being loaded or stored at once
    max_blocks_per_call: int = 4  # blocks per model-thread call: keeps each pause short
    drain_timeout_s: float = 10.0  # at shutdown, time allowed to finish writes under way

    def validate(self) -> list[str]:
        problems = []
        if self.max_inflight_blocks < 1:
            problems.append(f"max_inflight_blocks: must be >= 1, got {self.max_inflight_blocks}")
        if self.max_blocks_per_call < 1:
            problems.append(f"max_blocks_per_call: must be >= 1, got {self.max_blocks_per_call}")
        if self.drain_timeout_s < 0:
            problems.append(f"drain_timeout_s: must be >= 0, got {self.drain_timeout_s}")
        return problems


class MoverStats:
    def __init__(self) -> None:
        self.blocks_loaded = 0
        self.blocks_stored = 0
        self.load_misses = 0
        self.copy_errors = 0
        self.copy_seconds = 0.0  # on the model thread, both directions
        self.longest_call_seconds = 0.0  # the longest pause a copy gave the model thread
        self.read_seconds = 0.0  # read + verify + decompress, worker threads
        self.write_seconds = 0.0  # compress + write, worker threads
        self.bytes_read = 0  # raw (uncompressed) bytes
        self.bytes_written = 0

    def as_dict(self) -> dict[str, Any]:
        return dict(vars(self))


class OffloadMoverStage(StageBase):
    Params = OffloadParams
    consumes = (m.LoadBlocks, m.StoreBlocks)
    produces = (m.BlocksLoaded, m.BlocksStored)
    requires = ("kv", "model", "disk")

    async def run(self, ctx: StageContext, *, task_status) -> None:
        self.pool = ctx.resource("kv").pool
        self.thread = ctx.resource("model").thread
        self.disk = ctx.resource("disk")
        self.layout = BlockLayout.of(self.pool)
        self.bridge = shared_bridge()
        self.queue = OffloadQueue(self.params.max_inflight_blocks, self.params.max_blocks_per_call)
        self.mover = MoverStats()
        self._wake = anyio.Event()

        async with anyio.create_task_group() as tg:
            tg.start_soon(self._dispatch, ctx, tg)
            task_status.started()

            async def handle(message: m.LoadBlocks | m.StoreBlocks) -> None:
                self.queue.push(message)
                self._wake.set()

            await serve_inbox(ctx, handle)
            tg.cancel_scope.cancel()

    async def _dispatch(self, ctx: StageContext, tg: anyio.abc.TaskGroup) -> None:
        while True:
            while (job := self.queue.next_job()) is not None:
                tg.start_soon(self._run_job, ctx, job)
            await self._wake.wait()
            self._wake = anyio.Event()

    async def _run_job(self, ctx: StageContext, job: Job) -> None:
        try:
            if job.kind == "load":
                await self._load(ctx, job)
            else:
                await self._store(ctx, job)
        finally:
            self.queue.done(job)
            self._wake.set()

    async def _on_model_thread(self, fn, block_ids: list[int], buffers: list[np.ndarray]) -> bool:
        """Run a pool copy in pieces of max_blocks_per_call blocks; False if it failed."""
        step = self.params.max_blocks_per_call

        def timed(ids: list[int], bufs: list[np.ndarray]) -> float:
            start = time.perf_counter()
            fn(self.pool, self.bridge, ids, bufs)
            return time.perf_counter() - start

        try:
            for i in range(0, len(block_ids), step):
                seconds = await self.thread.run(timed, block_ids[i : i + step], buffers[i : i + step])
                self.mover.copy_seconds += seconds
                self.mover.longest_call_seconds = max(self.mover.longest_call_seconds, seconds)
        except Exception as exc:  # the model thread is gone (shutdown) or the copy was refused
            self.mover.copy_errors += 1
            log.warning("offload.copy_failed", error=repr(exc))
            return False
        return True

    async def _load(self, ctx: StageContext, job: Job) -> None:
        buffers = [self.layout.new_buffer() for _ in job.blocks]

        def read_chain() -> int:
            for i, (ref, buffer) in enumerate(zip(job.blocks, buffers, strict=True)):
                if not self.disk.read(ref.block_hash, buffer):
                    return i  # the chain breaks here: later blocks are useless
            return len(buffers)

        start = time.perf_counter()
        try:
            num_loaded = await anyio.to_thread.run_sync(read_chain)
        except Exception as exc:  # never fail the request: it recomputes instead
            log.warning("offload.load_failed", error=repr(exc))
            num_loaded = 0
        self.mover.read_seconds += time.perf_counter() - start
        self.mover.bytes_read += num_loaded * self.layout.nbytes
        block_ids = [ref.block_id for ref in job.blocks[:num_loaded]]
        if num_loaded and not await self._on_model_thread(copy_in, block_ids, buffers[:num_loaded]):
            num_loaded = 0
        self.mover.blocks_loaded += num_loaded
        self.mover.load_misses += len(job.blocks) - num_loaded
        await ctx.send(m.BlocksLoaded(job.request_id, job.blocks, num_loaded))

    async def _store(self, ctx: StageContext, job: Job) -> None:
        buffers = [self.layout.new_buffer() for _ in job.blocks]
        # shielded: the pins must come back, and bytes already copied out should reach
        # the disk even when the engine is closing
        with anyio.CancelScope(shield=True), anyio.move_on_after(self.params.drain_timeout_s):
            copied = await self._on_model_thread(copy_out, [r.block_id for r in job.blocks], buffers)
            try:
                ctx.send_nowait(m.BlocksStored(job.blocks))
            except anyio.WouldBlock:
                await ctx.send(m.BlocksStored(job.blocks))
            except (anyio.ClosedResourceError, anyio.BrokenResourceError):
                pass  # shutting down: nobody holds the pins any more
            if not copied:
                return
            pending = list(zip(job.blocks, buffers, strict=True))
            self.disk.queue_writes(len(pending))
            try:
                while pending:
                    ref, buffer = pending[0]
                    start = time.perf_counter()
                    try:
                        written = await anyio.to_thread.run_sync(self.disk.write, ref.block_hash, buffer)
                    except Exception as exc:  # a lost store is only a future miss
                        log.warning("offload.store_failed", error=repr(exc))
                        written = False
                    self.mover.write_seconds += time.perf_counter() - start
                    pending.pop(0)
                    self.disk.drop_writes(1)
                    if written:
                        self.mover.blocks_stored += 1
                        self.mover.bytes_written += buffer.nbytes
            finally:
                self.disk.drop_writes(len(pending))  # given up at shutdown

    def stats(self) -> dict[str, Any]:
        queue = getattr(self, "queue", None)
        if queue is None:
            return {}
        return {
            "offload": {
                "queued_blocks": queue.pending_blocks(),
                "inflight_blocks": queue.inflight_blocks,
                **self.mover.as_dict(),
            }
        }
