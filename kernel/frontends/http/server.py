"""Running the HTTP door: uvicorn on a socket bound first (so /health answers 503 while
the engine starts), then the engine; on SIGTERM/SIGINT stop accepting, drain, cancel."""

from __future__ import annotations

import contextlib
import signal
from collections.abc import Callable, Iterator
from typing import Any

import anyio
import structlog
import uvicorn

from unikern.errors import UnikernError
from unikern.frontends.http.app import build_app
from unikern.frontends.http.generation import ServerState
from unikern.frontends.http.params import ServerParams
from unikern.startup import describe as describe_startup

log = structlog.get_logger("unikern.http")

# after the drain, cancelled requests get this long to send their last event
CANCEL_GRACE_SECONDS = 5.0


def engine_tokenizer(engine: Any) -> Any:
    """The tokenizer the tokenize stage lends through the kernel (Engine has no public
    accessor for resources yet): chat templates and tool parsing use the same object."""
    return engine._router.resources["tokenizer"]


class _Uvicorn(uvicorn.Server):
    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield  # signals are HTTPServer's: it drains before uvicorn is told to stop


async def _first_of(*events: anyio.Event) -> None:
    async with anyio.create_task_group() as tg:
        for event in events:

            async def wait(event: anyio.Event = event) -> None:
                await event.wait()
                tg.cancel_scope.cancel()

            tg.start_soon(wait)


class HTTPServer:
    """One engine behind one listening socket. `run` returns the exit code: 0 after a
    stop (a signal or `stop()`), 1 after a stage fault."""

    def __init__(
        self,
        engine_factory: Callable[[], Any],
        params: ServerParams,
        model_id: str,
        *,
        tokenizer_of: Callable[[Any], Any] = engine_tokenizer,
        announce: Callable[[str], None] | None = None,
    ) -> None:
        self.params = params
        self.state = ServerState(params, model_id)
        self.app = build_app(self.state)
        self.port: int | None = None
        self._engine_factory = engine_factory
        self._tokenizer_of = tokenizer_of
        self._announce = announce or (lambda line: log.info(line))
        self.ready = anyio.Event()  # set once the engine serves
        self._stop = anyio.Event()
        self._hurry = anyio.Event()
        self._uvicorn: _Uvicorn | None = None

    def stop(self) -> None:
        """Begin the drain (call it on the server's event loop); a second call cancels
        the requests in flight without waiting out the drain."""
        if self._stop.is_set():
            self._hurry.set()
        self._stop.set()

    async def run(self, *, handle_signals: bool = False, task_status: Any = anyio.TASK_STATUS_IGNORED) -> int:
        """Serve until stopped; `task_status.started(port)` once the socket listens."""
        p = self.params
        config = uvicorn.Config(
            self.app, host=p.host, port=p.port, log_config=None, access_log=False, lifespan="off",
            ws="none", timeout_graceful_shutdown=p.drain_seconds + CANCEL_GRACE_SECONDS + 1,
        )
        try:
            sock = config.bind_socket()
        except SystemExit:  # uvicorn's way of saying the address is taken or invalid
            raise UnikernError(f"cannot listen on {p.host}:{p.port}") from None
        self.port = sock.getsockname()[1]
        self._uvicorn = server = _Uvicorn(config)
        code = 0
        async with anyio.create_task_group() as tg:
            http_done = anyio.Event()

            async def serve_http() -> None:
                try:
                    await server.serve(sockets=[sock])
                finally:
                    http_done.set()

            tg.start_soon(serve_http)
            if handle_signals:
                tg.start_soon(self._watch_signals, tg.cancel_scope)
            self._announce(f"listening on http://{_url_host(p.host)}:{self.port} (starting the engine)")
            task_status.started(self.port)
            try:
                async with self._engine_factory() as engine, anyio.create_task_group() as pumps:
                    self.state.attach(engine, self._tokenizer_of(engine), pumps)
                    self._announce(f"ready: model {self.state.model_id}, pipeline {engine.spec.name}; "
                                   f"{describe_startup(getattr(engine, 'startup', {}))}")
                    self.ready.set()
                    code = await self._serve_until_stopped(engine)
                    pumps.cancel_scope.cancel()
            finally:
                server.should_exit = True
                with anyio.CancelScope(shield=True), anyio.move_on_after(CANCEL_GRACE_SECONDS):
                    await http_done.wait()
                tg.cancel_scope.cancel()
        return code

    async def _serve_until_stopped(self, engine: Any) -> int:
        async with anyio.create_task_group() as tg:

            async def watch_fault() -> None:
                error = await engine.wait_for_fault()
                log.error("a stage failed: stopping", error=str(error))
                self._hurry.set()
                self._stop.set()

            tg.start_soon(watch_fault)
            await self._stop.wait()
            tg.cancel_scope.cancel()
        await self._drain(engine)
        if engine.fault is not None:
            engine.fault = None  # reported; exit 1 instead of raising from the engine's exit
            return 1
        return 0

    async def _drain(self, engine: Any) -> None:
        state = self.state
        state.draining = True  # /health 503, new requests 503
        assert self._uvicorn is not None
        self._uvicorn.should_exit = True  # stop accepting; idle connections close
        if state.active:
            log.warning("draining", requests=len(state.active), seconds=self.params.drain_seconds)
            with anyio.move_on_after(self.params.drain_seconds):
                await _first_of(state.idle, self._hurry)
        if state.active:
            log.warning("drain time is up: cancelling", requests=len(state.active))
            for rid in list(state.active):
                engine.cancel(rid)
            with anyio.move_on_after(CANCEL_GRACE_SECONDS):
                await state.idle.wait()

    async def _watch_signals(self, scope: anyio.CancelScope) -> None:
        try:
            receiver = anyio.open_signal_receiver(signal.SIGTERM, signal.SIGINT)
        except (NotImplementedError, ValueError):  # not the main thread
            return
        with receiver as signals:
            async for signum in signals:
                log.warning("signal received: stopping", signal=signal.Signals(signum).name)
                if self.state.engine is None:
                    scope.cancel()  # still starting: nothing to drain
                    return
                self.stop()


def _url_host(host: str) -> str:
    return f"[{host}]" if ":" in host else host
