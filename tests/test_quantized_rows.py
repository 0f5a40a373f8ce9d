"""Quantized layers route many-row inputs through dequantized weights, and fewer rows of
4-bit ones through the GEMV or the tensor-core kernel when asked
(stages/execute/quantized.py, stages/execute/cuda/q4_gemv.py and q4_mma.py): their CUDA sources in a thread-per-lane emulation here,
against MLX's kernel on a CUDA machine; the family parity test holds the tokens."""

import functools

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest

from tests import cuda_emulation
from unikern.platform import cuda_is_default
from unikern.stages.execute import quantized
from unikern.stages.execute.cuda import q4_gemv, q4_mma
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


def as_bf16(a: np.ndarray) -> np.ndarray:
    """float32 values rounded to bfloat16 (to nearest, ties to even), kept as float32."""
    bits = a.astype(np.float32).view(np.uint32).astype(np.uint64)
    return (((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16) << 16).astype(np.uint32).view(np.float32)


@pytest.mark.skipif(cuda_is_default(), reason="MLX's CPU kernel")
@pytest.mark.parametrize("bits", [4, 8])
def test_mlxs_cpu_quantized_matmul_sums_bfloat16_rows_in_bfloat16(bits):
    """Why quantized.AUTO_DTYPES keeps bfloat16 rows on MLX's CPU kernel: it sums each
    output k by k in bfloat16, rounding every weight, product and partial sum (bit for
    bit, below), which a matmul of the dequantized weights (float32 sums) does not give.
    If MLX ever sums in float32, the first assertion fails: widen AUTO_DTYPES then."""
    mx.random.seed(bits)
    w, scales, biases = mx.quantize(mx.random.normal((24, 256)).astype(mx.bfloat16), group_size=64, bits=bits)
    x = mx.random.normal((9, 256)).astype(mx.bfloat16)
    kernel = np.array(mx.quantized_matmul(x, w, scales, biases, group_size=64, bits=bits).astype(mx.float32))
    levels = np.array(mx.dequantize(w, mx.ones_like(scales), mx.zeros_like(biases), group_size=64,
                                    bits=bits).astype(mx.float32))
    scale, bias = (np.repeat(np.array(a.astype(mx.float32)), 64, axis=1) for a in (scales, biases))
    weights = as_bf16(as_bf16(scale * levels) + bias)
    xs, sums = np.array(x.astype(mx.float32)), np.zeros(kernel.shape, np.float32)
    for k in range(xs.shape[1]):
        sums = as_bf16(sums + as_bf16(xs[:, None, k] * weights[None, :, k]))
    np.testing.assert_array_equal(kernel, sums)
    dequantized = x @ mx.dequantize(w, scales, biases, group_size=64, bits=bits, dtype=mx.bfloat16).T
    assert not np.array_equal(np.array(dequantized.astype(mx.float32)), kernel)


def test_rows_of_other_dtypes_than_asked_keep_the_kernel(monkeypatch):
    """route_quantized_layers' `dtypes`: many bfloat16 rows of a layer routed for float32
    ones take MLX's kernel, bit for bit the layer's own values; float32 rows of as many
    are dequantized; without `dtypes` bfloat16 rows are too."""
    model = quantized_model(4)
    x32 = mx.random.normal((9, 128))
    bf16_model = quantized_model(4)
    bf16_model.set_dtype(mx.bfloat16)
    x16 = x32.astype(mx.bfloat16)
    expected16 = bf16_model(x16)
    assert route_quantized_layers(model, 8, dtypes=("float32",)) == 2
    assert route_quantized_layers(bf16_model, 8, dtypes=("float32",)) == 2
    calls = []
    kernel = mx.quantized_matmul
    monkeypatch.setattr(mx, "quantized_matmul", lambda *a, **k: calls.append(a[0].dtype) or kernel(*a, **k))
    assert mx.array_equal(bf16_model(x16), expected16) and calls == [mx.bfloat16] * 2
    model(x32)
    assert calls == [mx.bfloat16] * 2  # float32 rows: no kernel call
    route_quantized_layers(bf16_model, 8)
    bf16_model(x16)
    assert calls == [mx.bfloat16] * 2


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
        assert quantized["dequantize_dtypes"] == ["float32"]  # (the CPU's AUTO_DTYPES: this model's)
        assert quantized["gemv"] is False and quantized["mma"] is False  # CUDA kernels: off here
        assert quantized["mma_weights"] is None
        routed = await engine.complete(prompt_tokens=prompt, max_tokens=8)
    kernel_only = {"execute": {"dequantize_rows": "never"}}
    async with unikern.Engine.from_pipeline("generate", model=path, overrides=kernel_only) as engine:
        assert engine.stats()["model"]["quantized"]["routed_layers"] == 0
        plain = await engine.complete(prompt_tokens=prompt, max_tokens=8)
    assert routed.token_ids == plain.token_ids


@pytest.mark.skipif(not cuda_emulation.available(), reason="the emulation needs g++ (C++20)")
@pytest.mark.parametrize("wide", [False, True])
@pytest.mark.parametrize("rows,n,k,group_size", [(1, 20, 256, 64), (3, 12, 128, 32), (8, 16, 2048, 128),
                                                (21, 8, 256, 64), (2, 4, 8192, 32)])
def test_the_gemv_source_computes_the_quantized_matmul_in_an_emulation(rows, n, k, group_size, wide, monkeypatch):
    """The 4-bit GEMV kernel's CUDA source, run on the CPU with a thread per lane: x times
    the dequantized weights, for fewer weight words than threads (k 128, 256), more (2048,
    8192: several loads per thread, 16-byte ones too), and rows in two passes, the second
    partial (21); with 4- and 16-byte weight loads (GEMV_WIDE_LOADS); nibbles made floats
    by a conversion, or for odd rows by the bits of 2^23 + q (GEMV_MAGIC_NIBBLES)."""
    monkeypatch.setattr(q4_gemv, "GEMV_WIDE_LOADS", wide)
    monkeypatch.setattr(q4_gemv, "GEMV_MAGIC_NIBBLES", rows % 2 == 1)
    mx.random.seed(rows)
    w, scales, biases = mx.quantize(mx.random.normal((n, k)), group_size=group_size, bits=4)
    x = mx.random.normal((rows, k))
    constants, blocks = q4_gemv.gemv_launch(rows, n, k, group_size)
    res = mx.random.normal((rows, n))
    inputs = {"x": np.array(x), "w": np.array(w), "scales": np.array(scales), "biases": np.array(biases),
              "res": np.array(res)}
    assert constants["MT"] == {1: 1, 2: 2, 3: 4, 8: 8, 21: 16}[rows] and constants["GEMV_WPL"] == (4 if wide else 1)
    want = x @ mx.dequantize(w, scales, biases, group_size=group_size, bits=4).T
    for with_res in (0, 1):  # and the residual added inside (RES: blocks.py's 4-bit blocks)
        constants, blocks = q4_gemv.gemv_launch(rows, n, k, group_size, res=bool(with_res))
        got = cuda_emulation.run_kernel(q4_gemv.SOURCE, inputs, constants, blocks,
                                        q4_gemv.GEMV_WARPS * 32, (rows, n))
        np.testing.assert_allclose(got, np.array(want + res if with_res else want), rtol=1e-4, atol=1e-4)


@pytest.mark.skipif(not cuda_emulation.available(), reason="the emulation needs g++ (C++20)")
@pytest.mark.parametrize("warps,features,unroll", [(1, 4, 1), (2, 4, 1), (4, 2, 1), (2, 8, 1), (1, 4, 4),
                                                   (2, 4, 2), (1, 4, 3)])
def test_the_gemv_holds_for_other_block_shapes_in_an_emulation(warps, features, unroll, monkeypatch):
    """The block shapes tools/probe/probe_cuda.py's -w1, -w2, -f2, -w2-f8, -w1-u4 and -w2-u2
    variants try on a GPU (GEMV_WARPS, GEMV_FEATURES, GEMV_UNROLL): each thread then covers
    more of K, a block more or fewer features, or a thread's loop several strides per pass
    (3: the last pass partial), with the residual added inside; still x times the
    dequantized weights."""
    monkeypatch.setattr(q4_gemv, "GEMV_WARPS", warps)
    monkeypatch.setattr(q4_gemv, "GEMV_FEATURES", features)
    monkeypatch.setattr(q4_gemv, "GEMV_UNROLL", unroll)
    rows, n, k, group_size = 3, 16, 4096, 64  # the 8B shape's K: 128 16-byte loads per feature
    mx.random.seed(warps * 100 + features * 10 + unroll)
    w, scales, biases = mx.quantize(mx.random.normal((n, k)), group_size=group_size, bits=4)
    x, res = mx.random.normal((rows, k)), mx.random.normal((rows, n))
    inputs = {"x": np.array(x), "w": np.array(w), "scales": np.array(scales), "biases": np.array(biases),
              "res": np.array(res)}
    constants, blocks = q4_gemv.gemv_launch(rows, n, k, group_size, res=True)
    assert (constants["GEMV_W"], constants["GEMV_F"], blocks) == (warps, features, n // features)
    got = cuda_emulation.run_kernel(q4_gemv.SOURCE, inputs, constants, blocks, warps * 32, (rows, n))
    want = x @ mx.dequantize(w, scales, biases, group_size=group_size, bits=4).T + res
    np.testing.assert_allclose(got, np.array(want), rtol=1e-4, atol=1e-4)


@pytest.mark.skipif(not cuda_emulation.available(), reason="the emulation needs g++ (C++20)")
@pytest.mark.parametrize("rows,n,k,group_size,wide,warps", [(1, 8, 4096, 64, True, 1), (3, 12, 128, 32, False, 4),
                                                            (21, 8, 256, 128, True, 2), (2, 4, 8192, 32, True, 4)])
def test_the_gemv_sums_per_word_in_an_emulation(rows, n, k, group_size, wide, warps, monkeypatch):
    """GEMV_SUMS: s * sum(x q) + b * sum(x) per word, the nibbles made floats by their bits
    (all eight positions: random words hold every nibble value at each); still x times the
    dequantized weights, the residual added, SwiGLU's pairs too."""
    monkeypatch.setattr(q4_gemv, "GEMV_SUMS", True)
    monkeypatch.setattr(q4_gemv, "GEMV_WIDE_LOADS", wide)
    monkeypatch.setattr(q4_gemv, "GEMV_WARPS", warps)
    mx.random.seed(rows + n)
    w, scales, biases = mx.quantize(mx.random.normal((n, k)), group_size=group_size, bits=4)
    x, res = mx.random.normal((rows, k)), mx.random.normal((rows, n))
    inputs = {"x": np.array(x), "w": np.array(w), "scales": np.array(scales), "biases": np.array(biases),
              "res": np.array(res)}
    constants, blocks = q4_gemv.gemv_launch(rows, n, k, group_size, res=True)
    assert constants["SUMS"] == 1
    y = np.array(x @ mx.dequantize(w, scales, biases, group_size=group_size, bits=4).T)
    got = cuda_emulation.run_kernel(q4_gemv.SOURCE, inputs, constants, blocks, warps * 32, (rows, n))
    np.testing.assert_allclose(got, y + np.array(res), rtol=1e-4, atol=1e-4)
    constants, blocks = q4_gemv.gemv_launch(rows, n, k, group_size)
    got = cuda_emulation.run_kernel(q4_gemv.SOURCE, inputs, {**constants, "SWIGLU": 1}, blocks, warps * 32,
                                    (rows, n // 2))
    gate, up = y[:, : n // 2], y[:, n // 2 :]
    np.testing.assert_allclose(got, gate / (1 + np.exp(-np.clip(gate, -80, 80))) * up, rtol=1e-4, atol=1e-4)


@pytest.mark.skipif(not cuda_emulation.available(), reason="the emulation needs g++ (C++20)")
@pytest.mark.parametrize("rows", [1, 3])
def test_the_gemv_source_gives_swiglu_of_gate_and_up_in_an_emulation(rows):
    """SWIGLU: the gate/up GEMV (w's rows gate, then up) gives silu(gate) * up, [rows, N/2]."""
    n, k = 48, 256
    mx.random.seed(rows)
    w, scales, biases = mx.quantize(mx.random.normal((n, k)), group_size=64, bits=4)
    x = mx.random.normal((rows, k))
    y = np.array(x @ mx.dequantize(w, scales, biases, group_size=64, bits=4).T)
    gate, up = y[:, : n // 2], y[:, n // 2 :]
    want = gate / (1 + np.exp(-gate)) * up
    constants, blocks = q4_gemv.gemv_launch(rows, n, k, 64)
    inputs = {"x": np.array(x), "w": np.array(w), "scales": np.array(scales), "biases": np.array(biases),
              "res": np.zeros(1, np.float32)}
    got = cuda_emulation.run_kernel(q4_gemv.SOURCE, inputs, {**constants, "SWIGLU": 1}, blocks,
                                    q4_gemv.GEMV_WARPS * 32, (rows, n // 2))
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)


def rope_reference(y: np.ndarray, pos: np.ndarray, inv_freq: np.ndarray, H: int, Hk: int, D: int,
                   trad: bool) -> np.ndarray:
    """q/k/v rows y [rows, (H + 2 Hk) D] with q and k rotated as RoPE does for each row's
    position (pairs 2i and 2i + 1 when `trad`, else i and i + D/2), v as it comes."""
    rows = y.shape[0]
    qk = y[:, : (H + Hk) * D].reshape(rows, H + Hk, D)
    a, b = (qk[..., 0::2], qk[..., 1::2]) if trad else (qk[..., : D // 2], qk[..., D // 2 :])
    angle = np.pi * (pos[:, None, None] * (inv_freq / np.float32(np.pi))).astype(np.float64)  # as the kernel
    ra, rb = a * np.cos(angle) - b * np.sin(angle), b * np.cos(angle) + a * np.sin(angle)
    rotated = np.stack([ra, rb], -1).reshape(qk.shape) if trad else np.concatenate([ra, rb], -1)
    return np.concatenate([rotated.reshape(rows, -1), y[:, (H + Hk) * D :]], axis=1)


@pytest.mark.skipif(not cuda_emulation.available(), reason="the emulation needs g++ (C++20)")
@pytest.mark.parametrize("rows, pool, trad", [(1, False, True), (3, False, False), (2, True, False), (2, True, True)])
def test_the_gemv_source_rotates_q_and_k_and_writes_the_pool_in_an_emulation(rows, pool, trad):
    """ROPE: the q/k/v GEMV (2 query heads, 1 kv head of 32) rotates q and k for each row's
    position as RoPE does (pairs i and i + 16, or 2i and 2i + 1), v as it comes; with the
    pool, k and v go to the rows' slots of the pool arrays and the output is q alone."""
    D, H, Hk, k = 32, 2, 1, 256
    n = (H + 2 * Hk) * D
    mx.random.seed(rows)
    w, scales, biases = mx.quantize(mx.random.normal((n, k)), group_size=64, bits=4)
    x = mx.random.normal((rows, k))
    pos = np.array([5, 900, 17][:rows], dtype=np.int32)
    inv_freq = 1.0 / (10000.0 ** (np.arange(0, D, 2, dtype=np.float32) / D))
    y = np.array(x @ mx.dequantize(w, scales, biases, group_size=64, bits=4).T)
    want = rope_reference(y, pos, inv_freq, H, Hk, D, trad)
    slots = np.array([3, 6, 1][:rows], dtype=np.int32)
    k_pool, v_pool = np.zeros((Hk, 8, D), np.float32), np.zeros((Hk, 8, D), np.float32)
    rope = {"ROPE": 1, "HD": D, "QN": H * D, "KN": Hk * D, "TRAD": int(trad), "POOL": int(pool)}
    constants, blocks = q4_gemv.gemv_launch(rows, n, k, 64, rope=rope)
    inputs = {"x": np.array(x), "w": np.array(w), "scales": np.array(scales), "biases": np.array(biases),
              "res": np.zeros(1, np.float32), "pos": pos, "freq_pi": inv_freq / np.pi, "k_pool": k_pool,
              "v_pool": v_pool, "slots": slots}
    got = cuda_emulation.run_kernel(q4_gemv.ROPE_SOURCE, inputs, constants, blocks, q4_gemv.GEMV_WARPS * 32,
                                    (rows, H * D) if pool else (rows, n))
    close = dict(rtol=1e-4, atol=1e-3)  # (products of ~30: float32 sums in another order, then rotated)
    if not pool:
        np.testing.assert_allclose(got, want, **close)
        return
    np.testing.assert_allclose(got, want[:, : H * D], **close)
    np.testing.assert_allclose(k_pool[0, slots], want[:, H * D : (H + Hk) * D], **close)
    np.testing.assert_allclose(v_pool[0, slots], want[:, (H + Hk) * D :], **close)
    assert not k_pool[0, np.setdiff1d(np.arange(8), slots)].any()


@pytest.mark.skipif(not cuda_emulation.available(), reason="the emulation needs g++ (C++20)")
@pytest.mark.parametrize("shape", list(q4_mma.MMA_SHAPES))
@pytest.mark.parametrize("split", [False, True])
@pytest.mark.parametrize("rows,n,k,group_size", [(5, 32, 256, 64), (21, 16, 512, 32), (70, 16, 128, 128)])
def test_the_mma_source_computes_the_quantized_matmul_in_an_emulation(rows, n, k, group_size, split, shape,
                                                                      monkeypatch):
    """The tensor-core kernel's CUDA source on the CPU, mma.sync emulated from its fragment
    layouts: bfloat16 x times the dequantized weights, rounded to bf16 or (split) as exact
    as float32's, for one partial row tile (5), two tiles (21), and two passes of four
    tiles with warps left without a k-chunk (70 rows, k 128); in both block shapes."""
    monkeypatch.setattr(q4_mma, "MMA_SHAPE", shape)
    mx.random.seed(rows)
    w, scales, biases = mx.quantize(mx.random.normal((n, k)), group_size=group_size, bits=4)
    x = mx.random.normal((rows, k))
    constants, blocks = q4_mma.mma_launch(rows, n, k, group_size, split=split)
    assert constants["RT"] == {5: 1, 21: 2, 70: 4}[rows]
    assert (constants["MMA_W"], constants["NT"]) == q4_mma.MMA_SHAPES[shape]
    inputs = {"x": np.array(x), "w": np.array(w), "scales": np.array(scales), "biases": np.array(biases)}
    got = cuda_emulation.run_kernel(q4_mma.SOURCE, inputs, constants, blocks, constants["MMA_W"] * 32,
                                    (rows, n), header=q4_mma.EMULATED_HEADER)
    as_bf16 = lambda a: np.array(a.astype(mx.bfloat16).astype(mx.float32))  # noqa: E731
    weights = mx.dequantize(w, scales, biases, group_size=group_size, bits=4)
    want = as_bf16(x) @ (np.array(weights) if split else as_bf16(weights)).T
    # split: the weights' halves carry 16 of float32's 24 mantissa bits
    np.testing.assert_allclose(got, want, rtol=1e-4 if split else 1e-3,
                               atol=(2e-5 if split else 1e-3) * np.abs(want).max())
    if split:  # and a bf16 rounding of the weights would not have passed that
        rounded = as_bf16(x) @ as_bf16(weights).T
        assert np.abs(rounded - want).max() > 2e-5 * np.abs(want).max()


def test_few_rows_of_4bit_layers_take_the_gemv_when_asked(monkeypatch):
    model = quantized_model(4)
    x_few, x_many = mx.random.normal((1, 2, 128)), mx.random.normal((3, 3, 128))
    expected_few = model(x_few)
    assert route_quantized_layers(model, 8, gemv=True) == 2
    calls = []
    monkeypatch.setattr(quantized, "gemv", lambda x, w, s, b, gs: calls.append(x.shape) or mx.quantized_matmul(
        x, w, scales=s, biases=b, transpose=True, group_size=gs, bits=4))
    assert mx.array_equal(model(x_few), expected_few)
    assert calls == [(1, 2, 128), (1, 2, 256)]  # both layers, their own inputs
    model(x_many)  # 9 rows: the dequantized matmul
    assert len(calls) == 2
    eight_bit = quantized_model(8)
    route_quantized_layers(eight_bit, 8, gemv=True)
    eight_bit(x_few)  # the kernel takes 4-bit weights only
    assert len(calls) == 2
    assert route_quantized_layers(quantized_model(4), None, gemv=True) == 2  # the GEMV alone


def stand_in_gemv(calls: list[bool]):
    """quantized.gemv through MLX's quantized kernel (for a machine without CUDA): each
    call appends whether it was given a residual to add."""

    def gemv(x, w, s, b, gs, res=None):
        calls.append(res is not None)
        y = mx.quantized_matmul(x, w, scales=s, biases=b, transpose=True, group_size=gs, bits=4)
        return y if res is None else res + y

    return gemv


def test_plus_adds_the_residual_inside_the_gemv_when_asked(monkeypatch):
    """A routed 4-bit layer's `plus(x, res)` (blocks.py's 4-bit blocks): res + layer(x),
    through the GEMV with `res` under GEMV_RESIDUAL, the add after it otherwise; the same
    values either way."""
    layer = quantized_model(4).layers[1]  # (no bias)
    x, res = mx.random.normal((2, 256)), mx.random.normal((2, 64))
    many, res_many = mx.random.normal((9, 256)), mx.random.normal((9, 64))  # 9 rows: dequantized weights
    want, want_many = res + layer(x), res_many + layer(many)  # MLX's own layer
    route_quantized_layers(layer, 8, gemv=True)
    calls = []
    monkeypatch.setattr(quantized, "gemv", stand_in_gemv(calls))
    monkeypatch.setattr(quantized, "GEMV_RESIDUAL", False)
    assert mx.array_equal(layer.plus(x, res), want) and calls == [False]  # off: the add after
    monkeypatch.setattr(quantized, "GEMV_RESIDUAL", True)
    assert mx.array_equal(layer.plus(x, res), want) and calls == [False, True]
    np.testing.assert_allclose(np.array(layer.plus(many, res_many)), np.array(want_many), rtol=1e-5, atol=1e-5)
    assert calls == [False, True]


def test_steps_above_the_gemvs_rows_take_the_tensor_core_kernel_when_asked(monkeypatch):
    """With both kernels: up to GEMV_ROWS rows the GEMV, above them (bfloat16) the
    tensor-core kernel (its weights split in two halves when asked), from dequantize_rows
    the dequantized weights; float32 rows against bfloat16 scales, which neither kernel
    takes, MLX's quantized matmul."""
    model = quantized_model(4)
    model.set_dtype(mx.bfloat16)
    calls = []
    mlx_kernel = lambda x, w, s, b, gs: mx.quantized_matmul(x, w, scales=s, biases=b, transpose=True,  # noqa: E731
                                                              group_size=gs, bits=4)
    monkeypatch.setattr(quantized, "gemv", lambda *a: calls.append(("gemv", a[0].shape[0])) or mlx_kernel(*a))
    monkeypatch.setattr(quantized, "mma", lambda *a, split: calls.append(("mma", a[0].shape[0], split))
                        or mlx_kernel(*a))
    assert route_quantized_layers(model, 40, gemv=True, mma=True) == 2
    for rows in (quantized.GEMV_ROWS, quantized.GEMV_ROWS + 1, 39, 40):
        model(mx.random.normal((rows, 128)).astype(mx.bfloat16))
    model(mx.random.normal((20, 128)))  # float32 rows
    assert calls == [("gemv", 8), ("gemv", 8), ("mma", 9, False), ("mma", 9, False), ("mma", 39, False),
                     ("mma", 39, False)]
    calls.clear()
    route_quantized_layers(model, 40, gemv=True, mma=True, mma_split=True)
    model(mx.random.normal((9, 128)).astype(mx.bfloat16))
    assert calls == [("mma", 9, True), ("mma", 9, True)]


@pytest.mark.skipif(not cuda_is_default(), reason="the kernels run on a CUDA GPU")
@pytest.mark.parametrize("kernel,rows", [("gemv", r) for r in (1, 2, 5, 8, 16, 40)]
                         + [("gemv-wide", r) for r in (1, 5, 16)] + [("gemv-sums", r) for r in (1, 2, 5, 16)] + [("mma", r) for r in (9, 16, 40, 64, 100)]
                         + [("mma-split", r) for r in (9, 64)] + [("mma-wide", r) for r in (9, 40, 100)])
@pytest.mark.parametrize("group_size", [32, 64, 128])
def test_the_kernels_give_mlxs_quantized_matmul(kernel, rows, group_size, monkeypatch):
    monkeypatch.setattr(q4_gemv, "GEMV_WIDE_LOADS", kernel in ("gemv-wide", "gemv-sums"))
    monkeypatch.setattr(q4_gemv, "GEMV_SUMS", kernel == "gemv-sums")
    monkeypatch.setattr(q4_gemv, "GEMV_MAGIC_NIBBLES", rows % 2 == 1)  # (the GEMV's two ways to make nibbles floats)
    monkeypatch.setattr(q4_mma, "MMA_SHAPE", "wide" if kernel == "mma-wide" else "narrow")
    mx.random.seed(rows)
    w, scales, biases = mx.quantize(mx.random.normal((4096, 2048)).astype(mx.bfloat16), group_size=group_size, bits=4)
    x = mx.random.normal((rows, 2048)).astype(mx.bfloat16)
    run = {"gemv": q4_gemv.gemv, "gemv-wide": q4_gemv.gemv, "gemv-sums": q4_gemv.gemv, "mma": q4_mma.mma, "mma-wide": q4_mma.mma,
           "mma-split": functools.partial(q4_mma.mma, split=True)}
    got = run[kernel](x, w, scales, biases, group_size).astype(mx.float32)
    want = mx.quantized_matmul(x, w, scales=scales, biases=biases, transpose=True, group_size=group_size,
                               bits=4).astype(mx.float32)
    np.testing.assert_allclose(np.array(got), np.array(want), rtol=2e-2, atol=2e-2 * float(mx.abs(want).max()))


@pytest.mark.anyio
@pytest.mark.skipif(cuda_is_default(), reason="the refusal is for backends without CUDA")
@pytest.mark.parametrize("setting", ["quantized_gemv", "quantized_mma", "dense_mma"])
async def test_always_on_a_cuda_kernel_without_cuda_is_refused_at_start(setting):
    import unikern
    from unikern.errors import UnikernError
    from unikern.testing.families import cached_quantized

    overrides = {"execute": {setting: "always"}}  # the execute stage fails its start, saying why
    with pytest.raises(UnikernError, match=f"ConfigError: execute.{setting}: 'always' needs MLX's CUDA backend"):
        async with unikern.Engine.from_pipeline("generate", model=str(cached_quantized("tiny-llama", 4)),
                                                overrides=overrides):
            pass


@pytest.mark.skipif(not cuda_is_default(), reason="the kernels run on a CUDA GPU")
@pytest.mark.parametrize("rows", [1, 3])
@pytest.mark.parametrize("dtype", [mx.float32, mx.bfloat16])
def test_the_epilogue_gemvs_on_cuda_give_mlxs_ops(rows, dtype):
    """gemv_swiglu and gemv_rope (into the pool, an 8B layer's heads: 32 of q, 8 of k and
    v, 128 wide) on the GPU against MLX's quantized matmul and numpy's SwiGLU and RoPE."""
    D, H, Hk, k = 128, 32, 8, 1024
    mx.random.seed(rows)
    layer = nn.QuantizedLinear(k, (H + 2 * Hk) * D, bias=False, group_size=64, bits=4)
    gate_up = nn.QuantizedLinear(k, 2 * 512, bias=False, group_size=64, bits=4)
    layer.set_dtype(dtype), gate_up.set_dtype(dtype)
    x = mx.random.normal((rows, k)).astype(dtype)
    f32 = functools.partial(np.array, dtype=np.float32)
    close = dict(rtol=2e-2, atol=3e-2) if dtype == mx.bfloat16 else dict(rtol=1e-4, atol=1e-3)

    y = f32(gate_up(x).astype(mx.float32))
    gate, up = y[:, :512], y[:, 512:]
    np.testing.assert_allclose(f32(q4_gemv.gemv_swiglu(x, gate_up).astype(mx.float32)),
                               gate / (1 + np.exp(-gate)) * up, **close)

    pos = mx.array([5, 900, 17][:rows], dtype=mx.int32)
    slots = mx.array([3, 6, 1][:rows], dtype=mx.int32)
    inv_freq = 1.0 / (10000.0 ** (np.arange(0, D, 2, dtype=np.float32) / D))
    k_pool, v_pool = mx.zeros((Hk, 8, D), dtype), mx.zeros((Hk, 8, D), dtype)
    mx.eval(k_pool, v_pool)  # (buffers of their own before the kernel writes into them)
    q = q4_gemv.gemv_rope(x, layer, pos, mx.array(inv_freq / np.pi), H * D, D, False, (k_pool, v_pool, slots))
    mx.eval(q, k_pool, v_pool)
    want = rope_reference(f32(layer(x).astype(mx.float32)), np.array(pos), inv_freq, H, Hk, D, False)
    np.testing.assert_allclose(f32(q.astype(mx.float32)).reshape(rows, -1), want[:, : H * D], **close)
    written = np.array(slots)
    np.testing.assert_allclose(f32(k_pool.astype(mx.float32))[:, written].transpose(1, 0, 2).reshape(rows, -1),
                               want[:, H * D : (H + Hk) * D], **close)
    np.testing.assert_allclose(f32(v_pool.astype(mx.float32))[:, written].transpose(1, 0, 2).reshape(rows, -1),
                               want[:, (H + Hk) * D :], **close)


def test_the_gemv_constants_come_from_the_settings_variable(monkeypatch):
    """UNIKERN_Q4_GEMV's "NAME=VALUE ..." sets q4_gemv's GEMV_<NAME> (for GPU comparisons in
    servers); a name that is not one of them is refused with the ones there are."""
    from unikern.errors import ConfigError

    for name in ("GEMV_SUMS", "GEMV_WARPS", "GEMV_UNROLL"):
        monkeypatch.setattr(q4_gemv, name, getattr(q4_gemv, name))  # (restored after the test)
    assert quantized.set_gemv_constants("sums=1, WARPS=1 unroll=4") == {"GEMV_SUMS": 1, "GEMV_WARPS": 1,
                                                                       "GEMV_UNROLL": 4}
    assert q4_gemv.GEMV_SUMS is True and q4_gemv.GEMV_WARPS == 1
    assert q4_gemv.gemv_launch(1, 8, 4096, 64)[0]["GEMV_U"] == 4
    with pytest.raises(ConfigError, match="'BLOCKS=2' is not NAME=INTEGER with NAME one of .*'SUMS'"):
        quantized.set_gemv_constants("BLOCKS=2")


@pytest.mark.skipif(not cuda_emulation.available(), reason="the emulation needs g++ (C++20)")
@pytest.mark.parametrize("n,k,shape", [(8, 14336, "wide"), (32, 4096, "many"), (16, 1024, "default")])
def test_one_row_steps_take_their_block_shape_and_the_same_values_in_an_emulation(n, k, shape, monkeypatch):
    """A one-row step of a weight of K >= ONE_ROW_WIDE_K runs 8 warps with the per-word sums,
    one of N >= ONE_ROW_MANY_N (lowered here to 32 for the emulation's sake) 2 warps with the
    loop unrolled twice; two rows keep the defaults. Each gives x times the dequantized
    weights, with the residual added."""
    monkeypatch.setattr(q4_gemv, "ONE_ROW_MANY_N", 32)
    mx.random.seed(n + k)
    w, scales, biases = mx.quantize(mx.random.normal((n, k)), group_size=64, bits=4)
    x, res = mx.random.normal((1, k)), mx.random.normal((1, n))
    constants, blocks = q4_gemv.gemv_launch(1, n, k, 64, res=True)
    want_shape = {"wide": q4_gemv.ONE_ROW_WIDE, "many": q4_gemv.ONE_ROW_MANY, "default": {}}[shape]
    assert {name: constants[name] for name in want_shape} == want_shape
    if shape == "default":
        assert (constants["GEMV_W"], constants["SUMS"]) == (q4_gemv.GEMV_WARPS, int(q4_gemv.GEMV_SUMS))
    assert q4_gemv.gemv_launch(2, n, k, 64)[0]["GEMV_W"] == q4_gemv.GEMV_WARPS
    inputs = {"x": np.array(x), "w": np.array(w), "scales": np.array(scales), "biases": np.array(biases),
              "res": np.array(res)}
    got = cuda_emulation.run_kernel(q4_gemv.SOURCE, inputs, constants, blocks, constants["GEMV_W"] * 32, (1, n))
    want = x @ mx.dequantize(w, scales, biases, group_size=64, bits=4).T + res
    np.testing.assert_allclose(got, np.array(want), rtol=1e-4, atol=1e-4)


@pytest.mark.skipif(not cuda_is_default(), reason="the kernels run on a CUDA GPU")
@pytest.mark.parametrize("n,k", [(4096, 14336), (16384, 2048)])
def test_one_row_shapes_on_cuda_give_mlxs_quantized_matmul(n, k):
    """The one-row block shapes (8 warps for a wide K, 2 warps unrolled for many features) on
    the GPU against MLX's quantized matmul, with the residual added."""
    mx.random.seed(n)
    w, scales, biases = mx.quantize(mx.random.normal((n, k)).astype(mx.bfloat16), group_size=64, bits=4)
    x, res = mx.random.normal((1, k)).astype(mx.bfloat16), mx.random.normal((1, n)).astype(mx.bfloat16)
    assert q4_gemv.one_row_shape(n, k)
    got = q4_gemv.gemv(x, w, scales, biases, 64, res=res).astype(mx.float32)
    want = (mx.quantized_matmul(x, w, scales=scales, biases=biases, transpose=True, group_size=64, bits=4)
            + res).astype(mx.float32)
    np.testing.assert_allclose(np.array(got), np.array(want), rtol=2e-2, atol=2e-2 * float(mx.abs(want).max()))
