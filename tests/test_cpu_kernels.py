"""The PyTorch kernels for MLX's CPU backend (stages/execute/cpu_kernels.py): same numbers as
MLX's own ops, written in place through zero-copy views, installed on the engine's
model instance only."""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
import pytest

import unikern
from tests.conftest import SMALL_KV, compare_greedy, complete_all, reference_greedy
from unikern.platform import shared_bridge
from unikern.platform.bridge import mlx_buffer
from unikern.stages.execute import cpu_kernels
from unikern.stages.execute.paged_cache import PagedLayerCache


def test_silu_mul_writes_gate_in_place_without_copies():
    gate = mx.random.normal((64, 1024), key=mx.random.key(1)) * 4
    up = mx.random.normal((64, 1024), key=mx.random.key(2))
    expected = nn.silu(gate) * up
    mx.eval(gate, up, expected)
    address = mlx_buffer(gate)[0]
    before = shared_bridge().stats()
    out = cpu_kernels.silu_mul_(gate, up)
    after = shared_bridge().stats()
    assert out is gate and mlx_buffer(out)[0] == address
    assert after["copies"] == before["copies"]
    assert after["zero_copy_views"] >= before["zero_copy_views"] + 2
    assert mx.allclose(out, expected, rtol=1e-5, atol=1e-6)


def test_softmax_in_place_matches_mlx():
    scores = mx.random.normal((8, 2, 6, 100), key=mx.random.key(3)) * 5
    expected = mx.softmax(scores, axis=-1, precise=True)
    mx.eval(scores, expected)
    out = cpu_kernels.softmax_(scores)
    assert out is scores and mx.allclose(out, expected, rtol=1e-5, atol=1e-7)


def _cache(head_major: bool) -> PagedLayerCache:
    cache = PagedLayerCache(None, 0, None, kernels=True)
    cache.head_major = head_major
    return cache


@pytest.mark.parametrize("heads,kv_heads", [(4, 4), (4, 2), (8, 1)])
@pytest.mark.parametrize("case", ["decode-gathered", "chunk-gathered", "fresh-causal", "fresh-none"])
def test_attention_matches_mlx_sdpa(heads, kv_heads, case):
    B, D = 6, 32
    T, L = {"decode-gathered": (1, 700), "chunk-gathered": (24, 96),
            "fresh-causal": (64, 64), "fresh-none": (1, 700)}[case]
    keys = iter(mx.random.split(mx.random.key(4), 3))
    q = mx.random.normal((B, heads, T, D), key=next(keys))
    head_major = case.endswith("gathered")
    if head_major:  # as update_and_fetch returns a gather: [Hk, B, L, D] seen transposed
        k = mx.random.normal((kv_heads, B, L, D), key=next(keys)).transpose(1, 0, 2, 3)
        v = mx.random.normal((kv_heads, B, L, D), key=next(keys)).transpose(1, 0, 2, 3)
        starts = mx.array([L - T - 3 * i for i in range(B)])
        query_pos = starts[:, None] + mx.arange(T)[None]
        mask = (mx.arange(L)[None, None] <= query_pos[:, :, None])[:, None]  # [B, 1, T, L]
    else:
        k = mx.random.normal((B, kv_heads, L, D), key=next(keys))
        v = mx.random.normal((B, kv_heads, L, D), key=next(keys))
        mask = "causal" if case == "fresh-causal" else None
    assert B * heads * T * L >= cpu_kernels.MIN_ELEMENTS  # the PyTorch path, not the fallback
    ours = _cache(head_major).attention(q, k, v, D**-0.5, mask)
    ref = mx.fast.scaled_dot_product_attention(q, k, v, scale=D**-0.5, mask=mask)
    assert ours.shape == ref.shape
    assert mx.allclose(ours, ref, rtol=1e-5, atol=1e-5), float(mx.abs(ours - ref).max())


def _forward(model, tokens):
    from mlx_lm.models.cache import make_prompt_cache

    cache = make_prompt_cache(model)
    logits = model(mx.array([tokens]), cache=cache)
    decode = model(mx.array([[5]]), cache=cache)
    mx.eval(logits, decode)
    return logits, decode


