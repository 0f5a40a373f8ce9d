"""offload_mover: moves logical KV blocks (and recurrent-state checkpoints) between the pools
and the disk tier, touching the pools only on the model thread between steps and running
compression, checksums and file I/O on worker threads, so a step never waits for zstd."""

from __future__ import annotations

import math
import time
from typing import Any

import anyio
import numpy as np
import structlog

from unikern import messages as m
from unikern.platform import shared_bridge
from unikern.stage import StageBase, StageContext, StageParams, serve_inbox
from unikern.stages.tiers.block_io import BlockLayout, copy_in, copy_out, tier_pools
from unikern.stages.tiers.disk.service import refuse_several_ranks, several_ranks_problems
from unikern.stages.tiers.queue import Job, OffloadQueue
from unikern.stages.tiers.state_io import StateLayout, copy_state_in, copy_state_out

log = structlog.get_logger("unikern")


class OffloadParams(StageParams, frozen=True):
    max_inflight_blocks: int = 16
    """Logical blocks being loaded from or stored to the disk tier at once (>= 1)."""
    max_blocks_per_call: int = 4
    """Blocks copied in or out of the pools per call on the model thread (>= 1), between steps:
    fewer keeps each pause of the step loop short."""
    drain_timeout_s: float = 10.0
    """At shutdown, seconds (>= 0) that the stores under way get to finish; stores still queued are dropped."""

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
        self.shutdown_flushed_blocks = 0  # written after shutdown began
        self.shutdown_dropped_blocks = 0  # queued or under way at shutdown, never written (states too)
        self.states_loaded = 0  # recurrent-state checkpoints, verified and in their slots
        self.state_load_misses = 0
        self.states_stored = 0

    def as_dict(self) -> dict[str, Any]:
        return dict(vars(self))


