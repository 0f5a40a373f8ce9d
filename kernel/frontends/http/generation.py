"""One HTTP request's run through the engine, whatever its API: admission (429 past
`max_waiting`), the first event before any response is sent (so a refusal is an HTTP
status), tokens as text pieces and tool calls, the outcome, and the metrics."""

from __future__ import annotations

import contextlib
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar

import anyio
import structlog
from starlette.requests import Request

from unikern import messages as m
from unikern.errors import UnikernError
from unikern.frontends.http.chat import ToolCall, ToolCallSplitter
from unikern.frontends.http.errors import APIError, from_engine
from unikern.frontends.http.metrics import ServerMetrics
from unikern.frontends.http.params import ServerParams

log = structlog.get_logger("unikern.http")
T = TypeVar("T")
# events taken into one piece at most (a decode window's worth, for many windows)
MAX_EVENTS_PER_PIECE = 64
END_EVENTS = (m.DoneEvent, m.ErrorEvent)


class ServerState:
    """What every route shares: settings, metrics, the engine once it is ready, and the
    requests in flight (waiting = submitted, no token yet; running = producing tokens)."""

    def __init__(self, params: ServerParams, model_id: str) -> None:
        self.params = params
        self.model_id = model_id
        self.metrics = ServerMetrics()
        self.engine: Any = None
        self.tokenizer: Any = None
        self.tasks: Any = None  # the server's task group: the requests' pumps run in it
        self.draining = False
        self.num_waiting = 0
        self.num_running = 0
        self.active: set[str] = set()
        self.idle = anyio.Event()
        self.idle.set()

    def attach(self, engine: Any, tokenizer: Any, tasks: Any) -> None:
        self.engine, self.tokenizer, self.tasks = engine, tokenizer, tasks

    @property
    def ready(self) -> bool:
        return self.engine is not None and not self.draining

    def count(self, waiting: int = 0, running: int = 0) -> None:
        self.num_waiting += waiting
        self.num_running += running
        self.metrics.waiting.set(self.num_waiting)
        self.metrics.running.set(self.num_running)


@dataclass
class Prepared:
    """A request in the engine's terms: one prompt form, max_tokens and sampling keywords."""

    max_tokens: int
    sampling: dict[str, Any]
    prompt: str | None = None
    prompt_tokens: list[int] | None = None
    # parse tool calls out of the text (the request offered tools, the model has a parser)
    tools: list[dict[str, Any]] | None = None
    parse_tools: bool = False
    # /v1/completions' echo: the prompt text the response's text starts with
    echo: str | None = None


@dataclass
class Piece:
    """What one token event adds: shown text, completed tool calls, and the token events
    since the previous piece (their logprobs)."""

    text: str
    tool_calls: list[ToolCall]
    tokens: list[m.TokenEvent]


@dataclass
class Outcome:
    finish_reason: str  # the engine's: stop, length, cancelled
    usage: m.Usage
    stop_sequence: str | None = None
    num_tool_calls: int = 0
    token_ids: list[int] = field(default_factory=list)
    # the done event's, for requests that asked (prompt_logprobs)
    prompt_logprobs: tuple[m.PromptLogprob | None, ...] | None = None


