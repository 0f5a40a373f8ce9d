"""The contract every registered pipeline member keeps (CONVENTIONS item 6): built from
its default Params with no side effects, started inside a pipeline, reporting stats in
the known sections, and stopped cleanly with the engine."""

from __future__ import annotations

import threading

import msgspec
import pytest

import unikern
from unikern.registry import BUILTIN_STAGES, resolve
from unikern.stage import Stage

# the sections `stats` may carry (DESIGN section 3, plus each member's own)
KNOWN_SECTIONS = {
    "platform", "memory", "kv", "tiers", "bridge", "model", "kernels", "compiled_decode", "compiled_prefill",
    "warmup", "schedule", "offload", "structured", "paged_attention", "window_tokens",
}

# a built-in pipeline in which each type runs
PIPELINE_OF = {name: "generate" for name in BUILTIN_STAGES}
PIPELINE_OF.update(schedule_tiered="generate-offload", offload_mover="generate-offload", disk_tier="generate-offload")


@pytest.mark.parametrize("type_name", sorted(BUILTIN_STAGES))
def test_a_member_is_built_from_its_default_params_without_starting(type_name: str) -> None:
    cls = resolve(type_name)
    params = cls.Params()
    assert params.validate() == []
    assert msgspec.convert(msgspec.to_builtins(params), cls.Params) == params  # what a file can say
    threads = threading.active_count()
    member = cls("m", params)
    assert isinstance(member, Stage)
    assert member.stats() == {}  # nothing runs or is loaded before start
    assert threading.active_count() == threads
    if cls.kind == "service":
        assert cls.consumes == () and cls.produces == () and cls.provides
    else:
        assert cls.consumes, f"stage {type_name} consumes no message: it should be a service"


@pytest.mark.anyio
@pytest.mark.parametrize("type_name", sorted(BUILTIN_STAGES))
async def test_a_member_starts_reports_and_stops_with_the_engine(type_name: str, tiny_llama: str, tmp_path) -> None:
    overrides = {"kv": {"kv_budget_bytes": 16 << 20}}
    if PIPELINE_OF[type_name] == "generate-offload":
        overrides["disk"] = {"path": str(tmp_path / "kv")}
        overrides["kv"]["host_bytes"] = 4 << 20
    engine = unikern.Engine.from_pipeline(PIPELINE_OF[type_name], model=tiny_llama, overrides=overrides)
    async with engine:
        members = [s for s in engine._router.stages.values() if s.params.__class__ is resolve(type_name).Params]
        assert len(members) == 1
        member = members[0]
        await engine.complete(prompt_tokens=[1, 2, 3, 4], max_tokens=2)
        stats = member.stats()
        assert set(stats) <= KNOWN_SECTIONS, set(stats) - KNOWN_SECTIONS
        assert all(isinstance(v, dict) for v in stats.values())
        for key in resolve(type_name).provides:
            assert key in engine._router.resources
    assert engine._router.all_started.is_set()
    # stopped: the pipeline's tasks are gone and the engine refuses new work
    with pytest.raises(unikern.UnikernError):
        await engine.complete(prompt_tokens=[1, 2], max_tokens=1)