class OffloadMoverStage(StageBase):
    """Loads (a request is held until they land) go before stores, and at most
    `max_inflight_blocks` blocks move at once (`OffloadQueue`). The pool is touched in
    pieces of at most `max_blocks_per_call` blocks: one strided memcpy per layer through
    zero-copy views (`block_io`).

    A store's blocks stay pinned (by the schedule stage) until their bytes have been copied
    out; then BlocksStored unpins them and the copy goes to disk. At shutdown, stores under
    way are finished (for up to `drain_timeout_s` from then) and stores still queued are
    dropped; both are counted (`offload.shutdown_flushed_blocks`, `..._dropped_blocks`) and
    logged (`offload.shutdown`). State checkpoints (recurrent models) ride along: a load
    may fill one checkpoint slot, a store may write checkpoints, with the same pins."""

    Params = OffloadParams
    consumes = (m.LoadBlocks, m.StoreBlocks)
    produces = (m.BlocksLoaded, m.BlocksStored)
    requires = ("kv", "model", "disk")
    pipeline_problems = staticmethod(several_ranks_problems)  # (kernel/spec.py)

    async def run(self, ctx: StageContext, *, task_status) -> None:
        refuse_several_ranks(ctx.resource("model"), "offload_mover")
        kv = ctx.resource("kv")
        self.pool = tier_pools(kv)  # both groups' pools when split, as one
        self.states = kv.states
        self.state_layout = StateLayout.of(kv.states) if kv.states is not None else None
        self.thread = ctx.resource("model").thread
        self.disk = ctx.resource("disk")
        self.layout = BlockLayout.of(self.pool)
        self.bridge = shared_bridge()
        self.queue = OffloadQueue(self.params.max_inflight_blocks, self.params.max_blocks_per_call)
        self.mover = MoverStats()
        self._wake = anyio.Event()
        self._stores_under_way: set[anyio.CancelScope] = set()
        self.shutting_down = False
        self._drain_deadline = math.inf  # set at shutdown

        async def handle(message: m.LoadBlocks | m.StoreBlocks) -> None:
            self.queue.push(message)
            self._wake.set()

        try:
            async with anyio.create_task_group() as tg:
                self._tg = tg
                tg.start_soon(self._dispatch, ctx, tg)
                task_status.started()
                try:
                    await serve_inbox(ctx, handle)
                finally:
                    self._begin_shutdown(ctx)
                tg.cancel_scope.cancel()
        except BaseExceptionGroup as group:  # a fault is reported as itself, not as a group
            if len(group.exceptions) == 1:
                raise group.exceptions[0] from None
            raise
        finally:
            if self.shutting_down:
                log.info("offload.shutdown", flushed_blocks=self.mover.shutdown_flushed_blocks,
                         dropped_blocks=self.mover.shutdown_dropped_blocks)

    def _begin_shutdown(self, ctx: StageContext) -> None:
        """Drop the stores not started (counted) and give those under way
        drain_timeout_s from now; they are shielded from the pipeline's cancellation."""
        self.shutting_down = True
        dropped = self.queue.drop_stores()
        receive_nowait = getattr(ctx.inbox, "receive_nowait", None)
        while receive_nowait is not None:
            try:
                message = receive_nowait()
            except (anyio.WouldBlock, anyio.EndOfStream, anyio.ClosedResourceError):
                break
            if isinstance(message, m.StoreBlocks):
                dropped += len(message.blocks)
        self.mover.shutdown_dropped_blocks += dropped
        self._drain_deadline = anyio.current_time() + self.params.drain_timeout_s
        for scope in self._stores_under_way:
            scope.deadline = min(scope.deadline, self._drain_deadline)

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

    async def _on_model_thread(self, fn, block_ids: list[int], buffers: list[np.ndarray], target=None) -> bool:
        """Run a copy of the pool (or `target`, the state pool) in pieces of
        max_blocks_per_call blocks; False if it failed."""
        step = self.params.max_blocks_per_call
        target = self.pool if target is None else target

        def timed(ids: list[int], bufs: list[np.ndarray]) -> float:
            start = time.perf_counter()
            fn(target, self.bridge, ids, bufs)
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
        state = job.states[0] if job.states else None
        state_buffer = self.state_layout.new_buffer() if state is not None else None

        def read_all() -> tuple[int, bool]:
            num_loaded = len(buffers)
            for i, (ref, buffer) in enumerate(zip(job.blocks, buffers, strict=True)):
                if not self.disk.read(ref.block_hash, buffer):
                    num_loaded = i  # the chain breaks here: later blocks are useless
                    break
            state_ok = state is not None and self.disk.read_state(state.block_hash, state_buffer, state.num_tokens)
            return num_loaded, state_ok

        start = time.perf_counter()
        try:
            num_loaded, state_loaded = await anyio.to_thread.run_sync(read_all)
        except Exception as exc:  # never fail the request: it recomputes instead
            log.warning("offload.load_failed", error=repr(exc))
            num_loaded, state_loaded = 0, False
        self.mover.read_seconds += time.perf_counter() - start
        self.mover.bytes_read += num_loaded * self.layout.nbytes + (self.state_layout.nbytes if state_loaded else 0)
        block_ids = [_ids(ref) for ref in job.blocks[:num_loaded]]
        if num_loaded and not await self._on_model_thread(copy_in, block_ids, buffers[:num_loaded]):
            num_loaded = 0
        if state_loaded and not await self._on_model_thread(copy_state_in, [state.slot], [state_buffer], self.states):
            state_loaded = False
        self.mover.blocks_loaded += num_loaded
        self.mover.load_misses += len(job.blocks) - num_loaded
        self.mover.states_loaded += state_loaded
        self.mover.state_load_misses += state is not None and not state_loaded
        await ctx.send(m.BlocksLoaded(job.request_id, job.blocks, num_loaded, state, state_loaded))

    async def _store(self, ctx: StageContext, job: Job) -> None:
        buffers = [self.layout.new_buffer() for _ in job.blocks]
        state_buffers = [self.state_layout.new_buffer() for _ in job.states]
        # promised before the copy, so the disk tier keeps its directory lock until the
        # writes land (or are given up), even if it closes first
        records = [*zip(job.blocks, buffers, strict=True), *zip(job.states, state_buffers, strict=True)]
        pending = records if self.disk.queue_writes(len(records)) else []
        # shielded: the pins must come back, and stores under way should reach the disk
        # even when the engine is closing (for drain_timeout_s from then: _begin_shutdown)
        scope = anyio.CancelScope(shield=True, deadline=self._drain_deadline)
        self._stores_under_way.add(scope)
        attempted = 0  # blocks whose write was tried (it may still have failed: a miss later)
        try:
            with scope:
                copied = not job.blocks or await self._on_model_thread(
                    copy_out, [_ids(r) for r in job.blocks], buffers
                )
                if job.states:
                    slots = [r.slot for r in job.states]
                    copied = await self._on_model_thread(copy_state_out, slots, state_buffers, self.states) and copied
                stored = m.BlocksStored(job.blocks, job.states)
                try:
                    ctx.send_nowait(stored)
                except anyio.WouldBlock:  # unshielded: at shutdown nobody waits for the pins
                    self._tg.start_soon(ctx.send, stored)
                except (anyio.ClosedResourceError, anyio.BrokenResourceError):
                    pass  # shutting down: nobody holds the pins any more
                while copied and pending:
                    ref, buffer = pending[0]
                    start = time.perf_counter()
                    try:
                        if isinstance(ref, m.StateRef):
                            args = (self.disk.write_state, ref.block_hash, buffer, ref.num_tokens)
                        else:
                            args = (self.disk.write, ref.block_hash, buffer)
                        written = await anyio.to_thread.run_sync(*args)
                    except Exception as exc:  # a lost store is only a future miss
                        log.warning("offload.store_failed", error=repr(exc))
                        written = False
                    self.mover.write_seconds += time.perf_counter() - start
                    pending.pop(0)
                    attempted += 1
                    self.disk.drop_writes(1)
                    if written:
                        self.mover.states_stored += isinstance(ref, m.StateRef)
                        self.mover.blocks_stored += not isinstance(ref, m.StateRef)
                        self.mover.bytes_written += buffer.nbytes
                        self.mover.shutdown_flushed_blocks += self.shutting_down
        finally:
            self._stores_under_way.discard(scope)
            self.disk.drop_writes(len(pending))
            if self.shutting_down or self.disk.closed:  # refused, not copied, or out of time
                self.mover.shutdown_dropped_blocks += job.size - attempted

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


def _ids(ref: m.BlockRef) -> int | tuple[int, int]:
    """A block as block_io addresses it: its id, or (full, window) ids for split groups."""
    return ref.block_id if ref.window_block_id < 0 else (ref.block_id, ref.window_block_id)
