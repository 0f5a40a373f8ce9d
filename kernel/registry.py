"""The closed registry of stage types, by short name: pipeline files name a `type` from this
list, so they can never import arbitrary code. Third-party stages join through the
`unikern.stages` entry-point group, which a user installs on purpose."""

from __future__ import annotations

import functools
import importlib
from importlib.metadata import entry_points
from typing import Any

from unikern.errors import ConfigError

BUILTIN_STAGES: dict[str, str] = {
    "tokenize": "unikern.stages.tokenize:TokenizeStage",
    "schedule": "unikern.stages.schedule.stage:ScheduleStage",
    "kv_manager": "unikern.stages.kv.service:KVManagerStage",
    "mlx_execute": "unikern.stages.execute.stage:MLXExecuteStage",
    "output": "unikern.stages.output:OutputStage",
    "schedule_tiered": "unikern.stages.schedule.tiered:TieredScheduleStage",
    "offload_mover": "unikern.stages.tiers.mover:OffloadMoverStage",
    "disk_tier": "unikern.stages.tiers.disk.service:DiskTierStage",
}

ENTRY_POINT_GROUP = "unikern.stages"


@functools.cache
def _entry_point_stages() -> tuple[tuple[str, str], ...]:
    return tuple((ep.name, ep.value) for ep in entry_points(group=ENTRY_POINT_GROUP))


def stage_types() -> dict[str, str]:
    """Every known stage type name -> 'module:Class'."""
    types = dict(BUILTIN_STAGES)
    for name, value in _entry_point_stages():
        types.setdefault(name, value)
    return types


def resolve(type_name: str) -> Any:
    types = stage_types()
    if type_name not in types:
        raise ConfigError(
            f"unknown stage type {type_name!r}; valid types: {', '.join(sorted(types))}"
        )
    module_name, _, attr = types[type_name].partition(":")
    return getattr(importlib.import_module(module_name), attr)
