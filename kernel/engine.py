"""The library front door: `async with Engine.from_pipeline(...) as engine`."""

from __future__ import annotations

import contextlib
import itertools
import os
import time
from collections.abc import AsyncIterator, Callable, Sequence
from typing import Any

import anyio
import msgspec
import psutil
import structlog
from anyio.streams.memory import MemoryObjectSendStream

from unikern import messages as m
from unikern import startup as startup_phases
from unikern.errors import RequestError, StageError, UnikernError
from unikern.platform import bridge_stats, current_platform
from unikern.router import INBOX_SIZE, Router
from unikern.sampling_params import sampling_params
from unikern.spec import PipelineSpec, load_pipeline

log = structlog.get_logger("unikern")

LogitsProcessor = Callable[[list[int], Any], Any]


class Completion(msgspec.Struct, frozen=True):
    token_ids: list[int]
    text: str
    finish_reason: str
    usage: m.Usage
    # prompt_logprobs=N asked: None for the first prompt token, then one report per token
    prompt_logprobs: tuple[m.PromptLogprob | None, ...] | None = None


_NO_ROUTE = object()


class Engine:
    """Runs one pipeline. Many `generate` calls may run at once, from asyncio or trio."""

    def __init__(self, spec: PipelineSpec) -> None:
        self.spec = spec
        self._router: Router | None = None
        self._requests: dict[str, MemoryObjectSendStream[Any] | object] = {}
        self._ids = itertools.count()
        self._id_prefix = f"req-{os.getpid()}-{id(self) & 0xFFFF:x}"
        self._tg: anyio.abc.TaskGroup | None = None
        self.fault: StageError | None = None
        self._faulted: anyio.Event | None = None
        self.startup: dict[str, float] = {}  # seconds per start-up phase, once ready (unikern.startup)

    @classmethod
    def from_pipeline(
        cls,
        pipeline: str = "generate",
        *,
        model: str | None = None,
        overrides: dict[str, dict[str, Any]] | None = None,
    ) -> Engine:
        """`pipeline` is a built-in name or a YAML path; `model` overrides every stage's
        model; `overrides` maps stage name -> {param: value}."""
        return cls(load_pipeline(pipeline, model=model, overrides=overrides))

    # ---- lifecycle -------------------------------------------------------------------

    async def __aenter__(self) -> Engine:
        entered = startup_phases.process_age_s()  # the seconds before the engine (import_s)
        started = time.perf_counter()
        self._faulted = anyio.Event()
        egress_send, egress_receive = anyio.create_memory_object_stream[Any](INBOX_SIZE)
        self._router = Router(self.spec, egress_send, self._on_fault)
        self._tg = anyio.create_task_group()
        await self._tg.__aenter__()
        try:
            self._tg.start_soon(self._dispatch, egress_receive)
            await self._tg.start(self._router.run)
        except BaseException as exc:
            self._tg.cancel_scope.cancel()
            try:
                await self._tg.__aexit__(type(exc), exc, exc.__traceback__)
            except BaseExceptionGroup as group:
                raise _single_unikern_error(group) from None
            raise _single_unikern_error(exc) from None
        self.startup = startup_phases.collect(
            (getattr(stage, "startup", None) or {} for stage in self._router.stages.values()),
            entered, entered + time.perf_counter() - started)
        log.info("engine.ready", pipeline=self.spec.name, **self.startup)
        return self

    async def __aexit__(self, *exc_info: Any) -> bool | None:
        assert self._tg is not None
        tg, self._tg = self._tg, None  # new requests are refused from here on
        tg.cancel_scope.cancel()
        try:
            result = await tg.__aexit__(*exc_info)
        finally:
            for stream in self._requests.values():
                if stream is not _NO_ROUTE:
                    stream.close()
            self._requests.clear()
        if self.fault is not None and exc_info[0] is None:
            raise self.fault
        return result

    @property
    def model(self) -> str:
        return str(self._router.resources.get("model_name", "")) if self._router else ""

    def stats(self) -> dict[str, Any]:
        """Merged `stats()` of every stage, by section (platform, memory, kv, ...)."""
        merged: dict[str, Any] = {
            "platform": current_platform().to_stats(),
            "memory": {"rss_bytes": psutil.Process().memory_info().rss},
            "bridge": bridge_stats(),
        }
        if self._router is None:
            return merged
        for stage in self._router.stages.values():
            for section, values in stage.stats().items():
                if isinstance(values, dict):
                    merged.setdefault(section, {}).update(values)
                else:
                    merged[section] = values
        if self.startup:  # every stage's phases with the engine's own (the execute stage's alone before ready)
            merged.setdefault("model", {})["startup"] = self.startup
        return merged

    async def wait_for_fault(self) -> StageError:
        """Return once a stage has failed (never, while all is well)."""
        assert self._faulted is not None, "the engine is not running"
        await self._faulted.wait()
        assert self.fault is not None
        return self.fault

    def in_flight(self) -> int:
        return len(self._requests)

    # ---- requests --------------------------------------------------------------------

    def generate(
        self,
        prompt: str | None = None,
        *,
        prompt_tokens: Sequence[int] | None = None,
        messages: Sequence[dict[str, Any]] | None = None,
        max_tokens: int = 256,
        logits_processors: Sequence[LogitsProcessor] | None = None,
        request_id: str | None = None,
        **sampling: Any,
    ) -> AsyncIterator[m.TokenEvent | m.DoneEvent | m.ErrorEvent]:
        """An async iterator of token events, then one done (or error) event. The request
        is checked here, at the call; it starts when iteration starts. Close the
        iterator (or leave the scope) to cancel it. `sampling` takes the fields of
        `SamplingParams` (temperature, top_p, top_k, min_p, seed, stop, penalties,
        logit_bias, logprobs, top_logprobs, response_format, prompt_logprobs: the done
        event then carries the prompt's log-probabilities, and max_tokens may be 0)."""
        request = self._make_request(
            prompt, prompt_tokens, messages, max_tokens, sampling, logits_processors, request_id
        )
        return self._stream(request)

    async def _stream(self, request: m.Submit) -> AsyncIterator[m.TokenEvent | m.DoneEvent | m.ErrorEvent]:
        rid = request.request_id
        max_tokens = request.params.max_tokens
        if rid in self._requests:
            raise RequestError(f"request id {rid!r} is already in flight", code="duplicate_id")
        send, receive = anyio.create_memory_object_stream[Any](max_tokens + 8)
        self._requests[rid] = send
        finished = False
        try:
            await self._router.send(request)
            while True:
                try:
                    try:  # events already queued are handed over without a trip through the loop
                        event = receive.receive_nowait()
                    except anyio.WouldBlock:
                        event = await receive.receive()
                except anyio.EndOfStream:
                    return
                if isinstance(event, (m.DoneEvent, m.ErrorEvent)):
                    finished = True
                yield event
                if finished:
                    return
        finally:
            receive.close()
            if not finished:
                self._abandon(rid)
            send.close()

    async def complete(self, prompt: str | None = None, **kwargs: Any) -> Completion:
        """Run one request to the end and return its tokens, text and usage."""
        token_ids: list[int] = []
        pieces: list[str] = []
        async with contextlib.aclosing(self.generate(prompt, **kwargs)) as events:
            async for event in events:
                if isinstance(event, m.TokenEvent):
                    token_ids.append(event.token_id)
                    pieces.append(event.text)
                elif isinstance(event, m.DoneEvent):
                    return Completion(token_ids, "".join(pieces), event.finish_reason, event.usage,
                                      event.prompt_logprobs)
                else:
                    raise RequestError(event.message, event.code)
        raise UnikernError("request ended without a done event")

    def cancel(self, request_id: str) -> bool:
        """Cancel a request in flight: its event stream ends with a done event whose
        finish_reason is `cancelled`. False if no such request is in flight."""
        if request_id not in self._requests:
            return False
        self._send_cancel(request_id)
        return True

    def _abandon(self, request_id: str) -> None:
        """The caller stopped listening: cancel, and drop the request's remaining events."""
        stream = self._requests.get(request_id)
        if stream is None:
            return
        if stream is not _NO_ROUTE:
            self._requests[request_id] = _NO_ROUTE
            stream.close()
        self._send_cancel(request_id)

    def _send_cancel(self, request_id: str) -> None:
        if self._router is not None and self._tg is not None and self.fault is None:
            try:
                self._router.send_nowait(m.Cancel(request_id))
            except anyio.WouldBlock:
                self._tg.start_soon(self._router.send, m.Cancel(request_id))
            except (anyio.ClosedResourceError, anyio.BrokenResourceError):
                pass

    def is_active(self, request_id: str) -> bool:
        return request_id in self._requests

    def _make_request(
        self, prompt, prompt_tokens, messages, max_tokens, sampling, logits_processors, request_id
    ) -> m.Submit:
        if self._router is None or self._tg is None:
            raise UnikernError("the engine is not running: use `async with Engine.from_pipeline(...)`")
        if self.fault is not None:
            raise self.fault
        given = [n for n, v in (("prompt", prompt), ("prompt_tokens", prompt_tokens), ("messages", messages)) if v is not None]
        if len(given) != 1:
            raise RequestError(
                f"give exactly one of prompt, prompt_tokens or messages (got {', '.join(given) or 'none'})"
            )
        params = sampling_params(max_tokens=max_tokens, **sampling)
        rid = request_id if request_id is not None else f"{self._id_prefix}-{next(self._ids)}"
        if rid in self._requests:
            raise RequestError(f"request id {rid!r} is already in flight", code="duplicate_id")
        return m.Submit(
            request_id=rid,
            params=params,
            prompt=prompt,
            prompt_tokens=tuple(prompt_tokens) if prompt_tokens is not None else None,
            messages=tuple(dict(x) for x in messages) if messages is not None else None,
            processors=tuple(logits_processors or ()),
        )

    # ---- egress ----------------------------------------------------------------------

    async def _dispatch(self, egress) -> None:
        async with egress, self._router.egress:
            async for event in egress:
                if isinstance(event, m.EventBatch):
                    for one in event.events:
                        self._deliver(one)
                else:
                    self._deliver(event)

    def _deliver(self, event: Any) -> None:
        rid = event.id
        stream = self._requests.get(rid)
        last = isinstance(event, (m.DoneEvent, m.ErrorEvent))
        if last:
            self._requests.pop(rid, None)
        if stream is None or stream is _NO_ROUTE:
            return
        try:
            stream.send_nowait(event)
        except (anyio.WouldBlock, anyio.BrokenResourceError, anyio.ClosedResourceError):
            pass
        if last:
            stream.close()

    def _on_fault(self, error: StageError) -> None:
        """A stage failed: every request in flight gets an error event naming it."""
        self.fault = error
        if self._faulted is not None:
            self._faulted.set()
        for rid in list(self._requests):
            self._deliver(m.ErrorEvent(id=rid, code="stage_failed", message=str(error)))


def _single_unikern_error(exc: BaseException) -> BaseException:
    """Start-up failures surface as the one UnikernError inside, not a group of them."""
    while isinstance(exc, BaseExceptionGroup) and len(exc.exceptions) == 1:
        exc = exc.exceptions[0]
    if isinstance(exc, BaseExceptionGroup):
        errors = [e for e in exc.exceptions if isinstance(e, UnikernError)]
        if errors:
            return errors[0]
    return exc