class Generation:
    """One request. A pump task (in the server's task group) moves the engine's events
    into a stream of its own, so that every event already there is taken at once: one
    piece (one SSE chunk) per batch of tokens rather than one per token, and waiting on
    it can be cancelled without touching the engine's iterator."""

    def __init__(self, state: ServerState, prepared: Prepared, request_id: str) -> None:
        self.state = state
        self.prepared = prepared
        self.request_id = request_id
        self.arrival = time.monotonic()
        self.outcome: Outcome | None = None
        self.error: APIError | None = None  # an error after the first token
        self._events: Any = None  # our receiving end of the pump
        self._pump_scope: anyio.CancelScope | None = None
        self._first: Any = None
        self._counted: str | None = None  # "waiting" | "running" | None
        self._token_ids: list[int] = []
        self._shown: list[str] = []  # the text sent so far, by piece
        self._last_token_at = 0.0
        self._splitter = (
            ToolCallSplitter(state.tokenizer, prepared.tools) if prepared.parse_tools else None
        )

    # ---- start: admission and the first event ----------------------------------------

    async def start(self, request: Request) -> None:
        """Submit, and wait for the first event; APIError if the request is refused."""
        state = self.state
        if not state.ready:
            raise APIError(503, "the server is starting or stopping", headers={"Retry-After": "1"})
        if state.num_waiting >= state.params.max_waiting:
            raise APIError(
                429, f"{state.num_waiting} requests are waiting already (server.max_waiting); retry later",
                code="overloaded", headers={"Retry-After": str(state.params.retry_after_seconds)},
            )
        p = self.prepared
        try:
            events = state.engine.generate(
                p.prompt, prompt_tokens=p.prompt_tokens, max_tokens=p.max_tokens,
                request_id=self.request_id, **p.sampling,
            )
        except UnikernError as exc:
            raise from_engine(getattr(exc, "code", "bad_request"), str(exc)) from None
        send, self._events = anyio.create_memory_object_stream[Any](p.max_tokens + 8)
        self._enter("waiting")
        state.active.add(self.request_id)
        if len(state.active) == 1:
            state.idle = anyio.Event()
        self._pump_scope = await state.tasks.start(_pump, events, send, self.request_id)
        try:
            first = await until_disconnect(request, self._events.receive)
        except BaseException:
            await self.aclose()
            raise
        if isinstance(first, m.ErrorEvent):
            self.error = from_engine(first.code, first.message, retry_after_seconds=state.params.retry_after_seconds)
            await self.aclose()
            raise self.error
        if isinstance(first, m.TokenEvent):
            self._enter("running")
            state.metrics.ttft.observe(time.monotonic() - self.arrival)
        self._first = first

    # ---- tokens ----------------------------------------------------------------------

    async def pieces(self) -> AsyncIterator[Piece]:
        """A piece per batch of events; then `outcome` is set (or `error`, after a failure)."""
        assert self._first is not None, "start() first"
        batch, self._first = [self._first], None
        tokens: list[m.TokenEvent] = []  # since the last piece
        try:
            while True:
                try:  # and every event already there
                    while len(batch) < MAX_EVENTS_PER_PIECE and not isinstance(batch[-1], END_EVENTS):
                        batch.append(self._events.receive_nowait())
                except (anyio.WouldBlock, anyio.EndOfStream):
                    pass
                text, calls, end = self._absorb(batch, tokens)
                if text or calls or (tokens and end is not None):
                    self._shown.append(text)
                    yield Piece(text, calls, tokens)
                    tokens = []
                if isinstance(end, m.DoneEvent):
                    self._finish(end)
                    return
                if isinstance(end, m.ErrorEvent):
                    self.error = from_engine(end.code, end.message)
                    return
                try:
                    batch = [await self._events.receive()]
                except anyio.EndOfStream:
                    self.error = APIError(500, "the request ended without a done event")
                    return
        finally:
            await self.aclose()

    def _absorb(self, batch: list[Any], tokens: list[m.TokenEvent]) -> tuple[str, list[ToolCall], Any]:
        """Text and tool calls of a batch of events (token events go to `tokens`), and
        its done or error event if it has one."""
        texts: list[str] = []
        calls: list[ToolCall] = []
        end = None
        metrics = self.state.metrics
        for event in batch:
            if isinstance(event, m.TokenEvent):
                now = time.monotonic()
                if self._token_ids:
                    metrics.itl.observe(now - self._last_token_at)
                self._last_token_at = now
                self._token_ids.append(event.token_id)
                tokens.append(event)
                text, found = self._split(self._visible(event))
            else:
                end = event
                text, found = self._split(None) if isinstance(event, m.DoneEvent) else ("", [])
            texts.append(text)
            calls += found
        metrics.generation_tokens.inc(len(batch) - (end is not None))
        return "".join(texts), calls, end

    def _visible(self, event: m.TokenEvent) -> str:
        """The event's text without the end-of-sequence token's own (`<|eos|>`, ...)."""
        tokenizer = self.state.tokenizer
        if event.token_id not in (getattr(tokenizer, "eos_token_ids", None) or ()):
            return event.text
        return event.text.removesuffix(tokenizer.decode([event.token_id]))

    def _split(self, text: str | None) -> tuple[str, list[ToolCall]]:
        if self._splitter is None:
            return text or "", []
        return self._splitter.feed(text) if text is not None else self._splitter.finish()

    def _finish(self, done: m.DoneEvent) -> None:
        metrics = self.state.metrics
        usage = done.usage
        metrics.prompt_tokens.inc(usage.prompt_tokens)
        metrics.prefix_hits.inc(usage.cached_tokens)
        metrics.success.labels(done.finish_reason).inc()
        self.outcome = Outcome(
            finish_reason=done.finish_reason,
            usage=usage,
            stop_sequence=self._matched_stop(done),
            num_tool_calls=self._splitter.num_calls if self._splitter else 0,
            token_ids=self._token_ids,
            prompt_logprobs=done.prompt_logprobs,
        )

    def _matched_stop(self, done: m.DoneEvent) -> str | None:
        """Which stop string ended the request (None for an end-of-sequence token)."""
        token_ids, shown = self._token_ids, "".join(self._shown)
        stops = self.prepared.sampling.get("stop") or ()
        stops = (stops,) if isinstance(stops, str) else tuple(stops)
        if done.finish_reason != "stop" or not stops or not token_ids:
            return None
        if token_ids[-1] in set(getattr(self.state.tokenizer, "eos_token_ids", ()) or ()):
            return None
        full = self.state.tokenizer.decode(token_ids)
        since = max(0, len(shown) - max(len(s) for s in stops))
        found = [(full.find(s, since), s) for s in stops]
        found = [(at, s) for at, s in found if at >= 0]
        return min(found)[1] if found else None

    # ---- the end -----------------------------------------------------------------------

    def _enter(self, phase: str | None) -> None:
        old = self._counted
        self.state.count(
            waiting=(phase == "waiting") - (old == "waiting"),
            running=(phase == "running") - (old == "running"),
        )
        self._counted = phase

    async def aclose(self) -> None:
        """Stop the pump, which closes the engine's iterator: the engine cancels the
        request if it still runs."""
        if self._events is None:
            return
        self._events.close()
        self._events = None
        if self._pump_scope is not None:
            self._pump_scope.cancel()
        self._enter(None)
        state = self.state
        if self.outcome is None and self.error is None:
            state.metrics.success.labels("cancelled").inc()
        state.active.discard(self.request_id)
        if not state.active:
            state.idle.set()


