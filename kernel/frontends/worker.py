"""`unikern worker`: serve the NDJSON protocol over stdin/stdout, so that another process
can drive an engine line by line."""

from __future__ import annotations

import os
import signal
import sys
import threading
from collections.abc import AsyncIterable, Iterator
from typing import Any, BinaryIO

import anyio
import anyio.from_thread
import anyio.lowlevel
import msgspec
import structlog

from unikern import messages as m
from unikern.engine import Engine
from unikern.errors import StageError, UnikernError
from unikern.frontends.protocol import (
    CancelOp,
    GenerateOp,
    ProtocolError,
    StatsOp,
    decode_op,
    encode_event,
)
from unikern.startup import describe as describe_startup

log = structlog.get_logger("unikern.worker")

MAX_LINE_BYTES = 16 << 20
# after the drain, cancelled requests get this long to report `cancelled`
CANCEL_GRACE_SECONDS = 5.0
# after a fault, request tasks get this long to write their error events
FAULT_GRACE_SECONDS = 2.0
# after a fault, input already sent is still answered (with errors) for this long
FAULT_SETTLE_SECONDS = 0.25


class OversizeLine(msgspec.Struct, frozen=True):
    """A line longer than MAX_LINE_BYTES: its bytes were dropped as they came."""

    num_bytes: int


class Worker:
    """Answers every line in; a bad line gets an error event naming its line number and
    the worker keeps serving. End of input drains the requests in flight, then exits 0. A
    stage fault fails every request in flight and exits 1. SIGTERM/SIGINT stop reading,
    drain for up to `drain_seconds`, then cancel what is left; every request still gets its
    done (or error) event."""

    def __init__(self, engine: Engine, out: BinaryIO, drain_seconds: float = 30.0) -> None:
        self.engine = engine
        self.out = out
        self.drain_seconds = drain_seconds
        self.tasks_running = 0
        self.idle = anyio.Event()
        self.idle.set()
        self.active: set[str] = set()  # ids of the requests this worker runs
        self._reading = anyio.CancelScope()

    def emit(self, event: Any) -> None:
        self.out.write(encode_event(event))
        self.out.flush()

    def error(self, message: str, *, line: int | None, request_id: str | None = None, code: str = "bad_request") -> None:
        self.emit({"event": "error", "id": request_id, "code": code, "message": message, "line": line})

    def stats_event(self) -> dict[str, Any]:
        return {"event": "stats", **self.engine.stats()}

    async def serve(self, lines: AsyncIterable[bytes | OversizeLine]) -> int:
        self.emit({"event": "ready", "model": self.engine.model, "pipeline": self.engine.spec.name})
        async with anyio.create_task_group() as tg:
            tg.start_soon(self._watch_signals, tg.cancel_scope)
            tg.start_soon(self._watch_fault, tg.cancel_scope)
            with self._reading:  # cancelled on a fault or a signal: stop reading
                number = 0
                async for raw in lines:
                    number += 1
                    self.handle_line(raw, number, tg)
            await self._drain(tg.cancel_scope)
        return 1 if self.engine.fault is not None else 0

    async def _drain(self, scope: anyio.CancelScope) -> None:
        await self.idle.wait()
        scope.cancel()

    def handle_line(self, raw: bytes | OversizeLine, number: int, tg: anyio.abc.TaskGroup) -> None:
        if isinstance(raw, OversizeLine):
            self.error(f"the line is {raw.num_bytes} bytes; at most {MAX_LINE_BYTES}", line=number)
            return
        line = raw.strip()
        if not line:
            return
        if len(line) > MAX_LINE_BYTES:
            self.error(f"the line is {len(line)} bytes; at most {MAX_LINE_BYTES}", line=number)
            return
        try:
            op = decode_op(line)
        except ProtocolError as exc:
            self.error(str(exc), line=number, request_id=exc.request_id)
            return
        match op:
            case StatsOp():
                self.emit(self.stats_event())
            case CancelOp(id=rid):
                if not self.engine.cancel(rid):
                    self.error(f"no request {rid!r} is in flight", line=number, request_id=rid, code="unknown_id")
            case GenerateOp():
                if self.engine.is_active(op.id):
                    self.error(f"request id {op.id!r} is already in flight", line=number, request_id=op.id, code="duplicate_id")
                    return
                self._start(tg, op, number)

    def _start(self, tg: anyio.abc.TaskGroup, op: GenerateOp, number: int) -> None:
        try:
            events = self.engine.generate(
                op.prompt,
                prompt_tokens=op.prompt_tokens,
                messages=[msgspec.structs.asdict(x) for x in op.messages] if op.messages is not None else None,
                request_id=op.id,
                **op.sampling(),
            )
        except StageError as exc:  # the pipeline has failed; the worker is stopping
            self.error(str(exc), line=number, request_id=op.id, code="stage_failed")
            return
        except UnikernError as exc:
            self.error(str(exc), line=number, request_id=op.id, code=getattr(exc, "code", "bad_request"))
            return
        self.active.add(op.id)
        self.tasks_running += 1
        self.idle = anyio.Event() if self.tasks_running == 1 else self.idle
        tg.start_soon(self._run_request, events, op.id, number)

    async def _run_request(self, events, request_id: str, number: int) -> None:
        try:
            async for event in events:
                if isinstance(event, m.ErrorEvent):
                    self.error(event.message, line=number, request_id=request_id, code=event.code)
                else:
                    self.emit(event)
        except UnikernError as exc:
            self.error(str(exc), line=number, request_id=request_id, code=getattr(exc, "code", "stage_failed"))
        except anyio.get_cancelled_exc_class():
            # the last resort of shutdown: the request did not end within the grace period
            self.error("the worker stopped before the request finished", line=number, request_id=request_id, code="shutdown")
            raise
        finally:
            self.active.discard(request_id)
            self.tasks_running -= 1
            if self.tasks_running == 0:
                self.idle.set()

    async def _watch_fault(self, scope: anyio.CancelScope) -> None:
        await self.engine.wait_for_fault()
        # keep answering for a moment: lines already written to us get their error
        # events, and request tasks write theirs; then stop reading and exit
        with anyio.move_on_after(FAULT_GRACE_SECONDS):
            await anyio.sleep(FAULT_SETTLE_SECONDS)
            await self.idle.wait()
        self._reading.cancel()
        scope.cancel()

    async def _watch_signals(self, scope: anyio.CancelScope) -> None:
        try:
            receiver = anyio.open_signal_receiver(signal.SIGTERM, signal.SIGINT)
        except (NotImplementedError, ValueError):  # not the main thread, or no signals here
            return
        with receiver as signals:
            async for signum in signals:
                log.warning("signal received: draining", signal=signal.Signals(signum).name, seconds=self.drain_seconds)
                self._reading.cancel()
                with anyio.move_on_after(self.drain_seconds):
                    await self.idle.wait()
                if self.active:
                    log.warning("drain time is up: cancelling", requests=len(self.active))
                    for rid in list(self.active):
                        self.engine.cancel(rid)
                    with anyio.move_on_after(CANCEL_GRACE_SECONDS):
                        await self.idle.wait()
                scope.cancel()
                return


