"""Recurrent-state checkpoints in stats (kv.states) and their number set on kv_manager
(kv.state_checkpoints): saves, restores and evictions are counted as they happen."""

from __future__ import annotations

import pytest

import unikern
from tests.conftest import compare_greedy, reference_greedy
from tests.test_families import family_model
from unikern.stages.kv.service import KVManagerParams

pytestmark = pytest.mark.anyio

BASE = [(13 * j) % 900 + 11 for j in range(100)]


async def test_checkpoint_counters_and_slots_follow_the_parameter():
    path = family_model("qwen3-next")
    overrides = {"kv": {"kv_budget_bytes": 32 << 20, "block_size": 32, "state_checkpoints": 2}}
    first = BASE  # crosses 32, 64, 96: two slots, so two checkpoints are saved
    second = BASE[:64] + [5, 6, 7, 8] * 10  # restores the one at 64, and its save at 96 evicts 32's
    async with unikern.Engine.from_pipeline("generate", model=path, overrides=overrides) as engine:
        a = await engine.complete(prompt_tokens=first, max_tokens=4)
        after_first = dict(engine.stats()["kv"]["states"])
        b = await engine.complete(prompt_tokens=second, max_tokens=4)
        await engine.complete(prompt_tokens=[3], max_tokens=1)  # a step after b's: its checkpoint counts
        states = engine.stats()["kv"]["states"]
    assert after_first["saved"] == 2 and after_first["restored"] == 0
    assert states["checkpoint_slots"] == 2 and states["checkpoint_slots_in_use"] == 2
    assert states["restored"] == 1 and states["evicted"] == 1 and states["saved"] == 3
    assert states["request_slots_in_use"] == 0
    assert [a.usage.cached_tokens, b.usage.cached_tokens] == [0, 64]
    for prompt, result in ((first, a), (second, b)):
        ok, note = compare_greedy(result.token_ids, reference_greedy(path, prompt, 4))
        assert ok, note


def test_the_number_of_checkpoint_slots_is_validated():
    assert KVManagerParams(state_checkpoints=0).validate() == ["state_checkpoints: must be >= 1 or null, got 0"]
    assert KVManagerParams(state_checkpoints=8).validate() == []