async def _pump(events: Any, send: Any, request_id: str, *, task_status: Any = anyio.TASK_STATUS_IGNORED) -> None:
    """Engine events into `send` until the request ends, the reader leaves, or the scope
    is cancelled; the engine's iterator is closed on the way out either way."""
    with anyio.CancelScope() as scope, send:
        task_status.started(scope)
        try:
            async for event in events:
                try:  # no trip through the event loop per event: the reader takes them all at once
                    send.send_nowait(event)
                except anyio.WouldBlock:
                    await send.send(event)
        except UnikernError as exc:  # the engine stopped under the request
            error = m.ErrorEvent(request_id, getattr(exc, "code", "stage_failed"), str(exc))
            with contextlib.suppress(anyio.WouldBlock, anyio.BrokenResourceError):
                send.send_nowait(error)
        except anyio.BrokenResourceError:
            pass  # the reader left
        finally:
            with anyio.CancelScope(shield=True):
                await events.aclose()


class ClientGone(Exception):
    """The client disconnected while its request waited or ran."""


async def until_disconnect(request: Request, work: Callable[[], Awaitable[T]]) -> T:
    """`await work()`, cancelled (ClientGone) if the client disconnects meanwhile."""
    done: list[T] = []
    failed: list[BaseException] = []
    async with anyio.create_task_group() as tg:

        async def run() -> None:
            try:
                done.append(await work())
            except Exception as exc:  # raised below, outside the task group's exception group
                failed.append(exc)
            tg.cancel_scope.cancel()

        async def watch() -> None:
            while (await request.receive())["type"] != "http.disconnect":
                pass
            tg.cancel_scope.cancel()

        tg.start_soon(run)
        tg.start_soon(watch)
    if failed:
        raise failed[0]
    if not done:
        raise ClientGone()
    return done[0]
