"""`unikern worker`: serve the NDJSON protocol over stdin/stdout.

Every line in gets an answer; a bad line gets an error event naming its line number and
the worker keeps serving. End of input drains the requests in flight, then exits 0. A
stage fault fails every request in flight and exits 1. SIGTERM/SIGINT stop reading,
drain for up to `drain_seconds`, then cancel what is left.
"""

from __future__ import annotations

import signal
import sys
from typing import Any, BinaryIO

import anyio
import msgspec
import structlog

from . import messages as m
from .engine import Engine
from .errors import UnikernError
from .protocol import CancelOp, GenerateOp, ProtocolError, StatsOp, decode_op, encode_event

log = structlog.get_logger("unikern.worker")

MAX_LINE_BYTES = 16 << 20


class Worker:
    def __init__(self, engine: Engine, out: BinaryIO, drain_seconds: float = 30.0) -> None:
        self.engine = engine
        self.out = out
        self.drain_seconds = drain_seconds
        self.tasks_running = 0
        self.idle = anyio.Event()
        self.idle.set()

    def emit(self, event: Any) -> None:
        self.out.write(encode_event(event))
        self.out.flush()

    def error(self, message: str, *, line: int | None, request_id: str | None = None, code: str = "bad_request") -> None:
        self.emit({"event": "error", "id": request_id, "code": code, "message": message, "line": line})

    def stats_event(self) -> dict[str, Any]:
        return {"event": "stats", **self.engine.stats()}

    async def serve(self, lines) -> int:
        self.emit({"event": "ready", "model": self.engine.model, "pipeline": self.engine.spec.name})
        async with anyio.create_task_group() as tg:
            tg.start_soon(self._watch_signals, tg.cancel_scope)
            tg.start_soon(self._watch_fault, tg.cancel_scope)
            number = 0
            async for raw in lines:
                number += 1
                if self.engine.fault is not None:
                    break
                self.handle_line(raw, number, tg)
            await self._drain(tg.cancel_scope)
        return 1 if self.engine.fault is not None else 0

    async def _drain(self, scope: anyio.CancelScope) -> None:
        await self.idle.wait()
        scope.cancel()

    def handle_line(self, raw: bytes, number: int, tg: anyio.abc.TaskGroup) -> None:
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
                max_tokens=op.max_tokens,
                temperature=op.temperature,
                top_p=op.top_p,
                seed=op.seed,
                stop=[op.stop] if isinstance(op.stop, str) else (op.stop or ()),
                request_id=op.id,
            )
        except UnikernError as exc:
            self.error(str(exc), line=number, request_id=op.id, code=getattr(exc, "code", "bad_request"))
            return
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
        finally:
            self.tasks_running -= 1
            if self.tasks_running == 0:
                self.idle.set()

    async def _watch_fault(self, scope: anyio.CancelScope) -> None:
        while self.engine.fault is None:
            await anyio.sleep(0.05)
        # let request tasks write their error events, then stop
        with anyio.move_on_after(2):
            await self.idle.wait()
        scope.cancel()

    async def _watch_signals(self, scope: anyio.CancelScope) -> None:
        try:
            receiver = anyio.open_signal_receiver(signal.SIGTERM, signal.SIGINT)
        except (NotImplementedError, ValueError):  # not the main thread, or no signals here
            return
        with receiver as signals:
            async for signum in signals:
                log.warning("signal received: draining", signal=signal.Signals(signum).name, seconds=self.drain_seconds)
                with anyio.move_on_after(self.drain_seconds):
                    await self.idle.wait()
                scope.cancel()
                return


async def _stdin_lines():
    stdin = anyio.wrap_file(sys.stdin.buffer)
    while True:
        line = await stdin.readline()
        if not line:
            return
        yield line


async def run_worker(engine_factory, *, drain_seconds: float = 30.0) -> int:
    async with engine_factory() as engine:
        worker = Worker(engine, sys.stdout.buffer, drain_seconds)
        code = await worker.serve(_stdin_lines())
        if engine.fault is not None:
            engine.fault = None  # reported already; exit with 1 instead of raising
            code = 1
        return code
