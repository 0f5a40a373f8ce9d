"""execute.fuse_elementwise: traced steps without MLX's fused element-wise kernels (none to
compile on a fresh machine), the same tokens, and MLX's default back once the engine stops."""

from __future__ import annotations

import io

import mlx.core as mx
import pytest

import unikern
from tests.conftest import SMALL_KV, compare_greedy, complete_all, reference_greedy
from unikern.platform.fusion import set_fusion


def fused_nodes() -> list[str]:
    """The Compiled nodes of a freshly traced chain of element-wise ops."""
    out = mx.compile(lambda a: mx.exp(a * 2.0 + 1.0) * 3.0)(mx.ones((4, 4)))
    dot = io.StringIO()
    mx.export_to_dot(dot, out)
    return [line for line in dot.getvalue().splitlines() if 'label ="Compiled' in line]


def test_the_switch_turns_mlxs_fusion_off_and_on():
    try:
        assert set_fusion(False) and not fused_nodes()
        assert set_fusion(True) and fused_nodes()
    finally:
        set_fusion(True)


@pytest.mark.anyio
async def test_an_engine_without_fusion_traces_op_by_op_and_matches_mlx_lm(tiny_llama):
    batch = [[(13 * i + 7 * j) % 900 + 5 for j in range(6 + 17 * i)] for i in range(5)]
    overrides = {**SMALL_KV, "execute": {"compile_decode": "always", "cpu_kernels": False,
                                         "fuse_elementwise": "never"}}
    try:
        async with unikern.Engine.from_pipeline("generate", model=tiny_llama, overrides=overrides) as engine:
            assert not fused_nodes()  # the process's traces, while the engine runs
            results = await complete_all(engine, batch, max_tokens=16)
            stats = engine.stats()
        assert fused_nodes()  # MLX's default again after it stopped
    finally:
        set_fusion(True)
    assert stats["model"]["fuse_elementwise"] is False and stats["compiled_decode"]["traces"] > 0
    for prompt, result in zip(batch, results, strict=True):
        ok, note = compare_greedy(result.token_ids, reference_greedy(tiny_llama, prompt, 16))
        assert ok, f"prompt of {len(prompt)} tokens: {note}"


def test_auto_fuses_except_on_cuda():
    """`auto` leaves MLX's fusion off on CUDA (each fused kernel is an NVRTC compile on a
    machine's first start) and on elsewhere; the explicit settings win everywhere."""
    from unikern.stages.execute.ranks import fuses_elementwise

    assert not fuses_elementwise("auto", "cuda")
    assert fuses_elementwise("auto", "cpu") and fuses_elementwise("auto", "metal")
    assert fuses_elementwise("always", "cuda") and not fuses_elementwise("never", "cpu")
