"""Process-wide singletons the stages share: the platform facts and the bridge counters."""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .bridge import Bridge
    from .platform import Platform


@functools.cache
def current_platform() -> Platform:
    from .platform import Platform

    return Platform.detect()


@functools.cache
def shared_bridge() -> Bridge:
    """One Bridge per process, so `stats.bridge` counts every view the engine made."""
    from .bridge import Bridge

    return Bridge()


def bridge_stats() -> dict[str, int]:
    if shared_bridge.cache_info().currsize == 0:
        return {"zero_copy_views": 0, "copies": 0}
    return shared_bridge().stats()
