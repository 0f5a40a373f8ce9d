"""Fault injection, a test hook: `UNIKERN_INJECT_FAULT="<stage name>:<n>"` makes that stage
raise `RuntimeError("injected fault")` on its n-th inbox message (1-based), so tests can
prove that a stage fault reaches every request in flight and stops the process."""

from __future__ import annotations

import os
from typing import Any

from unikern.errors import ConfigError

ENV_VAR = "UNIKERN_INJECT_FAULT"
MESSAGE = "injected fault"


def planned_fault(environ: dict[str, str] | None = None) -> tuple[str, int] | None:
    """(stage name, n) from the environment, or None when no fault is asked for."""
    value = (os.environ if environ is None else environ).get(ENV_VAR)
    if not value:
        return None
    stage, sep, count = value.rpartition(":")
    if not sep or not stage or not count.isdigit() or int(count) < 1:
        raise ConfigError(f"{ENV_VAR}={value!r}: expected STAGE:N with N >= 1, e.g. schedule:3")
    return stage, int(count)


def wrap_inbox(stage: str, inbox: Any, plan: tuple[str, int] | None) -> Any:
    """The inbox a stage should read: the stream itself unless `plan` targets this stage.

    The router wraps only the planned stage's inbox, only when the variable is set: with it
    unset, stages get their inbox stream itself and nothing is counted.
    """
    if plan is None or plan[0] != stage:
        return inbox
    return FaultyInbox(inbox, plan[1])


class FaultyInbox:
    """A receive stream that raises on its n-th message; everything else is delegated."""

    def __init__(self, inner: Any, fail_at: int) -> None:
        self._inner = inner
        self._fail_at = fail_at
        self.received = 0

    def _count(self, message: Any) -> Any:
        self.received += 1
        if self.received == self._fail_at:
            raise RuntimeError(MESSAGE)
        return message

    def __aiter__(self) -> FaultyInbox:
        return self

    async def __anext__(self) -> Any:
        return self._count(await self._inner.__anext__())

    async def receive(self) -> Any:
        return self._count(await self._inner.receive())

    def receive_nowait(self) -> Any:
        return self._count(self._inner.receive_nowait())

    def __getattr__(self, name: str) -> Any:  # close, clone, statistics, ...
        return getattr(self._inner, name)
