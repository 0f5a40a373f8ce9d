"""The stage interface and the context the kernel hands each stage."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any, ClassVar, Protocol, runtime_checkable

import msgspec
import structlog
from anyio.abc import TaskStatus
from anyio.streams.memory import MemoryObjectReceiveStream

from unikern.errors import StageError


class StageParams(msgspec.Struct, forbid_unknown_fields=True, frozen=True):
    """Base of every stage's parameter Struct; strict so typos are reported."""

    def validate(self) -> list[str]:
        """Cross-field checks; return one message per problem (field name first)."""
        return []


@runtime_checkable
class Stage(Protocol):
    """A unit of the pipeline. Stages never call each other: they consume and produce
    messages, and share big buffers only as named resources through the context."""

    Params: ClassVar[type[StageParams]]
    consumes: ClassVar[tuple[type, ...]]
    produces: ClassVar[tuple[type, ...]]
    provides: ClassVar[tuple[str, ...]]
    requires: ClassVar[tuple[str, ...]]

    def __init__(self, name: str, params: Any) -> None: ...

    async def run(self, ctx: StageContext, *, task_status: TaskStatus[None]) -> None:
        """Set up, publish resources, call task_status.started(), then serve the inbox."""

    def stats(self) -> dict[str, Any]: ...


class StageContext:
    """What a running stage may touch: its inbox, a typed send, and shared resources."""

    def __init__(
        self,
        name: str,
        inbox: MemoryObjectReceiveStream[Any],
        send: Callable[[Any], Awaitable[None]],
        send_nowait: Callable[[Any], None],
        resources: dict[str, Any],
        fail: Callable[[str, BaseException], None],
    ) -> None:
        self.name = name
        self.inbox = inbox
        self.send = send
        self.send_nowait = send_nowait
        self._resources = resources
        self.fail = fail
        self.log = structlog.get_logger("unikern").bind(stage=name)

    def provide(self, key: str, value: Any) -> None:
        if key in self._resources:
            raise StageError(self.name, f"resource {key!r} is already provided")
        self._resources[key] = value

    def optional_resource(self, key: str, default: Any = None) -> Any:
        return self._resources.get(key, default)

    def resource(self, key: str) -> Any:
        try:
            return self._resources[key]
        except KeyError:
            raise StageError(
                self.name, f"resource {key!r} is not available; have {sorted(self._resources)}"
            ) from None


class StageBase:
    """Convenience base: stores name and params and gives an empty stats()."""

    Params: ClassVar[type[StageParams]] = StageParams
    consumes: ClassVar[tuple[type, ...]] = ()
    produces: ClassVar[tuple[type, ...]] = ()
    provides: ClassVar[tuple[str, ...]] = ()
    requires: ClassVar[tuple[str, ...]] = ()

    def __init__(self, name: str, params: Any) -> None:
        self.name = name
        self.params = params

    def stats(self) -> dict[str, Any]:
        return {}


async def serve_inbox(ctx: StageContext, handle: Callable[[Any], Awaitable[None]]) -> None:
    """Run `handle` on every message until the inbox closes."""
    async for message in ctx.inbox:
        await handle(message)


__all__ = ["Stage", "StageBase", "StageContext", "StageParams", "serve_inbox"]
