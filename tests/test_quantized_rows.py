"""Quantized layers route many-row inputs through dequantized weights
(stages/execute/quantized.py); the family parity test holds the tokens."""

import mlx.core as mx
import mlx.nn as nn
import pytest

from unikern.stages.execute.quantized import RowRoutedQuantizedLinear, route_quantized_layers


def quantized_model(bits=4):
    mx.random.seed(0)
    model = nn.Sequential(nn.Linear(128, 256), nn.Linear(256, 64, bias=False))
    nn.quantize(model, group_size=32, bits=bits)
    return model


@pytest.mark.parametrize("bits", [4, 8])
def test_rows_at_the_threshold_take_the_dequantized_matmul(monkeypatch, bits):
    model = quantized_model(bits)
    x_many, x_few = mx.random.normal((3, 3, 128)), mx.random.normal((1, 2, 128))
    expected_many, expected_few = model(x_many), model(x_few)  # MLX's quantized kernel
    assert route_quantized_layers(model, 8) == 2
    assert all(type(layer) is RowRoutedQuantizedLinear for layer in model.layers)
    calls = []
    kernel = mx.quantized_matmul
    monkeypatch.setattr(mx, "quantized_matmul", lambda *a, **k: calls.append(a[0].shape) or kernel(*a, **k))
    few = model(x_few)  # 2 rows: still the kernel, and bit-identical
    assert len(calls) == 2 and mx.array_equal(few, expected_few)
    many = model(x_many)  # 9 rows: no kernel call
    assert len(calls) == 2
    assert mx.allclose(many, expected_many, rtol=1e-4, atol=1e-4)
    first = model.layers[0]
    w = mx.dequantize(first["weight"], first["scales"], first["biases"], group_size=32, bits=bits)
    assert mx.allclose(first(x_many), x_many @ w.T + first["bias"], rtol=1e-5, atol=1e-5)


def test_never_routes_nothing_and_plain_layers_stay():
    model = quantized_model()
    assert route_quantized_layers(model, None) == 0
    assert all(type(layer) is nn.QuantizedLinear for layer in model.layers)
    plain = nn.Sequential(nn.Linear(8, 8))
    assert route_quantized_layers(plain, 8) == 0


@pytest.mark.anyio
async def test_engine_reports_routed_layers_of_a_4bit_model():
    import unikern
    from unikern.testing.families import cached_quantized

    path = str(cached_quantized("tiny-llama", 4))
    prompt = list(range(5, 40))  # 35 prompt rows: the dequantized path, then one-row decodes
    async with unikern.Engine.from_pipeline("generate", model=path) as engine:
        quantized = engine.stats()["model"]["quantized"]
        assert quantized["dequantize_rows"] == 8 and quantized["routed_layers"] == 4 * 7 + 1
        routed = await engine.complete(prompt_tokens=prompt, max_tokens=8)
    kernel_only = {"execute": {"dequantize_rows": "never"}}
    async with unikern.Engine.from_pipeline("generate", model=path, overrides=kernel_only) as engine:
        assert engine.stats()["model"]["quantized"]["routed_layers"] == 0
        plain = await engine.complete(prompt_tokens=prompt, max_tokens=8)
    assert routed.token_ids == plain.token_ids
