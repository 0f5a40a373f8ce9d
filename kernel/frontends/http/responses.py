"""Response classes: JSON through msgspec, and server-sent events framed by sse-starlette."""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import anyio
import msgspec
from sse_starlette import ServerSentEvent
from starlette.responses import Response, StreamingResponse
from starlette.types import Receive, Scope, Send

_encoder = msgspec.json.Encoder()


class JSONResponse(Response):
    media_type = "application/json"

    def render(self, content: Any) -> bytes:
        return _encoder.encode(content)


def sse_event(payload: Any, event: str | None = None) -> bytes:
    """One event: `data: <json>` (or a literal string such as `[DONE]`), `\\n` line ends."""
    data = payload if isinstance(payload, str) else _encoder.encode(payload).decode()
    return ServerSentEvent(data=data, event=event, sep="\n").encode()


class EventStreamResponse(StreamingResponse):
    """A text/event-stream whose body iterator is always closed when the response ends,
    disconnects included, so the engine request it reads is cancelled at once."""

    media_type = "text/event-stream"

    def __init__(self, events: AsyncIterator[bytes], on_close: Callable[[], Awaitable[None]]) -> None:
        super().__init__(events, headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        self._events = events
        self._on_close = on_close  # runs even if the stream never started

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            with anyio.CancelScope(shield=True):
                await self._events.aclose()  # type: ignore[attr-defined]
                await self._on_close()
