"""One HTTP request's run through the engine, whatever its API: admission (429 past
`max_waiting`), the first event before any response is sent (so a refusal is an HTTP
status), tokens as text pieces and tool calls, the outcome, and the metrics."""

from __future__ import annotations

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


class ServerState:
    """What every route shares: settings, metrics, the engine once it is ready, and the
    requests in flight (waiting = submitted, no token yet; running = producing tokens)."""

    def __init__(self, params: ServerParams, model_id: str) -> None:
        self.params = params
        self.model_id = model_id
        self.metrics = ServerMetrics()
        self.engine: Any = None
        self.tokenizer: Any = None
        self.draining = False
        self.num_waiting = 0
        self.num_running = 0
        self.active: set[str] = set()
        self.idle = anyio.Event()
        self.idle.set()

    def attach(self, engine: Any, tokenizer: Any) -> None:
        self.engine, self.tokenizer = engine, tokenizer

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


class Generation:
    def __init__(self, state: ServerState, prepared: Prepared, request_id: str) -> None:
        self.state = state
        self.prepared = prepared
        self.request_id = request_id
        self.arrival = time.monotonic()
        self.outcome: Outcome | None = None
        self.error: APIError | None = None  # an error after the first token
        self._events: Any = None
        self._first: Any = None
        self._counted: str | None = None  # "waiting" | "running" | None
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
            self._events = state.engine.generate(
                p.prompt, prompt_tokens=p.prompt_tokens, max_tokens=p.max_tokens,
                request_id=self.request_id, **p.sampling,
            )
        except UnikernError as exc:
            raise from_engine(getattr(exc, "code", "bad_request"), str(exc)) from None
        self._enter("waiting")
        state.active.add(self.request_id)
        if len(state.active) == 1:
            state.idle = anyio.Event()
        try:
            first = await until_disconnect(request, self._first_event)
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

    async def _first_event(self) -> Any:
        try:
            return await self._events.__anext__()
        except StopAsyncIteration:
            return m.ErrorEvent(self.request_id, "stage_failed", "the request ended without an event")
        except UnikernError as exc:
            return m.ErrorEvent(self.request_id, getattr(exc, "code", "stage_failed"), str(exc))

    # ---- tokens ----------------------------------------------------------------------

    async def pieces(self) -> AsyncIterator[Piece]:
        """Pieces until the end; then `outcome` is set (or `error`, after a failure)."""
        assert self._first is not None, "start() first"
        pending: list[m.TokenEvent] = []
        token_ids: list[int] = []
        shown: list[str] = []
        last_token_at = 0.0
        event, self._first = self._first, None
        try:
            while True:
                if isinstance(event, m.TokenEvent):
                    now = time.monotonic()
                    metrics = self.state.metrics
                    if token_ids:
                        metrics.itl.observe(now - last_token_at)
                    metrics.generation_tokens.inc()
                    last_token_at = now
                    token_ids.append(event.token_id)
                    pending.append(event)
                    text, calls = self._split(self._visible(event))
                    if text or calls:
                        shown.append(text)
                        yield Piece(text, calls, pending)
                        pending = []
                elif isinstance(event, m.DoneEvent):
                    text, calls = self._split(None)
                    if text or calls or pending:
                        shown.append(text)
                        yield Piece(text, calls, pending)
                    self._finish(event, token_ids, "".join(shown))
                    return
                else:
                    self.error = from_engine(event.code, event.message)
                    return
                try:
                    event = await self._events.__anext__()
                except StopAsyncIteration:
                    self.error = APIError(500, "the request ended without a done event")
                    return
                except UnikernError as exc:
                    self.error = from_engine(getattr(exc, "code", "stage_failed"), str(exc))
                    return
        finally:
            await self.aclose()

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

    def _finish(self, done: m.DoneEvent, token_ids: list[int], shown: str) -> None:
        metrics = self.state.metrics
        usage = done.usage
        metrics.prompt_tokens.inc(usage.prompt_tokens)
        metrics.prefix_hits.inc(usage.cached_tokens)
        metrics.success.labels(done.finish_reason).inc()
        self.outcome = Outcome(
            finish_reason=done.finish_reason,
            usage=usage,
            stop_sequence=self._matched_stop(done, token_ids, shown),
            num_tool_calls=self._splitter.num_calls if self._splitter else 0,
            token_ids=token_ids,
        )

    def _matched_stop(self, done: m.DoneEvent, token_ids: list[int], shown: str) -> str | None:
        """Which stop string ended the request (None for an end-of-sequence token)."""
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
        """Close the engine's event stream: the engine cancels the request if it runs."""
        if self._events is None:
            return
        events, self._events = self._events, None
        with anyio.CancelScope(shield=True):
            await events.aclose()
        self._enter(None)
        state = self.state
        if self.outcome is None and self.error is None:
            state.metrics.success.labels("cancelled").inc()
        state.active.discard(self.request_id)
        if not state.active:
            state.idle.set()


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