def test_install_swaps_this_model_only_and_leaves_other_callers_alone(tiny_llama):
    from mlx_lm import load

    ours, _ = load(tiny_llama)
    theirs, _ = load(tiny_llama)
    tokens = list(range(5, 300))
    before = _forward(theirs, tokens)
    reference = _forward(ours, tokens)
    report = cpu_kernels.install(ours, mx.float32)
    assert report == {"enabled": True, "swiglu_layers": 4, "attention_layers": 4, "layers": 4}
    assert all(isinstance(layer.mlp, cpu_kernels.SwiGLU) for layer in ours.layers)
    assert not any(isinstance(layer.mlp, cpu_kernels.SwiGLU) for layer in theirs.layers)
    # the other model instance, through the routed SDPA and mlx-lm's own KVCache: bit-identical
    after = _forward(theirs, tokens)
    assert all(mx.array_equal(a, b) for a, b in zip(before, after, strict=True))
    # the swapped model: the same numbers to float32 rounding (the 295-token prefill's
    # activation runs in PyTorch, above MIN_ELEMENTS)
    swapped = _forward(ours, tokens)
    assert all(mx.allclose(a, b, rtol=1e-4, atol=1e-4) for a, b in zip(reference, swapped, strict=True))
    assert cpu_kernels.install(ours, mx.float32)["swiglu_layers"] == 4  # idempotent


def test_install_refuses_what_it_cannot_serve(tiny_llama):
    from mlx_lm import load

    model, _ = load(tiny_llama)
    assert cpu_kernels.install(model, mx.bfloat16)["enabled"] is False

    class GeluMLP(nn.Module):  # gate/up/down named like SwiGLU but another activation
        def __init__(self, mlp):
            super().__init__()
            self.gate_proj, self.up_proj, self.down_proj = mlp.gate_proj, mlp.up_proj, mlp.down_proj

        def __call__(self, x):
            return self.down_proj(nn.gelu(self.gate_proj(x)) * self.up_proj(x))

    model.layers[0].mlp = GeluMLP(model.layers[0].mlp)
    report = cpu_kernels.install(model, mx.float32)
    assert report["swiglu_layers"] == 3 and isinstance(model.layers[0].mlp, GeluMLP)


@pytest.mark.anyio
@pytest.mark.parametrize("kernels", [True, False])
async def test_engine_with_and_without_kernels_matches_mlx_lm(tiny_llama, kernels, monkeypatch):
    # long prompts and 12 rows in flight: both the prefill and the batched decode cross
    # MIN_ELEMENTS, so the PyTorch activation and softmax run (checked below)
    batch = [[(11 * i + 3 * j) % 1000 + 5 for j in range(40 + 17 * i)] for i in range(12)]
    overrides = {**SMALL_KV, "kv": {**SMALL_KV["kv"], "block_size": 32}, "execute": {"cpu_kernels": kernels}}
    calls = {"silu": 0, "softmax": 0}
    silu, softmax = cpu_kernels.silu_mul_, cpu_kernels.softmax_

    def count(name, fn):
        def wrapped(*args):
            calls[name] += 1
            return fn(*args)

        return wrapped

    monkeypatch.setattr(cpu_kernels, "silu_mul_", count("silu", silu))
    monkeypatch.setattr(cpu_kernels, "softmax_", count("softmax", softmax))
    async with unikern.Engine.from_pipeline("generate", model=tiny_llama, overrides=overrides) as engine:
        results = await complete_all(engine, batch, max_tokens=16)
        stats = engine.stats()
    assert stats["kernels"]["enabled"] is kernels
    if kernels:
        assert stats["kernels"]["swiglu_layers"] == 4 and calls["silu"] > 0 and calls["softmax"] > 0
        assert stats["bridge"]["copies"] == 0
    else:
        assert calls == {"silu": 0, "softmax": 0}
    for prompt, result in zip(batch, results, strict=True):
        ok, note = compare_greedy(result.token_ids, reference_greedy(tiny_llama, prompt, 16))
        assert ok, f"prompt of {len(prompt)} tokens, kernels={kernels}: {note}"
