"""Steps to the model thread and their StepDones back in order (serve_in_order), with a
decode window's tokens handed on while the window runs (execute.stream_interval_ms).

A lookahead window queues all its steps on the device before reading any token back,
and its StepDone comes when the last step is done: 23 tokens a row arrived at once, 98
to 326 ms apart through `unikern serve` at the 8B shape on an H100
(tools/bench/bench_http.py), where llama-server sends each token as it comes. Here the
model thread reads each step's tokens as that step finishes (the steps were queued one
`async_eval` each, so reading step i waits for step i alone; with the CPU kernels, which
compute each step as its graph is built, while the window is built) and, once
`interval_s` has passed since the window began or since its last hand-on, puts every
row's tokens so far on the step's queue, which the event loop sends on as WindowTokens.
The interval bounds the rate of extra messages, whatever the step rate. The window's
last step goes with its StepDone, as before."""

from __future__ import annotations

import queue
import time
from collections.abc import Callable

import anyio
import anyio.to_thread

from unikern import messages as m
from unikern.stage import StageContext
from unikern.stages.execute.thread import ModelThread

# what the model thread puts on a step's queue after its last hand-on (_deliver stops there)
STEP_END = object()


class WindowStream:
    """Hands a window's tokens to the queue of its step, registered by the execute stage
    before the step goes to the model thread (`open`) and drained on the event loop."""

    def __init__(self, interval_s: float) -> None:
        self.interval_s = interval_s
        self._queues: dict[int, queue.SimpleQueue] = {}
        self.sent = 0  # WindowTokens handed on (stats)

    def open(self, step_id: int) -> queue.SimpleQueue:
        q: queue.SimpleQueue = queue.SimpleQueue()
        self._queues[step_id] = q
        return q

    def close(self, step_id: int) -> None:
        """The step is done on the model thread: its queue ends (STEP_END)."""
        q = self._queues.pop(step_id, None)
        if q is not None:
            q.put(STEP_END)

    def close_all(self) -> None:
        """End every queue still open: the stage stops, and steps it queued never ran (a
        helper thread still waiting on one would keep the interpreter from exiting)."""
        for step_id in list(self._queues):
            self.close(step_id)

    def reader(self, step_id: int, request_ids: list[str]) -> WindowReader | None:
        """The hand-ons of the window `step_id` (None: it has no queue)."""
        q = self._queues.get(step_id)
        return None if q is None else WindowReader(self, q, request_ids)


class WindowReader:
    """One window's hand-ons, on the model thread: its steps' tokens read in order
    (`read_to`), each row's so far put on the step's queue whenever the stream's interval
    has passed since the window began or since the last hand-on."""

    def __init__(self, stream: WindowStream, q: queue.SimpleQueue, request_ids: list[str]) -> None:
        self.stream, self.q, self.request_ids = stream, q, request_ids
        self.rows: list[list[int]] = [[] for _ in request_ids]
        self.read = 0  # steps read
        self.last = time.perf_counter()

    def read_to(self, sampled: list, n: int) -> None:
        """Read steps up to `n` of `sampled` (one [rows] array per step, each already
        queued: `tolist` waits for that step alone)."""
        for tokens in sampled[self.read:n]:
            for row, token in zip(self.rows, tokens.tolist(), strict=True):
                row.append(token)
            now = time.perf_counter()
            if now - self.last >= self.stream.interval_s:
                self.q.put(dict(zip(self.request_ids, [list(r) for r in self.rows], strict=True)))
                self.stream.sent += 1
                self.last = now
        self.read = max(self.read, n)


def run_step(stream: WindowStream, step_id: int, fn: Callable, *args):
    """fn(*args) on the model thread, then the end of the step's queue (also on failure)."""
    try:
        return fn(*args)
    finally:
        stream.close(step_id)


async def serve_in_order(ctx: StageContext, thread: ModelThread, call, stream: WindowStream | None = None) -> None:
    """Each Step goes to the model thread as it arrives, `call(step)` giving what to run;
    the StepDones go out in the steps' order. A step sent while the one before runs
    (schedule's overlap_windows) then starts the moment that one ends, without waiting
    for the event loop to take its StepDone. With `stream`, a window's WindowTokens go
    out while it runs, after the StepDone of the step before it."""
    try:
        async with anyio.create_task_group() as tg:
            previous: anyio.Event | None = None
            async for step in ctx.inbox:
                sent = anyio.Event()
                fn, *args = call(step)
                tokens = None
                if stream is not None and step.num_steps > 1:
                    tokens = stream.open(step.step_id)
                    fn, args = run_step, [stream, step.step_id, fn, *args]
                tg.start_soon(_deliver, ctx, thread, thread.submit(fn, *args), previous, sent, step.step_id, tokens)
                previous = sent
    except BaseExceptionGroup as group:  # the failed step's own error, as the stage's
        if len(group.exceptions) == 1:
            raise group.exceptions[0] from None
        raise
    finally:
        if stream is not None:
            stream.close_all()


async def _deliver(ctx: StageContext, thread: ModelThread, future, previous: anyio.Event | None,
                   sent: anyio.Event, step_id: int, tokens: queue.SimpleQueue | None) -> None:
    if tokens is not None:  # the window's tokens so far, as the model thread hands them on
        if previous is not None:
            await previous.wait()
        while (rows := await anyio.to_thread.run_sync(tokens.get, abandon_on_cancel=True)) is not STEP_END:
            await ctx.send(m.WindowTokens(step_id, rows))
    done = await thread.result(future)
    if previous is not None:
        await previous.wait()
    await ctx.send(done)
    sent.set()