def read_lines(fd: int, max_line_bytes: int = MAX_LINE_BYTES) -> Iterator[bytes | OversizeLine]:
    """Lines of a file descriptor, each at most `max_line_bytes` held in memory."""
    pending = bytearray()
    oversize = 0  # > 0 while dropping the rest of a line that is too long
    while chunk := os.read(fd, 1 << 16):
        start = 0
        while start < len(chunk):
            end = chunk.find(b"\n", start)
            stop = len(chunk) if end < 0 else end + 1
            if oversize:
                oversize += stop - start
            else:
                pending += chunk[start:stop]
                if len(pending) > max_line_bytes + 2:  # + "\r\n"; handle_line checks the rest
                    oversize, pending = len(pending), bytearray()
            start = stop
            if end >= 0:
                yield OversizeLine(oversize) if oversize else bytes(pending)
                oversize, pending = 0, bytearray()
    if oversize or pending:
        yield OversizeLine(oversize) if oversize else bytes(pending)


def open_stdin_lines(fd: int = 0) -> anyio.abc.ObjectReceiveStream[bytes | OversizeLine]:
    """Stdin lines as a stream fed by a daemon thread reading with `os.read`, so that
    stopping (a fault, a signal) never waits for the next input line, and a blocked read
    cannot hold a lock at exit."""
    send, receive = anyio.create_memory_object_stream[Any](64)
    token = anyio.lowlevel.current_token()

    def pump() -> None:
        try:
            for line in read_lines(fd):
                anyio.from_thread.run(send.send, line, token=token)
        except (RuntimeError, OSError, anyio.BrokenResourceError, anyio.ClosedResourceError):
            pass  # the loop or the reader is gone, or stdin failed: end of input either way
        finally:
            try:
                anyio.from_thread.run_sync(send.close, token=token)
            except RuntimeError:
                pass

    threading.Thread(target=pump, name="unikern-stdin", daemon=True).start()
    return receive


async def run_worker(engine_factory, *, drain_seconds: float = 30.0) -> int:
    async with engine_factory() as engine:
        # stdout's ready event keeps the protocol's fields; where the start went is in
        # stats (model.startup) and on stderr
        print(f"unikern: {describe_startup(engine.startup)}", file=sys.stderr, flush=True)
        worker = Worker(engine, sys.stdout.buffer, drain_seconds)
        with open_stdin_lines() as lines:
            code = await worker.serve(lines)
        if engine.fault is not None:
            engine.fault = None  # reported already; exit with 1 instead of raising
            code = 1
        return code
