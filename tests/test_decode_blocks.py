"""A decoder block's decode step as four GEMV kernels (stages/execute/blocks.py,
stages/execute/cuda/block_gemv.py): the kernel's CUDA source in the thread-per-lane
emulation against numpy for each epilogue, RoPE's angles against mlx-lm's RoPE modules,
whole fused blocks (kernels emulated, and MLX's ops) against the family's own block, and
mlx-lm's code still what the fused steps repeat. Greedy parity through the engine:
tests/test_families.py (variant "blocks")."""

import importlib
import inspect

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from mlx_lm.models import llama, qwen2
from mlx_lm.models.cache import KVCache
from mlx_lm.models.rope_utils import initialize_rope

from tests import cuda_emulation
from unikern.platform import cuda_is_default
from unikern.platform.kernel_cache import float_bits
from unikern.stages.execute import blocks
from unikern.stages.execute.cuda import block_gemv, block_kernel
from unikern.stages.execute.fused import fuse_projections

emulation = pytest.mark.skipif(not cuda_emulation.available(), reason="the emulation needs g++ (C++20)")


def run_source(x, w, mode, bias=None, norm=None, res=None, pos=None, freq_pi=None, head_dim=2, rope_pairs=0,
               trad=False, q_features=0, split=None, ss=None, hand_ss=False):
    """The kernel's source over float32 arrays (ROPE: [q, k, v]; hand_ss: (out, the
    rows' sums of squares of out))."""
    rows, K = x.shape
    N = w.shape[0]
    nout = N // 2 if mode == block_gemv.SWIGLU else q_features if mode == block_gemv.ROPE else N
    split = split or block_gemv.split_for(K, N, mx.float32)
    one = np.zeros(1, np.float32)
    inputs = {"x": x, "w": w, "bias": one if bias is None else bias, "norm_w": one if norm is None else norm[0],
              "res": one if res is None else res,
              "pos": np.zeros(1, np.int32) if pos is None else pos, "freq_pi": one if freq_pi is None else freq_pi,
              "k_pool": one, "v_pool": one.copy(), "slots": np.zeros(1, np.int32),
              "ss": one if ss is None else ss, "counter": np.zeros(1, np.uint32)}
    constants = {"K": K, "N": N, "NOUT": nout, "ROWS": 1 << (rows - 1).bit_length(), "WARPS": block_gemv.WARPS,
                 "SPLIT": split, "U": block_gemv.UNROLL, "NORM": int(norm is not None), "BIAS": int(bias is not None),
                 "MODE": mode, "HD": head_dim, "ROPE_PAIRS": rope_pairs, "QN": q_features or N, "TRAD": int(trad), "POOL": 0,
                 "SSI": int(ss is not None), "SSO": int(hand_ss), "EPS": float_bits(norm[1]) if norm else 0}
    kv = (N - q_features) // 2
    grid = -(-(N // 2) // (block_gemv.WARPS // split))
    outputs = {"out": (rows, nout), "out_k": (rows, kv) if kv else (1,), "out_v": (rows, kv) if kv else (1,),
               "out_ss": (rows,) if hand_ss else (1,), "out_part": (rows, grid) if hand_ss else (1,)}
    got = cuda_emulation.run_kernel(block_gemv.SOURCE, inputs, constants, grid, block_gemv.WARPS * 32, (rows, nout),
                                    block_gemv.EMULATED_HEADER, outputs)
    if hand_ss:
        return got["out"], got["out_ss"]
    return [got["out"], got["out_k"], got["out_v"]] if mode == block_gemv.ROPE else got["out"]


def rms_norm(x, w, eps):
    return w * (x / np.sqrt((x * x).mean(axis=-1, keepdims=True) + eps))


def rotate(y, pos, inv_freq, head_dim, heads, trad):
    """numpy RoPE over the first `heads` heads of y [rows, N]."""
    y = y.copy()
    for r in range(y.shape[0]):
        angle = pos[r] * inv_freq
        c, s = np.cos(angle), np.sin(angle)
        for h in range(heads):
            head = y[r, h * head_dim : (h + 1) * head_dim]
            a, b = (head[0::2].copy(), head[1::2].copy()) if trad else (head[: head_dim // 2].copy(),
                                                                         head[head_dim // 2 :].copy())
            lo, hi = a * c - b * s, b * c + a * s
            if trad:
                head[0::2], head[1::2] = lo, hi
            else:
                head[: head_dim // 2], head[head_dim // 2 :] = lo, hi
    return y


@emulation
@pytest.mark.parametrize("rows, split, N", [(3, None, 48), (1, 1, 48), (2, None, 520)])
def test_the_residual_kernel_hands_its_rows_sums_of_squares_to_the_next_norm(rows, split, N):
    """RESIDUAL with hand_ss: the output and each row's sum of its squares (every block's
    share, added by the last block done; 520 features: 65 blocks, more than a warp's 32
    lanes); the next kernel's norm from those sums gives the norm of the output."""
    rng = np.random.default_rng(rows + N)
    K = 1040
    x = rng.standard_normal((rows, K)).astype(np.float32)
    w = (rng.standard_normal((N, K)) / np.sqrt(K)).astype(np.float32)
    res = rng.standard_normal((rows, N)).astype(np.float32)
    out, ss = run_source(x, w, block_gemv.RESIDUAL, res=res, split=split, hand_ss=True)
    np.testing.assert_allclose(out, x @ w.T + res, rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(ss, (out * out).sum(axis=-1), rtol=1e-5)
    nw = rng.standard_normal(N).astype(np.float32)
    w2 = (rng.standard_normal((48, N)) / np.sqrt(N)).astype(np.float32)
    got = run_source(out, w2, block_gemv.PLAIN, norm=(nw, 1e-5), ss=ss)
    np.testing.assert_allclose(got, rms_norm(out, nw, 1e-5) @ w2.T, rtol=1e-4, atol=1e-4)


def test_what_a_kernel_counts_on_or_hands_over_lies_outside_mlxs_small_pool(monkeypatch):
    """MLX's CUDA allocator puts arrays of up to 8 bytes in managed memory that the GPU
    reaches across the bus; on an H200 a residual kernel counting on a one-element counter
    there took 600 us instead of 10. The counter, the handed sums of one row and the
    pool write's marker are larger than that; eps goes in as a template argument."""
    from unikern.platform.kernel_cache import SMALL_POOL_BYTES
    from unikern.stages.execute.cuda import pool_write

    launches = []

    def recorder(name, input_names, *rest, **_):
        def launch(inputs, template, output_shapes, output_dtypes, **_):
            launches.append((name, dict(zip(input_names, inputs, strict=True)), dict(template), output_shapes))
            return [mx.zeros(s, dtype=d) for s, d in zip(output_shapes, output_dtypes, strict=True)]
        return launch

    monkeypatch.setattr(block_gemv, "cuda_kernel", recorder)
    monkeypatch.setattr(pool_write, "cuda_kernel", recorder)
    x, w = mx.zeros((1, 256), mx.bfloat16), mx.zeros((64, 256), mx.bfloat16)
    count = block_gemv.counter()
    _, ss = block_gemv.gemv(x, w, block_gemv.RESIDUAL, res=mx.zeros((1, 64), mx.bfloat16), hand_ss=count)
    block_gemv.gemv(x, w, block_gemv.PLAIN, norm=(mx.ones((256,), mx.bfloat16), 1e-5), ss=ss)
    done = pool_write.write(mx.zeros((1, 2, 1, 32), mx.bfloat16), mx.zeros((1, 2, 1, 32), mx.bfloat16),
                                 mx.zeros((2, 16, 32), mx.bfloat16), mx.zeros((2, 16, 32), mx.bfloat16),
                                 mx.array([3], dtype=mx.int32))
    assert min(count.nbytes, ss.nbytes, done.nbytes) > SMALL_POOL_BYTES
    normed = launches[1]
    assert "eps" not in normed[1] and np.float32(1e-5).view(np.int32) == normed[2]["EPS"]


@emulation
@pytest.mark.parametrize("rows, split", [(3, None), (1, 1)])
def test_the_kernel_source_gives_each_epilogue_in_an_emulation(rows, split):
    """Plain, + residual, SwiGLU, with and without the norm and the bias. A K of 1,040
    float32 is 260 chunks of 16 bytes: split over 2 warps per pair (split_for's choice
    here), or in one warp, which takes a second, partial pass of the unrolled loads."""
    rng = np.random.default_rng(rows)
    K, N = 1040, 48
    assert block_gemv.split_for(K, N, mx.float32) == 2
    x = rng.standard_normal((rows, K)).astype(np.float32)
    w = (rng.standard_normal((N, K)) / np.sqrt(K)).astype(np.float32)
    bias = rng.standard_normal(N).astype(np.float32)
    nw = rng.standard_normal(K).astype(np.float32)
    res = rng.standard_normal((rows, N)).astype(np.float32)
    close = {"rtol": 1e-4, "atol": 1e-4}
    np.testing.assert_allclose(run_source(x, w, block_gemv.PLAIN, split=split), x @ w.T, **close)
    np.testing.assert_allclose(run_source(x, w, block_gemv.RESIDUAL, bias=bias, res=res, split=split),
                               x @ w.T + bias + res, **close)
    n = rms_norm(x, nw, 1e-5)
    y = n @ w.T
    np.testing.assert_allclose(run_source(x, w, block_gemv.PLAIN, norm=(nw, 1e-5), split=split), y, **close)
    gate, up = y[:, : N // 2], y[:, N // 2 :]
    want = gate / (1 + np.exp(-gate)) * up
    np.testing.assert_allclose(run_source(x, w, block_gemv.SWIGLU, norm=(nw, 1e-5), split=split), want, **close)


@emulation
@pytest.mark.parametrize("trad", [False, True])
def test_the_kernel_rotates_q_and_k_and_leaves_v(trad):
    """ROPE: heads of 16 features, 2 q and 1 k heads rotated, 1 v head left, two rows
    at their own positions, with the norm and a bias; q, k and v in their own outputs."""
    rng = np.random.default_rng(7)
    D, heads, K, rows = 16, 3, 64, 2
    N = (heads + 1) * D
    x = rng.standard_normal((rows, K)).astype(np.float32)
    w = (rng.standard_normal((N, K)) / 8).astype(np.float32)
    bias = rng.standard_normal(N).astype(np.float32)
    nw = rng.standard_normal(K).astype(np.float32)
    pos = np.array([5, 300], np.int32)
    inv_freq = (10000.0 ** (-np.arange(0, D, 2) / D)).astype(np.float32)
    q, k, v = run_source(x, w, block_gemv.ROPE, bias=bias, norm=(nw, 1e-6), pos=pos, freq_pi=inv_freq / np.pi,
                         head_dim=D, rope_pairs=heads * D // 2, trad=trad, q_features=2 * D)
    y = rms_norm(x, nw, 1e-6) @ w.T + bias
    np.testing.assert_allclose(np.concatenate([q, k, v], axis=1), rotate(y, pos, inv_freq, D, heads, trad),
                               rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("scaling, trad", [(None, False), (None, True), ({"type": "linear", "factor": 2.0}, False),
                                           ({"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                             "high_freq_factor": 4.0, "original_max_position_embeddings": 64}, False)])
def test_the_angles_are_mlx_lms_rope(scaling, trad):
    """inverse_frequencies of nn.RoPE (its position scale folded in) and Llama3RoPE
    rotate as the module does, at a far position too."""
    D = 64
    rope = initialize_rope(D, 500000.0, trad, scaling, 4096)
    inv_freq, traditional = blocks.inverse_frequencies(rope, D)
    assert traditional == trad
    x = mx.random.normal((1, 2, 1, D), key=mx.random.key(0))
    # an angle of 3,000 radians in float32 is good to about 2e-4 (its spacing there)
    for pos, atol in ((3, 1e-5), (3000, 5e-4)):
        want = np.array(rope(x, offset=pos))[0, :, 0]
        got = rotate(np.array(x).reshape(1, 2 * D), [pos], np.array(inv_freq), D, 2, trad).reshape(2, D)
        np.testing.assert_allclose(got, want, rtol=0, atol=atol)
    assert blocks.inverse_frequencies(nn.RoPE(D // 2), D) is None  # part of the head: not taken


def tiny(family, **extra):
    module = {"llama": llama, "qwen2": qwen2}[family]
    args = dict(model_type=family, hidden_size=64, num_hidden_layers=2, intermediate_size=96, num_attention_heads=4,
                num_key_value_heads=2, rms_norm_eps=1e-5, vocab_size=97, rope_theta=10000.0, tie_word_embeddings=False)
    model = module.Model(module.ModelArgs(**{**args, **extra}))
    mx.random.seed(3)
    model.update(nn.utils.tree_map(lambda p: mx.random.normal(p.shape) * 0.2, model.parameters()))
    return model


def decode_logits(model, prompt, steps):
    """One prompt (or rows of equal length: a list of them) prefilled, then `steps` greedy
    decode steps' logits."""
    rows = prompt if isinstance(prompt[0], list) else [prompt]
    cache = [KVCache() for _ in model.layers]
    model(mx.array(rows), cache=cache)
    token = mx.array([[row[-1]] for row in rows])
    out = []
    for _ in range(steps):
        logits = model(token, cache=cache)[:, -1]
        out.append(np.array(logits.astype(mx.float32)))
        token = mx.argmax(logits, axis=-1)[:, None]
    return out


@pytest.mark.parametrize("family, extra", [("llama", {}), ("qwen2", {}), ("llama", {"rope_traditional": True})])
def test_fused_blocks_through_mlx_ops_are_the_familys_block(family, extra):
    """Off CUDA the fused steps are the family's own ops: the same logits, bit for bit."""
    model = tiny(family, **extra)
    want = decode_logits(model, [5, 9, 11], 3)
    fuse_projections(model)
    assert blocks.fuse_decode_blocks(model, use_kernel=False) == 2
    got = decode_logits(model, [5, 9, 11], 3)
    assert blocks.fused_steps(model) == 2 * 3  # the prompt's forward ran the family's code
    for a, b in zip(got, want, strict=True):
        np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_steps_of_more_rows_through_mlx_ops_are_the_familys_block(family):
    """Steps of more rows than the kernels take, with ops_rows: the fused steps through
    MLX's ops (2-D matmuls through the weights' transposed views, q and k through one
    RoPE), the family's logits to float32's rounding (bit for bit on some CPUs; where the
    BLAS picks another kernel for the 2-D matmul than for the family's 3-D one, 2.4e-7
    apart at most); beyond ops_rows, the family's own code."""
    prompts = [[5 + r, 9, 11 + 2 * r] for r in range(6)]  # 6 rows: more than MAX_ROWS
    model = tiny(family)
    want = decode_logits(model, prompts, 3)
    fuse_projections(model)
    assert blocks.fuse_decode_blocks(model, use_kernel=False, ops_rows=6) == 2
    got = decode_logits(model, prompts, 3)
    assert blocks.fused_steps(model) == blocks.fused_steps(model, "ops_steps") == 2 * 3
    for a, b in zip(got, want, strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
    narrow = tiny(family)
    fuse_projections(narrow)
    blocks.fuse_decode_blocks(narrow, use_kernel=False, ops_rows=5)
    decode_logits(narrow, prompts, 3)
    assert blocks.fused_steps(narrow) == 0  # 6 rows > 5: the family's own code


def test_quantized_blocks_take_mlx_ops():
    """4-bit projections: the kernels' steps (up to 4 rows) through MLX's ops, each matmul
    through the layer's own call; more rows with ops_rows only; bit for bit the family's
    logits at one row and at six."""
    model = tiny("llama")
    nn.quantize(model, group_size=32, bits=4)
    one, six = [5, 9, 11], [[5 + r, 9, 11 + 2 * r] for r in range(6)]
    want = decode_logits(model, one, 3), decode_logits(model, six, 3)
    fuse_projections(model, quantized=True)
    assert blocks.fuse_decode_blocks(model, use_kernel=True) == 2
    got = decode_logits(model, one, 3), decode_logits(model, six, 3)
    assert blocks.fused_steps(model) == 2 * 3 and blocks.fused_steps(model, "ops_steps") == 0  # one row only
    assert blocks.fuse_decode_blocks(model, use_kernel=True, ops_rows=6) == 2
    again = decode_logits(model, six, 3)
    assert blocks.fused_steps(model, "ops_steps") == 2 * 3
    for a, b in zip([*got[0], *got[1], *again], [*want[0], *want[1], *want[1]], strict=True):
        np.testing.assert_array_equal(a, b)


def test_ops_rows_left_to_the_blocks_take_unquantized_steps_to_64_rows_and_4bit_ones_to_4():
    """ops_rows None (execute.fuse_blocks_ops_rows "auto"): unquantized blocks' steps of up
    to AUTO_OPS_ROWS rows through MLX's ops, 4-bit blocks' only up to the kernels' rows."""
    six = [[5 + r, 9, 11 + 2 * r] for r in range(6)]
    plain, four_bit = tiny("llama"), tiny("llama")
    nn.quantize(four_bit, group_size=32, bits=4)
    fuse_projections(plain)
    fuse_projections(four_bit, quantized=True)
    for model in (plain, four_bit):
        assert blocks.fuse_decode_blocks(model, use_kernel=False, ops_rows=None) == 2
        decode_logits(model, six, 3)
    assert blocks.fused_steps(plain) == blocks.fused_steps(plain, "ops_steps") == 2 * 3
    assert {b.__dict__["_block_plan"].max_rows for b in blocks.layers_of(plain)} == {blocks.AUTO_OPS_ROWS}
    assert blocks.fused_steps(four_bit) == 0  # 6 rows > the kernels' 4: the family's own code
    assert {b.__dict__["_block_plan"].max_rows for b in blocks.layers_of(four_bit)} == {blocks.MAX_ROWS}


def test_quantized_blocks_add_their_residuals_inside_the_gemv_when_asked(monkeypatch):
    """4-bit blocks with unikern's GEMV routing and quantized.GEMV_RESIDUAL: the o and down
    projections' residual adds go inside the GEMV (a stand-in with MLX's kernel here),
    the family's logits bit for bit."""
    from tests.test_quantized_rows import stand_in_gemv
    from unikern.stages.execute import quantized

    model = tiny("llama")
    nn.quantize(model, group_size=32, bits=4)
    want = decode_logits(model, [5, 9, 11], 3)
    fuse_projections(model, quantized=True)
    quantized.route_quantized_layers(model, 8, gemv=True)
    calls = []
    monkeypatch.setattr(quantized, "gemv", stand_in_gemv(calls))
    monkeypatch.setattr(quantized, "GEMV_RESIDUAL", True)
    monkeypatch.setattr(quantized, "GEMV_ROPE", False)  # (the stand-in has no RoPE or SwiGLU builds)
    monkeypatch.setattr(quantized, "GEMV_SWIGLU", False)
    assert blocks.fuse_decode_blocks(model, use_kernel=True) == 2
    got = decode_logits(model, [5, 9, 11], 3)
    assert calls.count(True) == 2 * 2 * 3  # two adds per block and step (the prompt's forward: not a block step)
    for a, b in zip(got, want, strict=True):
        np.testing.assert_array_equal(a, b)


@emulation
def test_quantized_blocks_rotate_inside_the_gemv_without_a_pool(monkeypatch):
    """4-bit blocks with quantized.GEMV_ROPE and a cache that is not the pool (mlx-lm's
    KVCache): the q/k/v GEMV returns q, k rotated and v, which the blocks slice for the
    cache; the kernels in the emulation give the family's logits."""
    from unikern.stages.execute import quantized
    from unikern.stages.execute.cuda import q4_gemv, weight_kernels

    ropes = []
    model = tiny("llama", hidden_size=64, num_attention_heads=2, num_key_value_heads=1, intermediate_size=64)
    nn.quantize(model, group_size=32, bits=4)
    want = decode_logits(model, [5, 9, 11], 2)
    fuse_projections(model, quantized=True)
    quantized.route_quantized_layers(model, 8, gemv=True)
    monkeypatch.setattr(q4_gemv, "GEMV_WARPS", 2)  # (each emulated CUDA thread is a fiber, switched at every barrier)
    monkeypatch.setattr(weight_kernels, "cuda_kernel", cuda_emulation.emulated_cuda_kernels())
    monkeypatch.setattr(quantized, "GEMV_ROPE", True)
    monkeypatch.setattr(blocks, "gemv_rope", lambda *a: ropes.append(a[-1]) or q4_gemv.gemv_rope(*a))
    assert blocks.fuse_decode_blocks(model, use_kernel=True) == 2
    got = decode_logits(model, [5, 9, 11], 2)
    assert ropes == [None] * 2 * 2  # every block's decode steps, no pool
    for a, b in zip(got, want, strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-4)


@emulation
@pytest.mark.parametrize("family, kernel_norm, kernel_rope", [("llama", 1, 1), ("qwen2", 1, 1), ("llama", 0, 1),
                                                               ("llama", 1, 0), ("llama", 2, 1), ("qwen2", 2, 1)])
def test_fused_blocks_through_the_kernels_give_the_familys_logits(family, kernel_norm, kernel_rope, monkeypatch):
    """The four kernel launches of a block as a CUDA machine runs them, in the emulation:
    the decode steps' logits as the family's own block gives them (float32). With
    KERNEL_NORM or KERNEL_ROPE off, MLX's norm or RoPE runs around a plain GEMV; with
    KERNEL_NORM 2 the residual kernels hand the rows' sums of squares to the next norm
    (the first block's input norm stays MLX's)."""
    launched, calls = [], []
    monkeypatch.setattr(block_gemv, "cuda_kernel", cuda_emulation.emulated_cuda_kernels(launched,
                                                                                     block_gemv.EMULATED_HEADER))
    monkeypatch.setattr(blocks, "KERNEL_NORM", kernel_norm)
    monkeypatch.setattr(blocks, "KERNEL_ROPE", kernel_rope)

    def recorded(x, w, mode, **kw):
        calls.append((mode, kw.get("norm") is not None, kw.get("ss") is not None, kw.get("hand_ss") is not None))
        return block_gemv.gemv(x, w, mode, **kw)

    monkeypatch.setattr(blocks, "gemv", recorded)
    model = tiny(family)
    want = decode_logits(model, [5, 9, 11, 40], 2)
    fuse_projections(model)
    assert blocks.fuse_decode_blocks(model, use_kernel=True) == 2
    got = decode_logits(model, [5, 9, 11, 40], 2)
    assert launched.count("unikern_block_gemv") == 4 * 2 * 2
    qkv_mode = block_gemv.ROPE if kernel_rope else block_gemv.PLAIN

    def expected(i):  # block i's four launches: (mode, norm, handed sums, hands sums on)
        handed = kernel_norm == 2
        return [(qkv_mode, kernel_norm == 1 or handed and i > 0, handed and i > 0, False),
                (block_gemv.RESIDUAL, False, False, handed),
                (block_gemv.SWIGLU, kernel_norm > 0, handed, False),
                (block_gemv.RESIDUAL, False, False, handed and i == 0)]  # (the last block hands nothing on)

    assert calls == (expected(0) + expected(1)) * 2
    for a, b in zip(got, want, strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-4)


def greedy(model, prompt, n):
    """mlx-lm's greedy continuation of one prompt (KVCache), n tokens."""
    cache = [KVCache() for _ in model.layers]
    logits = model(mx.array([prompt]), cache=cache)[:, -1]
    out = []
    for _ in range(n):
        token = int(mx.argmax(logits, axis=-1).item())
        out.append(token)
        logits = model(mx.array([[token]]), cache=cache)[:, -1]
    return out


@emulation
@pytest.mark.parametrize("fused", [True, False])
def test_decode_steps_write_the_pool_in_place_where_the_paged_kernel_reads_it(fused, monkeypatch):
    """Where the paged attention kernel reads the pool (CUDA), a decode step's keys and
    values go into the pool in place of the cache's two scatters per layer: from the
    fused block's q/k/v kernel itself, or (the family's own block, with
    paged_cache.WRITE_IN_PLACE) through one write kernel for both, which the attention
    kernel takes as its `after` input. The kernels in the emulation: a runner's prefill and
    decode window of two rows give the family's greedy tokens, and no decode step
    scatters."""
    pool_writes_case(monkeypatch, emulate=True, fused=fused)


@emulation
def test_quantized_blocks_rotate_and_write_the_pool_inside_the_gemv_when_asked(monkeypatch):
    """4-bit blocks with quantized.GEMV_ROPE and GEMV_SWIGLU: the q/k/v GEMV rotates q and
    k and writes k and v into the pool itself, the gate/up GEMV gives silu(gate) * up (and
    the o and down GEMVs add their residuals), so a decode step launches 4 GEMVs and the
    attention per layer, no RoPE, no pool write, no scatter. The kernels in the emulation:
    the family's greedy tokens."""
    pool_writes_case(monkeypatch, emulate=True, fused=True, bits=4)


@emulation
def test_ops_steps_rotate_and_write_the_pool_in_one_kernel_when_asked(monkeypatch):
    """Steps of more rows than the kernels take, through the fused block's MLX ops
    (ops_rows) with blocks.OPS_ROPE_WRITE: one kernel after the q/k/v matmul rotates q
    and k and writes k and v into the pool (pool_write.rope_write), no RoPE, no pool
    write kernel, no scatter; the kernels in the emulation: the family's greedy tokens."""
    pool_writes_case(monkeypatch, emulate=True, ops=True)


def block_reference(x, w_qkv, b_qkv, n1, w_o, n2, w_gu, w_down, pos, inv_freq, H, Hk, D, trad, scale, pool_k,
                    pool_v, slot, table, eps=1e-5):
    """numpy: one row through a decoder block, its keys and values written at `slot` of
    the pools [Hk, S, D] first, attending to the pools' slots `table` (the last is `slot`)."""
    y = rms_norm(x, n1, eps) @ w_qkv.T + (0 if b_qkv is None else b_qkv)
    y = rotate(y[None], [pos], inv_freq, D, H + Hk, trad)[0]
    q, k, v = y[: H * D].reshape(H, D), y[H * D : (H + Hk) * D].reshape(Hk, D), y[(H + Hk) * D :].reshape(Hk, D)
    pool_k[:, slot], pool_v[:, slot] = k, v
    o = np.zeros((H, D), np.float32)
    for h in range(H):
        keys, values = pool_k[h // (H // Hk), table], pool_v[h // (H // Hk), table]
        s = keys @ q[h] * scale
        p = np.exp(s - s.max())
        o[h] = p @ values / p.sum()
    hidden = x + o.reshape(-1) @ w_o.T
    gate, up = np.split(rms_norm(hidden, n2, eps) @ w_gu.T, 2)
    return hidden + (gate / (1 + np.exp(-gate)) * up) @ w_down.T


@emulation
@pytest.mark.parametrize("bias, trad, split, attn_split, preload, grid, flip", [
    (False, False, 1, 0, 0, 3, 0), (True, True, 2, 0, 0, 3, 0), (False, False, 1, 1, 0, 6, 0),
    (False, False, 1, 0, 1, 1, 0), (True, True, 2, 1, 1, 6, 0), (True, True, 2, 0, 0, 1, 1)])
def test_the_block_kernel_is_the_block_in_an_emulation(bias, trad, split, attn_split, preload, grid, flip,
                                                       monkeypatch):
    """block_kernel.py's one kernel per block against numpy: the block's output row, and k
    and v in the pool at the row's slot (float32). Its five phases run one launch each in
    the emulation, or in one launch, through its grid-wide barriers, where the grid is one
    block. With split 2 the four GEMV phases split their pairs over 2 warps; with attn_split
    each KV head's 5 positions go over 3 blocks, merged by the last done; with preload
    each warp's first weight loads of a phase come before the phase's barrier or norm;
    with flip the barrier is one atomic a block. No block gave up at a barrier."""
    monkeypatch.setattr(block_kernel, "FLIP_BARRIER", flip)
    monkeypatch.setattr(block_kernel, "SPIN_LIMIT", 1 << 12)  # (a block that would wait forever gives up soon)
    monkeypatch.setattr(block_kernel, "cuda_kernel", cuda_emulation.emulated_cuda_kernels(
        None, block_kernel.EMULATED_HEADER))
    monkeypatch.setattr(block_kernel, "SPLITS", None if split == 1 else (split,) * 4)
    monkeypatch.setattr(block_kernel, "WARPS", 2)
    monkeypatch.setattr(block_kernel, "GRID_BLOCKS", grid)
    monkeypatch.setattr(block_kernel, "PRELOAD", preload)
    monkeypatch.setattr(block_kernel, "ATTN_SPLIT", attn_split)
    monkeypatch.setattr(block_kernel, "ATTN_MIN_POSITIONS", 2)
    rng = np.random.default_rng(5)
    width, inter, H, Hk, D, S = 64, 288, 4, 2, 32, 16  # (inter: two chunks of the staged row for some threads)

    def rand(*shape, scale=1.0):
        return (rng.standard_normal(shape) * scale).astype(np.float32)

    x, n1, n2 = rand(width), 1 + rand(width, scale=0.1), 1 + rand(width, scale=0.1)
    w_qkv, b_qkv = rand((H + 2 * Hk) * D, width, scale=0.2), rand((H + 2 * Hk) * D) if bias else None
    w_o, w_gu, w_down = rand(width, H * D, scale=0.2), rand(2 * inter, width, scale=0.2), rand(width, inter, scale=0.2)
    pool_k, pool_v = rand(Hk, S, D), rand(Hk, S, D)
    table, pos = np.array([3, 7, 1, 12, 9], np.int32), 4  # the row's positions 0-4; 4 at slot 9
    inv_freq, _ = blocks.inverse_frequencies(nn.RoPE(D, traditional=trad, base=10000.0), D)
    want_k, want_v = pool_k.copy(), pool_v.copy()
    want = block_reference(x, w_qkv, b_qkv, n1, w_o, n2, w_gu, w_down, pos, np.array(inv_freq), H, Hk, D, trad,
                           D**-0.5, want_k, want_v, int(table[-1]), table)
    k_pool, v_pool, bar = mx.array(pool_k), mx.array(pool_v), block_kernel.barrier(Hk)
    outs = block_kernel.block_step(
        mx.array(x).reshape(1, 1, width), mx.array(w_qkv), None if b_qkv is None else mx.array(b_qkv),
        (mx.array(n1), 1e-5), mx.array(w_o), (mx.array(n2), 1e-5), mx.array(w_gu), mx.array(w_down),
        mx.array([pos], dtype=mx.int32), inv_freq / np.pi, H, Hk, D, trad, D**-0.5,
        (k_pool, v_pool, mx.array(table[-1:])), mx.array(table[None]), mx.array([pos + 1]), bar)
    assert outs[0].shape == (1, 1, width)
    np.testing.assert_allclose(np.array(outs[0]).reshape(-1), want, rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(np.array(k_pool), want_k, rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(np.array(v_pool), want_v, rtol=1e-4, atol=1e-4)
    if attn_split:  # 3 partials per KV head (positions 0-1, 2-3, 4), merged into `att`
        assert outs[5].shape == (grid // Hk * H * (D + 2),)
        assert not np.all(np.array(outs[5]) == 0)
    if grid == 1:  # one launch through the barriers: TIMES stamps each phase's staging, end and exit, in order
        monkeypatch.setattr(block_kernel, "TIMES", 1)
        stamps = np.array(block_kernel.block_step(
            mx.array(x).reshape(1, 1, width), mx.array(w_qkv), None if b_qkv is None else mx.array(b_qkv),
            (mx.array(n1), 1e-5), mx.array(w_o), (mx.array(n2), 1e-5), mx.array(w_gu), mx.array(w_down),
            mx.array([pos], dtype=mx.int32), inv_freq / np.pi, H, Hk, D, trad, D**-0.5,
            (mx.array(pool_k), mx.array(pool_v), mx.array(table[-1:])), mx.array(table[None]), mx.array([pos + 1]),
            bar)[6]).astype(np.int64)
        assert stamps.shape == (1 + 3 * block_kernel.PHASES,) and np.all(np.diff(stamps) > 0)
    assert int(bar[2].item()) == 0


def test_the_block_kernels_phases_wait_on_memory_the_fewest_times():
    """block_kernel.splits at the 1B shape (bfloat16, 132 blocks of 16 warps): q/k/v one
    warp a pair (one round of two passes, not three rounds of one over 4 warps), o two
    (one pass), gate/up one (4 rounds of 2 passes, fewer blocks idle than 8 of 1), down
    two (4 passes in one round, 4 blocks idle)."""
    assert block_kernel.splits(2048, 8192, 2048, 512, 2, 132, 16) == (1, 2, 1, 2)
    assert block_kernel.split_for(2048, 1536, 2, 132, 16) == 1
    assert block_kernel.split_for(64, 48, 4, 3, 2) == 1  # 16 chunks: one pass whatever the split


def test_the_block_kernel_takes_the_shapes_it_was_written_for(monkeypatch):
    """block_kernel.fits: the 1B shape in bfloat16 at a short table; not its float32 row
    (more shared memory than a kernel declares), not a head size the attention does not
    take, and a table the paged kernel would split only with the kernel's own split; no
    shape where the grid's size (one block per SM) is not known."""
    bf16, f32 = mx.bfloat16, mx.float32
    monkeypatch.setattr(block_kernel, "GRID_BLOCKS", None)
    monkeypatch.setattr(block_kernel, "cuda_sm_count", lambda: None)  # (no CUDA driver to ask)
    assert not block_kernel.fits(2048, 8192, 32, 8, 64, bf16, 128)
    monkeypatch.setattr(block_kernel, "cuda_sm_count", lambda: 132)  # an H200's
    assert block_kernel.fits(2048, 8192, 32, 8, 64, bf16, 128)
    assert not block_kernel.fits(2048, 8192, 32, 8, 64, f32, 128)
    assert block_kernel.fits(2048, 4096, 32, 8, 64, f32, 128)
    assert not block_kernel.fits(2048, 8192, 32, 8, 48, bf16, 128)
    monkeypatch.setattr(block_kernel, "ATTN_SPLIT", 0)
    assert not block_kernel.fits(2048, 8192, 32, 8, 64, bf16, 4096)
    monkeypatch.setattr(block_kernel, "ATTN_SPLIT", 1)
    assert block_kernel.fits(2048, 8192, 32, 8, 64, bf16, 4096)


def test_the_sm_count_comes_from_the_cuda_driver_where_there_is_one():
    from unikern.platform import cuda_sm_count

    assert cuda_sm_count("libunikern-no-such-driver.so") is None
    count = cuda_sm_count()
    assert count is None if not cuda_is_default() else count > 0


@emulation
def test_one_row_steps_run_as_one_kernel_per_block_when_asked(monkeypatch):
    """execute.block_kernel: a one-row decode step of each block as one kernel
    (block_kernel.py), its phases (norm, q/k/v, RoPE and the pool write; the attention;
    o and its residual; norm, gate/up and SwiGLU; down and its residual) one launch each
    in the emulation: the family's greedy tokens, no other kernel of the blocks, no
    scatter; a step of two rows keeps the four GEMV kernels."""
    pool_writes_case(monkeypatch, emulate=True, one_kernel=True)


def paged_runner(model):
    """A runner on a small pool of 4-slot blocks with the paged attention kernel on (its
    kernels emulated or on CUDA), and the model's geometry."""
    from unikern.stages.execute import runner as runner_module
    from unikern.stages.execute.model import ModelGeometry
    from unikern.stages.kv.pool import KVPool

    geo = ModelGeometry(model)
    pool = KVPool(num_layers=geo.num_layers, num_kv_heads=geo.num_kv_heads, head_dim=geo.head_dim, dtype=geo.dtype,
                  block_size=4, kernel_block_size=4, num_blocks=16, slab_blocks=16)
    runner = runner_module.ModelRunner(model, pool, paged_attention=True, geometry=geo)
    assert runner.paged == "kernel"
    return runner, geo


@emulation
def test_prompt_chunks_and_prefix_copies_go_into_the_pool_by_the_write_kernel(monkeypatch):
    """Where the paged attention kernel is on (CUDA), a prompt's chunks and a partial
    prefix hit's copied slots go into the pool by the write kernel (pool_write.write) as a
    decode step's do, not by MLX's scatter (a kernel its CUDA backend compiles at run
    time), and a later chunk reads them back after it; the embedding's lookup and those
    reads go through unikern's row kernel (cuda/rows.py), not MLX's gather (another kernel
    compiled at run time). The kernels in the emulation: two prompts fed in two chunks,
    then a third that copies the first three slots of the first's block, give the
    family's greedy tokens, and nothing scatters."""
    from unikern import messages as m
    from unikern.stages.execute import layouts, paged_cache
    from unikern.stages.execute import runner as runner_module
    from unikern.stages.execute.cuda import paged_attention, pool_write, rows, step_layout
    from unikern.stages.execute.embeddings import route_embeddings

    launched, scatters = [], []
    monkeypatch.setattr(paged_cache, "WRITE_IN_PLACE", True)
    monkeypatch.setattr(paged_attention, "cuda_kernel", cuda_emulation.emulated_cuda_kernels(launched))
    monkeypatch.setattr(pool_write, "cuda_kernel", cuda_emulation.emulated_cuda_kernels(launched))
    monkeypatch.setattr(rows, "cuda_kernel", cuda_emulation.emulated_cuda_kernels(launched))
    monkeypatch.setattr(step_layout, "cuda_kernel", cuda_emulation.emulated_cuda_kernels(launched))
    monkeypatch.setattr(runner_module, "cuda_is_default", lambda: True)  # the paged attention's kernel mode
    monkeypatch.setattr(paged_cache, "cuda_is_default", lambda: True)  # the row kernel's reads
    monkeypatch.setattr(layouts, "cuda_is_default", lambda: True)  # the step layout's kernel
    put = mx.put_along_axis
    monkeypatch.setattr(mx, "put_along_axis", lambda *a, **k: scatters.append(1) or put(*a, **k))
    model = tiny("llama", hidden_size=128, intermediate_size=96)  # head_dim 32
    prompts = {"a": [5, 9, 11, 40, 7, 3, 8], "b": [6, 8, 21, 30, 2], "c": [5, 9, 11, 50, 51]}
    want = {r: greedy(model, p, 3) for r, p in prompts.items()}
    assert route_embeddings(model) == 1
    runner, geo = paged_runner(model)
    params = m.SamplingParams(max_tokens=16)
    tables = {"a": (2, 4, 6), "b": (5, 3, 8), "c": (9, 11, 13)}  # 0, 1: reserved (paged_cache); none consecutive

    def chunk(names, start, end, sample):
        return tuple(m.SeqWork(r, tuple(prompts[r][start:end]), start, tables[r], sample, params) for r in names)

    writes = lambda: launched.count("unikern_pool_write")  # noqa: E731
    reads = lambda: launched.count("unikern_rows")  # noqa: E731
    read_before = reads()  # (the geometry's forwards)
    runner.run(m.Step(0, chunk("ab", 0, 3, False), 1), {})  # fresh prompts: their own keys
    assert writes() == geo.num_layers  # one forward, a write per layer
    assert reads() - read_before == 2  # the embedding's, the last positions' (rows_at)
    first = runner.run(m.Step(1, chunk("ab", 3, None, True), 1), {})  # the first chunks read back
    # a forward per row (lengths 4 and 2): the embedding's, each layer's keys and values, the last position's
    assert reads() - read_before == 2 + 2 * (2 + 2 * geo.num_layers)
    before, read_before = writes(), reads()
    # c: a's first three slots copied into c's first block (a partial prefix hit), then its rest
    first.update(runner.run(m.Step(2, chunk("c", 3, None, True), 1, copies=((2, 9, 3),)), {}))
    assert writes() - before == 2 * geo.num_layers  # the copy's and the forward's
    assert reads() - read_before == 2 * geo.num_layers + 2 + 2 * geo.num_layers  # the copy's, the forward's
    work = tuple(m.SeqWork(r, (first[r][0],), len(p), tables[r], True, params, num_generated=1)
                 for r, p in prompts.items())
    got = runner.run(m.Step(3, work, 2), {})
    assert {r: first[r] + got[r] for r in prompts} == want
    assert not scatters


def pool_writes_case(monkeypatch, emulate: bool, fused: bool = True, bits: int = 0, ops: bool = False,
                     one_kernel: bool = False) -> None:
    from unikern import messages as m
    from unikern.stages.execute import paged_cache, quantized
    from unikern.stages.execute import runner as runner_module
    from unikern.stages.execute.cuda import paged_attention, pool_write, q4_gemv, weight_kernels

    launched, swiglus = [], []
    monkeypatch.setattr(paged_cache, "WRITE_IN_PLACE", True)  # (the default: pinned for the test)
    if emulate:
        # fewer warps per block: each emulated CUDA thread is a fiber, switched at every barrier (the kernels take any count)
        monkeypatch.setattr(block_gemv, "WARPS", 2)
        monkeypatch.setattr(q4_gemv, "GEMV_WARPS", 2)
        monkeypatch.setattr(block_gemv, "cuda_kernel", cuda_emulation.emulated_cuda_kernels(
            launched, block_gemv.EMULATED_HEADER))
        monkeypatch.setattr(block_kernel, "cuda_kernel", cuda_emulation.emulated_cuda_kernels(
            launched, block_kernel.EMULATED_HEADER))
        monkeypatch.setattr(block_kernel, "WARPS", 2)
        monkeypatch.setattr(block_kernel, "GRID_BLOCKS", 3)
        monkeypatch.setattr(paged_attention, "cuda_kernel", cuda_emulation.emulated_cuda_kernels(launched))
        monkeypatch.setattr(pool_write, "cuda_kernel", cuda_emulation.emulated_cuda_kernels(launched))
        monkeypatch.setattr(runner_module, "cuda_is_default", lambda: True)  # the paged attention's kernel mode
        monkeypatch.setattr(weight_kernels, "cuda_kernel", cuda_emulation.emulated_cuda_kernels(launched))
    # head_dim 32; the 4-bit case smaller (each emulated CUDA thread is a fiber, switched at every barrier)
    heads = (2, 1) if bits else (4, 2)
    model = tiny("llama", hidden_size=32 * heads[0], num_attention_heads=heads[0], num_key_value_heads=heads[1],
                 intermediate_size=64 if bits else 96)  # (4-bit: the o and down GEMVs one build)
    if bits:
        nn.quantize(model, group_size=32, bits=bits)
    prompts, steps = {"a": [5, 9, 11, 40, 7], "b": [6, 8, 21]}, 2 if bits else 3
    if ops:  # more rows than the kernels take (block_gemv.MAX_ROWS)
        prompts.update({"c": [3, 4], "d": [30, 31, 32, 33], "e": [12]})
        monkeypatch.setattr(blocks, "OPS_ROPE_WRITE", True)
        roped = []
        monkeypatch.setattr(blocks, "rope_write", lambda *a: roped.append(1) or pool_write.rope_write(*a))
    want = {r: greedy(model, p, steps + 1) for r, p in prompts.items()}
    fuse_projections(model, quantized=bool(bits))
    if bits:
        monkeypatch.setattr(quantized, "GEMV_ROPE", True)
        monkeypatch.setattr(quantized, "GEMV_SWIGLU", True)
        monkeypatch.setattr(blocks, "gemv_swiglu", lambda *a: swiglus.append(1) or q4_gemv.gemv_swiglu(*a))
        quantized.route_quantized_layers(model, 8, gemv=True)
    if one_kernel:  # one row (the kernel's), then two rows again
        prompts = {"a": prompts["a"]}
        want = {"a": want["a"]}
    if fused:
        assert blocks.fuse_decode_blocks(model, use_kernel=True, ops_rows=8 if ops else 0, one_kernel=one_kernel) == 2
    runner, geo = paged_runner(model)
    params = m.SamplingParams(max_tokens=16)
    tables = {"a": (2, 3, 4), "b": (5, 6, 7), "c": (8, 9), "d": (10, 11), "e": (12, 13)}  # 0, 1: reserved (paged_cache)
    if one_kernel:  # (a lone row of consecutive blocks reads the pool through slices: paged_cache's span)
        tables["a"] = (2, 5, 3)
    first = runner.run(m.Step(0, tuple(m.SeqWork(r, tuple(p), 0, tables[r], True, params)
                                       for r, p in prompts.items()), 1), {})
    scatters = []
    put = mx.put_along_axis
    monkeypatch.setattr(mx, "put_along_axis", lambda *a, **k: scatters.append(1) or put(*a, **k))
    launched.clear()
    swiglus.clear()
    work = tuple(m.SeqWork(r, (first[r][0],), len(p), tables[r], True, params, num_generated=1)
                 for r, p in prompts.items())
    got = runner.run(m.Step(1, work, steps), {})
    assert {r: first[r] + got[r] for r in prompts} == want
    assert blocks.fused_steps(model, "pool_steps") == 2 * steps * fused and not scatters
    assert blocks.fused_steps(model, "kernel_steps") == 2 * steps * one_kernel
    if one_kernel:
        bars = [b.__dict__["_block_plan"].bar for b in model.layers]
        assert all(int(bar[2].item()) == 0 for bar in bars)  # no block gave up waiting at a barrier
        if emulate:
            assert launched.count("unikern_block_step") == 2 * steps  # (its 5 phases: a launch each here)
            assert set(launched) == {"unikern_block_step"}  # (the head and sampling: MLX's own)
    elif ops:
        assert blocks.fused_steps(model, "ops_steps") == 2 * steps and len(roped) == 2 * steps
        assert launched.count("unikern_rope_write") == 2 * steps and "unikern_pool_write" not in launched
    elif emulate and bits:
        assert launched.count("unikern_q4_gemv") == 4 * 2 * steps  # (the head: 97 features, not the GEMV's)
        assert "unikern_pool_write" not in launched and "unikern_block_gemv" not in launched
        assert len(swiglus) == 2 * steps
    elif emulate:
        assert launched.count("unikern_block_gemv") == 4 * 2 * steps * fused
        assert launched.count("unikern_pool_write") == 2 * steps * (not fused)
        assert sum(name.startswith("unikern_paged_decode_") for name in launched) >= 2 * steps


cuda = pytest.mark.skipif(not cuda_is_default(), reason="the kernels run on a CUDA GPU")


def relative_error(got, want):
    got, want = np.array(got.astype(mx.float32)), np.array(want.astype(mx.float32))
    return float(np.linalg.norm(got - want) / np.linalg.norm(want))


@cuda
def test_quantized_blocks_rotate_and_write_the_pool_inside_the_gemv_on_cuda(monkeypatch):
    """The same on a CUDA GPU (run with MLX_ENABLE_TF32=0): the family's greedy tokens."""
    pool_writes_case(monkeypatch, emulate=False, fused=True, bits=4)


@cuda
@pytest.mark.parametrize("dtype", [mx.float32, mx.bfloat16])
@pytest.mark.parametrize("rows", [1, 3])
def test_the_kernels_on_cuda_give_mlxs_ops(dtype, rows):
    """Each epilogue at the 1B shape's widths against MLX's ops in float32 from the same
    inputs (run with MLX_ENABLE_TF32=0): the kernel rounds as the ops do, so bfloat16
    differs by its rounding only."""
    keys = iter(mx.random.split(mx.random.key(rows), 12))

    def rand(*shape, scale=1.0):
        return (mx.random.normal(shape, key=next(keys)) * scale).astype(dtype)

    f32 = lambda a: a.astype(mx.float32)  # noqa: E731
    H, Hk, D, hidden, inter = 32, 8, 64, 2048, 8192
    x, nw, eps = rand(rows, hidden), rand(hidden), 1e-5
    n = mx.fast.rms_norm(f32(x), f32(nw), 1e-5)
    tol = 1e-4 if dtype == mx.float32 else 2e-2
    w, bias = rand((H + 2 * Hk) * D, hidden, scale=hidden**-0.5), rand((H + 2 * Hk) * D)
    pos = mx.array([7, 900, 3][:rows], dtype=mx.int32)
    inv_freq, _ = blocks.inverse_frequencies(nn.RoPE(D, base=10000.0), D)
    got = mx.concatenate([t.reshape(rows, -1) for t in block_gemv.gemv(
        x, w, block_gemv.ROPE, bias=bias, norm=(nw, eps), pos=pos, freq_pi=inv_freq / np.pi, head_dim=D,
        rope_pairs=(H + Hk) * D // 2, q_features=H * D)], axis=-1)  # q, k, v: [rows, heads, 1, D] each
    y = n @ f32(w).T + f32(bias)
    parts = [mx.fast.rope(y[:, a:b].reshape(rows, -1, 1, D), D, traditional=False, base=10000.0, scale=1.0,
                          offset=pos) for a, b in ((0, H * D), (H * D, (H + Hk) * D))]
    want = mx.concatenate([p.reshape(rows, -1) for p in parts] + [y[:, (H + Hk) * D :]], axis=-1)
    assert relative_error(got, want) < tol
    o, w = rand(rows, H * D), rand(hidden, H * D, scale=(H * D) ** -0.5)
    assert relative_error(block_gemv.gemv(o, w, block_gemv.RESIDUAL, res=x), f32(o) @ f32(w).T + f32(x)) < tol
    w = rand(2 * inter, hidden, scale=hidden**-0.5)
    gate, up = mx.split(n @ f32(w).T, 2, axis=-1)
    assert relative_error(block_gemv.gemv(x, w, block_gemv.SWIGLU, norm=(nw, eps)), nn.silu(gate) * up) < tol
    a, w = rand(rows, inter), rand(hidden, inter, scale=inter**-0.5)
    assert relative_error(block_gemv.gemv(a, w, block_gemv.RESIDUAL, res=x), f32(a) @ f32(w).T + f32(x)) < tol


@cuda
@pytest.mark.parametrize("dtype, attn_split, preload, flip", [
    (mx.float32, 0, 0, 0), (mx.bfloat16, 0, 0, 0), (mx.bfloat16, 1, 0, 0), (mx.bfloat16, 0, 1, 0),
    (mx.float32, 1, 1, 0), (mx.bfloat16, 1, 0, 1), (mx.float32, 0, 0, 1)])
def test_the_block_kernel_on_cuda_is_the_block(dtype, attn_split, preload, flip, monkeypatch):
    """block_kernel.py's one launch, its phases meeting at grid-wide barriers, at the 1B
    shape (float32: a narrower MLP, for shared memory) against numpy from the same
    inputs (run with MLX_ENABLE_TF32=0): the output row and k and v in the pool, and no
    block gave up waiting at a barrier; attn_split: the attention over 7 blocks per KV
    head (16 positions each), merged by the last done; preload: each phase's first weight
    loads before its barrier; flip: the barrier as one atomic a block. Two launches: the
    second starts from the barrier's count as the first left it."""
    monkeypatch.setattr(block_kernel, "ATTN_SPLIT", attn_split)
    monkeypatch.setattr(block_kernel, "FLIP_BARRIER", flip)
    monkeypatch.setattr(block_kernel, "PRELOAD", preload)
    rng = np.random.default_rng(9)
    width, H, Hk, D, S = 2048, 32, 8, 64, 256
    inter = 8192 if dtype == mx.bfloat16 else 4096

    def rand(*shape, scale=1.0):  # (rounded to dtype once, so numpy sees the kernel's inputs)
        return np.array(mx.array((rng.standard_normal(shape) * scale).astype(np.float32)).astype(dtype)
                        .astype(mx.float32))

    x, n1, n2 = rand(width), 1 + rand(width, scale=0.1), 1 + rand(width, scale=0.1)
    w_qkv, b_qkv = rand((H + 2 * Hk) * D, width, scale=width**-0.5), rand((H + 2 * Hk) * D)
    w_o, w_gu = rand(width, H * D, scale=(H * D) ** -0.5), rand(2 * inter, width, scale=width**-0.5)
    w_down, pool_k, pool_v = rand(width, inter, scale=inter**-0.5), rand(Hk, S, D), rand(Hk, S, D)
    table = rng.permutation(S)[:100].astype(np.int32)
    pos = len(table) - 1
    inv_freq, _ = blocks.inverse_frequencies(nn.RoPE(D, base=10000.0), D)
    want_k, want_v = pool_k.copy(), pool_v.copy()
    want = block_reference(x, w_qkv, b_qkv, n1, w_o, n2, w_gu, w_down, pos, np.array(inv_freq), H, Hk, D, False,
                           D**-0.5, want_k, want_v, int(table[-1]), table)
    k_pool, v_pool, bar = mx.array(pool_k).astype(dtype), mx.array(pool_v).astype(dtype), block_kernel.barrier(Hk)
    args = [mx.array(a).astype(dtype) for a in (x.reshape(1, 1, width), w_qkv, b_qkv, n1, w_o, n2, w_gu, w_down)]
    assert block_kernel.fits(width, inter, H, Hk, D, dtype, len(table))
    for _ in range(2):  # (the second launch starts from the barrier's count as the first left it)
        out = block_kernel.block_step(
            args[0], args[1], args[2], (args[3], 1e-5), args[4], (args[5], 1e-5), args[6], args[7],
            mx.array([pos], dtype=mx.int32), inv_freq / np.pi, H, Hk, D, False, D**-0.5,
            (k_pool, v_pool, mx.array(table[-1:])), mx.array(table[None]), mx.array([pos + 1]), bar)[0]
        mx.eval(out, k_pool, v_pool)
    tol = 1e-4 if dtype == mx.float32 else 3e-2
    assert relative_error(out.reshape(-1), mx.array(want)) < tol
    assert relative_error(k_pool, mx.array(want_k)) < tol and relative_error(v_pool, mx.array(want_v)) < tol
    assert int(bar[2].item()) == 0


@cuda
@pytest.mark.parametrize("attn_split, preload", [(0, 0), (1, 1)])
def test_one_row_steps_through_the_block_kernel_on_cuda(attn_split, preload, monkeypatch):
    """The runner's one-row steps with execute.block_kernel on a CUDA GPU (run with
    MLX_ENABLE_TF32=0): the family's greedy tokens (attn_split: the attention phase split
    over blocks, 2 positions each at least; preload: each phase's first loads before its
    barrier, where the registers allow it: not in this float32 model)."""
    monkeypatch.setattr(block_kernel, "ATTN_SPLIT", attn_split)
    monkeypatch.setattr(block_kernel, "PRELOAD", preload)
    monkeypatch.setattr(block_kernel, "ATTN_MIN_POSITIONS", 2)
    pool_writes_case(monkeypatch, emulate=False, one_kernel=True)


@cuda
@pytest.mark.parametrize("fused", [True, False])
def test_decode_steps_write_the_pool_in_place_on_cuda(fused, monkeypatch):
    """The same on a CUDA GPU, where MLX orders the attention after the write only
    through q (fused) or `after` (run with MLX_ENABLE_TF32=0). On an H200 the unfused case
    with the attention ordered through `mx.depends` instead failed: the tokens one step
    late."""
    pool_writes_case(monkeypatch, emulate=False, fused=fused)


@cuda
@pytest.mark.parametrize("dtype", [mx.float32, mx.bfloat16])
@pytest.mark.parametrize("kernel_norm, kernel_rope", [(1, 1), (0, 1), (0, 0), (2, 1)])
def test_fused_blocks_on_cuda_give_the_familys_logits(dtype, kernel_norm, kernel_rope, monkeypatch):
    monkeypatch.setattr(blocks, "KERNEL_NORM", kernel_norm)
    monkeypatch.setattr(blocks, "KERNEL_ROPE", kernel_rope)
    model = tiny("llama", hidden_size=512, intermediate_size=1024, num_attention_heads=8, num_key_value_heads=2)
    model.set_dtype(dtype)
    want = decode_logits(model, [5, 9, 11, 40], 3)
    fuse_projections(model)
    assert blocks.fuse_decode_blocks(model) == 2  # the kernels: CUDA is the default device
    got = decode_logits(model, [5, 9, 11, 40], 3)
    assert blocks.fused_steps(model) == 2 * 3
    for a, b in zip(got, want, strict=True):
        assert relative_error(mx.array(a), mx.array(b)) < (1e-4 if dtype == mx.float32 else 3e-2)


def test_blocks_the_steps_do_not_take_stay_as_they_are():
    model = tiny("llama")
    assert blocks.fuse_decode_blocks(model, use_kernel=False) == 0  # q/k/v not fused
    model = tiny("llama", rope_scaling={"type": "dynamic", "factor": 2.0})
    fuse_projections(model)
    assert blocks.fuse_decode_blocks(model, use_kernel=False) == 0  # a RoPE the kernel does not take
    assert type(model.layers[0]) is llama.TransformerBlock
    model = tiny("llama")
    model.layers[0].input_layernorm.weight = model.layers[0].input_layernorm.weight.astype(mx.bfloat16)
    fuse_projections(model)
    assert blocks.fuse_decode_blocks(model, use_kernel=False) == 0  # a norm in another dtype than the rows


def test_warps_per_output_pair():
    """More warps per pair while the grid is small and each lane keeps 4 chunks a row."""
    assert block_gemv.split_for(2048, 16384, mx.bfloat16) == 1  # 1,024 blocks already
    assert block_gemv.split_for(2048, 2048, mx.bfloat16) == 2  # 128 blocks -> 256, 4 chunks per lane each
    assert block_gemv.split_for(8192, 2048, mx.bfloat16) == 4  # 128 -> 512 blocks
    assert block_gemv.split_for(14336, 4096, mx.bfloat16) == 2  # 256 -> 512 blocks
    assert block_gemv.split_for(65536, 32, mx.bfloat16) == 8  # at most WARPS
    assert block_gemv.split_for(64, 48, mx.float32) == 1  # 16 chunks: fewer than one per lane


# what the fused steps repeat of each family's code, statement by statement
FAMILY_CODE = {
    "TransformerBlock": ["r = self.self_attn(self.input_layernorm(x), mask, cache)", "h = x + r",
                         "r = self.mlp(self.post_attention_layernorm(h))", "out = h + r", "return out"],
    "MLP": ["return self.down_proj(swiglu(self.gate_proj(x), self.up_proj(x)))"],
    "Attention": [
        "B, L, D = x.shape", "queries, keys, values = self.q_proj(x), self.k_proj(x), self.v_proj(x)",
        "queries = queries.reshape(B, L, self.n_heads, -1).transpose(0, 2, 1, 3)",
        "keys = keys.reshape(B, L, self.n_kv_heads, -1).transpose(0, 2, 1, 3)",
        "values = values.reshape(B, L, self.n_kv_heads, -1).transpose(0, 2, 1, 3)",
        "if cache is not None:", "queries = self.rope(queries, offset=cache.offset)",
        "keys = self.rope(keys, offset=cache.offset)", "keys, values = cache.update_and_fetch(keys, values)",
        "else:", "queries = self.rope(queries)", "keys = self.rope(keys)",
        "output = scaled_dot_product_attention(", "queries, keys, values, cache=cache, scale=self.scale, mask=mask",
        ")", "output = output.transpose(0, 2, 1, 3).reshape(B, L, -1)", "return self.o_proj(output)"],
}


@pytest.mark.parametrize("module", sorted({m for m, _ in blocks.BLOCKS}))
@pytest.mark.parametrize("name", sorted(FAMILY_CODE))
def test_mlx_lms_code_is_still_what_the_fused_steps_repeat(module, name):
    """If mlx-lm changes one of these, the family must leave BLOCKS until the fused
    steps follow."""
    source = inspect.getsource(getattr(importlib.import_module(module), name).__call__)
    body = source.split(":\n", 1)[1] if name == "MLP" else source.split(") -> mx.array:", 1)[1]
    lines = [line.strip() for line in body.splitlines() if line.strip() and not line.strip().startswith("#")]
    assert lines == FAMILY_CODE[name]


def test_the_phase_timeline_reads_the_blocks_clocks_across_a_wrap():
    """tools/probe/probe_block_phases.timeline: per phase the first and last block to stage its
    input and to end its work, and the last to leave its barrier, in us from the first
    block's start, medians over layers; the clocks' low 32 bits may wrap mid-kernel."""
    from tools.probe.probe_block_phases import timeline

    base = (1 << 32) - 5_000  # 5 us before the low 32 bits wrap
    # two blocks, two phases: start, then (staged, work done, left) per phase, in ns
    block0 = [0, 1_000, 4_000, 6_000, 6_500, 9_000, 12_000]
    block1 = [500, 2_000, 5_000, 6_000, 6_200, 10_000, 11_000]
    layer = (np.array([block0, block1], dtype=np.int64) + base) % (1 << 32)
    later = layer.copy()
    later[1, 5] += 2_000  # a second layer whose last block ends phase 1's work later
    (p0, p1) = timeline([layer, later, layer])
    assert (p0["staged_first"], p0["staged_last"], p0["work_first"], p0["work_last"], p0["left"]) == (1, 2, 4, 5, 6)
    assert (p1["staged_first"], p1["staged_last"], p1["work_first"], p1["work_last"], p1["left"]) == (6.2, 6.5, 9, 10, 12)


def test_a_prompt_chunks_pool_write_reads_no_strides():
    """The write kernel for more than one token a row reads its inputs packed, so unikern
    builds it into a cubin kept on disk (kernel_cache.Builder); a text that reads strides
    goes through MLX's compiler in every process (on an H200 the warm-up's 112 such
    launches made a warm start 2.2 s longer), which a decode step's views keep to."""
    from unikern.platform import cuda_build
    from unikern.stages.execute.cuda import pool_write, sources

    text = sources.text("pool_write.cu")
    packed = sources.fill(text, AT=pool_write.PACKED_AT)
    strided = sources.fill(text, AT=pool_write.STRIDED_AT)
    assert not any(cuda_build.reads(packed, name, "strides") for name in ("keys", "values"))
    assert cuda_build.reads(strided, "keys", "strides")
