"""execute.cudnn_attention: MLX's cuDNN SDPA off unless asked for, an environment's own
MLX_CUDA_USE_CUDNN_SDPA kept, and the choice in force reported in stats."""

from __future__ import annotations

import os

import pytest

import unikern
from tests.conftest import SMALL_KV
from unikern.stages.execute.ranks import cudnn_attention

VAR = "MLX_CUDA_USE_CUDNN_SDPA"


@pytest.mark.parametrize("preset, on, value, in_force", [
    (None, False, "0", False), (None, True, "1", True), ("1", False, "1", True), ("0", True, "0", False),
])
def test_the_setting_goes_to_the_environment_unless_it_has_its_own(monkeypatch, preset, on, value, in_force):
    monkeypatch.delenv(VAR, raising=False)
    if preset is not None:
        monkeypatch.setenv(VAR, preset)
    assert cudnn_attention(on) is in_force
    assert os.environ[VAR] == value


@pytest.mark.anyio
async def test_an_engine_turns_it_off_before_its_model_runs(tiny_llama, monkeypatch):
    monkeypatch.delenv(VAR, raising=False)
    async with unikern.Engine.from_pipeline("generate", model=tiny_llama, overrides=SMALL_KV) as engine:
        assert engine.stats()["model"]["cudnn_attention"] is False
    assert os.environ[VAR] == "0"
