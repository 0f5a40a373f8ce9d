"""The two kinds of pipeline member and the context the kernel hands each: a stage
consumes and produces messages; a service provides a shared resource and consumes none."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any, ClassVar, Literal, Protocol, runtime_checkable

import anyio
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


Kind = Literal["stage", "service"]


@runtime_checkable
class Stage(Protocol):
    """A member of the pipeline. Members never call each other: stages consume and
    produce messages; services (kind "service") consume none and lend a resource.
    `requires` orders start-up (a member starts after the providers of what it
    requires); `uses` names resources needed only once every member has started
    (`await ctx.all_started()`), which is how the execute stage reaches the KV pool
    whose service needs the model that execute provides."""

    kind: ClassVar[Kind]
    Params: ClassVar[type[StageParams]]
    consumes: ClassVar[tuple[type, ...]]
    produces: ClassVar[tuple[type, ...]]
    provides: ClassVar[tuple[str, ...]]
    requires: ClassVar[tuple[str, ...]]
    uses: ClassVar[tuple[str, ...]]

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
        started: anyio.Event | None = None,
    ) -> None:
        self.name = name
        self._all_started = started or anyio.Event()
        self.inbox = inbox
        self.send = send
        self.send_nowait = send_nowait
        self._resources = resources
        self.fail = fail
        self.log = structlog.get_logger("unikern").bind(stage=name)

    async def all_started(self) -> None:
        """Wait until every member of the pipeline has started (its resources exist)."""
        await self._all_started.wait()

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

    kind: ClassVar[Kind] = "stage"
    Params: ClassVar[type[StageParams]] = StageParams
    consumes: ClassVar[tuple[type, ...]] = ()
    produces: ClassVar[tuple[type, ...]] = ()
    provides: ClassVar[tuple[str, ...]] = ()
    requires: ClassVar[tuple[str, ...]] = ()
    uses: ClassVar[tuple[str, ...]] = ()

    def __init__(self, name: str, params: Any) -> None:
        self.name = name
        self.params = params

    def stats(self) -> dict[str, Any]:
        return {}


class ServiceBase(StageBase):
    """A service: provides resources, consumes and produces no messages. Its `run`
    sets up, provides, calls task_status.started(), then keeps its upkeep (or sleeps)
    until the pipeline stops; cleanup goes in a `finally`."""

    kind: ClassVar[Kind] = "service"


async def serve_inbox(ctx: StageContext, handle: Callable[[Any], Awaitable[None]]) -> None:
    """Run `handle` on every message until the inbox closes."""
    async for message in ctx.inbox:
        await handle(message)


__all__ = ["ServiceBase", "Stage", "StageBase", "StageContext", "StageParams", "serve_inbox"]
