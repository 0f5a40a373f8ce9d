"""The microkernel: wires stages by message type over bounded streams and runs them."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import anyio
import msgspec
import structlog
from anyio.abc import TaskGroup, TaskStatus
from anyio.streams.memory import MemoryObjectSendStream

from unikern.errors import ConfigError, StageError
from unikern.faults import planned_fault, wrap_inbox
from unikern.spec import EGRESS_TYPES, PipelineSpec, providers, start_order
from unikern.stage import StageContext

log = structlog.get_logger("unikern")

# Per-stage inbox bound: a flood of Submits turns into backpressure on the caller's send,
# and schedule.max_waiting refuses what would queue past it. Cycles never wait on
# themselves: schedule <-> output (StepOutput one way, an Abort per matched stop string
# the other) holds because output never blocks on schedule (output.AbortOutbox);
# schedule <-> execute has one step in flight; the offload mover's inbox loop never
# sends. tests/test_admission.py runs the cycle with inboxes of 0-2 messages.
INBOX_SIZE = 4096


class Router:
    """Owns the stages, their inboxes and the shared resources of one pipeline."""

    def __init__(
        self,
        spec: PipelineSpec,
        egress: MemoryObjectSendStream[Any],
        on_fault: Callable[[StageError], None],
    ) -> None:
        self.spec = spec
        classes = spec.stage_classes()
        self.stages: dict[str, Any] = {}
        for name, stage_spec in spec.stages.items():
            cls = classes[name]
            params = msgspec.convert(stage_spec.params, cls.Params)
            self.stages[name] = cls(name, params)
        self.order = start_order(classes)
        provided = providers(classes)
        # what each member waits for before its start: the providers of what it requires
        self._after = {name: {provided[key] for key in cls.requires} for name, cls in classes.items()}
        self.resources: dict[str, Any] = {}
        self._on_fault = on_fault
        self.egress = egress
        self._routes: dict[type, MemoryObjectSendStream[Any]] = {t: egress for t in EGRESS_TYPES}
        self._inboxes = {}
        self._senders: list[MemoryObjectSendStream[Any]] = []
        for name, stage in self.stages.items():
            send, receive = anyio.create_memory_object_stream[Any](INBOX_SIZE)
            self._inboxes[name] = receive
            self._senders.append(send)
            for message_type in stage.consumes:
                self._routes[message_type] = send
        self._scope: anyio.CancelScope | None = None
        self.all_started = anyio.Event()
        self._fault_plan = planned_fault()  # a test hook (kernel/faults.py); None normally

    def _route(self, message: Any) -> MemoryObjectSendStream[Any]:
        try:
            return self._routes[type(message)]
        except KeyError:
            raise ConfigError(f"no stage consumes {type(message).__name__}") from None

    async def send(self, message: Any) -> None:
        await self._route(message).send(message)

    def send_nowait(self, message: Any) -> None:
        self._route(message).send_nowait(message)

    async def run(self, *, task_status: TaskStatus[None] = anyio.TASK_STATUS_IGNORED) -> None:
        """Start each stage once the providers of what it requires have started, those
        that wait on none of each other at the same time (tokenize's tokenizer load beside
        execute's model load and warm-up); returns when cancelled or when a stage fails."""
        try:
            with anyio.CancelScope() as scope:
                self._scope = scope
                async with anyio.create_task_group() as tg:
                    await self._start_all(tg)
                    self.all_started.set()
                    log.debug("pipeline started", pipeline=self.spec.name, order=self.order)
                    task_status.started()
        finally:
            for stream in [*self._senders, *self._inboxes.values()]:
                stream.close()

    async def _start_all(self, tg: TaskGroup) -> None:
        started = {name: anyio.Event() for name in self.order}
        failed: list[BaseException] = []

        async def start(name: str) -> None:
            for before in self._after[name]:
                await started[before].wait()
            try:
                await tg.start(self._run_stage, name)
            except Exception as exc:  # the first failure is the start's error, as it was one by one
                failed.append(exc)
                starting.cancel_scope.cancel()
                return
            started[name].set()

        async with anyio.create_task_group() as starting:
            for name in self.order:
                starting.start_soon(start, name)
        if failed:
            raise failed[0]

    def stop(self) -> None:
        if self._scope is not None:
            self._scope.cancel()

    def _fail(self, name: str, exc: BaseException) -> None:
        error = exc if isinstance(exc, StageError) else StageError(name, exc)
        log.error("stage failed", stage=name, error=str(error))
        self._on_fault(error)
        self.stop()

    async def _run_stage(self, name: str, *, task_status: TaskStatus[None]) -> None:
        stage = self.stages[name]
        ctx = StageContext(
            name,
            wrap_inbox(name, self._inboxes[name], self._fault_plan),
            self.send,
            self.send_nowait,
            self.resources,
            self._fail,
            self.all_started,
        )
        started = False

        def mark_started(value: Any = None) -> None:
            nonlocal started
            started = True
            task_status.started(value)

        class _Status:
            def started(self, value: Any = None) -> None:
                mark_started(value)

        try:
            await stage.run(ctx, task_status=_Status())
        except anyio.get_cancelled_exc_class():
            raise
        except Exception as exc:  # a stage fault: report it to every request, then stop
            if not started:
                raise StageError(name, exc) from exc
            self._fail(name, exc)
