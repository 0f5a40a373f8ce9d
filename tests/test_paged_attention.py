"""Decode attention read straight from the paged pool (stages/execute/cuda/paged_attention.py):
the MLX-ops reference against a softmax written out here, the CUDA kernels' own source
against it in a thread-per-lane emulation on the CPU (tests/cuda_emulation.py) and on a
CUDA machine against the reference, and a one-row request through a traced step."""

import mlx.core as mx
import numpy as np
import pytest

import unikern
from tests import cuda_emulation
from tests.conftest import compare_greedy, reference_greedy
from unikern.platform import cuda_is_default
from unikern.platform.kernel_cache import float_bits
from unikern.stages.execute.cuda import paged_attention, pool_write


def case(B, H, Hk, D, S, L, dtype, seed=0):
    rng = np.random.default_rng(seed)
    q = rng.standard_normal((B, H, 1, D)).astype(np.float32)
    pool_k = rng.standard_normal((Hk, S, D)).astype(np.float32)
    pool_v = rng.standard_normal((Hk, S, D)).astype(np.float32)
    slots = np.stack([rng.permutation(S)[:L] for _ in range(B)]).astype(np.int32)  # scattered blocks
    lengths = rng.integers(1, L + 1, size=B).astype(np.int32)
    lengths[0] = L
    arrays = [mx.array(a).astype(dtype) for a in (q, pool_k, pool_v)]
    return (q, pool_k, pool_v, slots, lengths), (*arrays, mx.array(slots), mx.array(lengths))


def expected(q, pool_k, pool_v, slots, lengths, scale):
    B, H, _, D = q.shape
    group = H // pool_k.shape[0]
    out = np.zeros_like(q)
    for b in range(B):
        for h in range(H):
            idx = slots[b, : lengths[b]]
            k, v = pool_k[h // group, idx], pool_v[h // group, idx]
            s = k @ q[b, h, 0] * scale
            p = np.exp(s - s.max())
            out[b, h, 0] = (p / p.sum()) @ v
    return out


@pytest.mark.parametrize("shape", [(3, 8, 2, 32, 96, 40), (1, 4, 4, 64, 64, 17)])
def test_the_reference_is_softmax_attention_over_each_rows_slots(shape):
    B, H, Hk, D, S, L = shape
    host, dev = case(B, H, Hk, D, S, L, mx.float32)
    scale = D**-0.5
    got = paged_attention.reference(*dev, scale)
    np.testing.assert_allclose(np.array(got), expected(*host, scale), rtol=1e-4, atol=1e-5)


def emulate(B, H, Hk, D, P, host, scale):
    """decode()'s launches run in the emulation on case()'s host arrays: the kernel
    launch() picks, and with P > 1 the partial kernel's float32 partials through
    merge_launch()'s kernel."""
    q, pool_k, pool_v, slots, lengths = host
    inputs = {"q": q, "k_pool": pool_k, "v_pool": pool_v, "slots": slots, "lengths": lengths}
    name, source, constants, blocks = paged_attention.launch(B, H, Hk, D, P)
    constants = {**constants, "SCALE": float_bits(scale)}
    threads = constants["NW"] * 32
    if P == 1:
        return cuda_emulation.run_kernel(source, inputs, constants, blocks, threads, (B, H, 1, D))
    parts = cuda_emulation.run_kernel(source, inputs, constants, blocks, threads, (blocks, H // Hk, D + 2))
    source, constants, blocks, threads = paged_attention.merge_launch(B, H, Hk, D)
    return cuda_emulation.run_kernel(source, {"parts": parts}, constants, blocks, threads, (B, H, 1, D))


@pytest.mark.skipif(not cuda_emulation.available(), reason="the emulation needs g++ (C++20)")
@pytest.mark.parametrize("kernel", ["head", "group", "group-few-blocks"])
@pytest.mark.parametrize("shape", [(3, 8, 2, 64, 96, 40), (2, 4, 4, 128, 64, 17), (2, 8, 1, 32, 80, 70),
                                   (1, 4, 2, 32, 1200, 1100)])
def test_the_kernel_source_computes_the_attention_in_an_emulation(shape, kernel, monkeypatch):
    """Each CUDA kernel's source, run on the CPU with a thread per lane: the same outputs
    as the softmax written out above, for grouped and plain heads, short rows and rows of
    more positions than a block's warps take in one round of slot loads (32 per warp)."""
    B, H, Hk, D, S, L = shape
    monkeypatch.setattr(paged_attention, "KERNEL", kernel.removesuffix("-few-blocks"))
    monkeypatch.setattr(paged_attention, "FEW_BLOCKS", 1 << 30 if kernel.endswith("few-blocks") else 0)
    name, _, constants, _ = paged_attention.launch(B, H, Hk, D)
    assert name == kernel.removesuffix("-few-blocks")
    assert constants["NW"] == (paged_attention.FEW_BLOCKS_WARPS if kernel.endswith("few-blocks") else 8)
    host, _ = case(B, H, Hk, D, S, L, mx.float32, seed=D)
    scale = D**-0.5
    got = emulate(B, H, Hk, D, 1, host, scale)
    np.testing.assert_allclose(got, expected(*host, scale), rtol=1e-4, atol=1e-5)


@pytest.mark.skipif(not cuda_emulation.available(), reason="the emulation needs g++ (C++20)")
@pytest.mark.parametrize("U", [1, 3, 8])
@pytest.mark.parametrize("shape", [(3, 8, 2, 64, 96, 40), (1, 4, 2, 32, 1200, 1100)])
def test_the_group_kernel_takes_any_number_of_positions_in_flight(shape, U, monkeypatch):
    """POSITIONS_IN_FLIGHT: a warp loads U positions' keys and values before using any;
    rounds of slot loads whose count U does not divide leave a shorter last group."""
    B, H, Hk, D, S, L = shape
    monkeypatch.setattr(paged_attention, "POSITIONS_IN_FLIGHT", U)
    host, _ = case(B, H, Hk, D, S, L, mx.float32, seed=U)
    scale = D**-0.5
    assert paged_attention.launch(B, H, Hk, D)[2]["U"] == U
    got = emulate(B, H, Hk, D, 1, host, scale)
    np.testing.assert_allclose(got, expected(*host, scale), rtol=1e-4, atol=1e-5)


@pytest.mark.skipif(not cuda_emulation.available(), reason="the emulation needs g++ (C++20)")
@pytest.mark.parametrize("P", [2, 7])
@pytest.mark.parametrize("shape", [(3, 8, 2, 64, 96, 40), (1, 4, 2, 32, 1200, 1100), (2, 8, 1, 32, 80, 70)])
def test_the_split_kernels_compute_the_attention_in_an_emulation(shape, P):
    """The split (flash-decoding): each row's positions over P blocks, then the merge of
    their partials. Rows of every length, one of a single position (so some of its
    partitions hold none), the 16-warp shape for few blocks and the 8-warp one."""
    B, H, Hk, D, S, L = shape
    host, _ = case(B, H, Hk, D, S, L, mx.float32, seed=P)
    if B > 1:
        host[4][-1] = 1  # lengths: a row of one position
    scale = D**-0.5
    got = emulate(B, H, Hk, D, P, host, scale)
    np.testing.assert_allclose(got, expected(*host, scale), rtol=1e-4, atol=1e-5)


def test_rows_are_split_where_few_blocks_would_walk_long_tables():
    """partitions(): one row of a long table spreads over about SPLIT_BLOCKS blocks, no
    partition shorter than SPLIT_MIN_POSITIONS table positions; short tables and full
    batches stay whole; decode() splits only where the group kernel runs."""
    assert paged_attention.partitions(1, 8, 4000) == 4000 // paged_attention.SPLIT_MIN_POSITIONS
    assert paged_attention.partitions(1, 8, 1 << 16) == paged_attention.SPLIT_BLOCKS // 8
    assert paged_attention.partitions(1, 8, 192) == 1
    assert paged_attention.partitions(64, 8, 4000) == 1
    assert paged_attention.partitions(16, 8, 4000) == 2


@pytest.mark.skipif(not cuda_emulation.available(), reason="the emulation needs g++ (C++20)")
@pytest.mark.parametrize("L", [40, 600])
def test_decode_launches_the_split_and_its_merge(L, monkeypatch):
    """decode() as a CUDA machine runs it, each mx.fast.cuda_kernel launch run in the
    emulation instead: at a long table its own choice of partitions, grids and output
    shapes through the partial kernel and the merge; whole at a short one."""
    launched = []
    monkeypatch.setattr(paged_attention, "cuda_kernel", cuda_emulation.emulated_cuda_kernels(launched))
    monkeypatch.setattr(paged_attention, "SPLIT_MIN_POSITIONS", 128)
    B, H, Hk, D, S = 1, 8, 2, 32, 700
    host, dev = case(B, H, Hk, D, S, L, mx.float32, seed=L)
    got = paged_attention.decode(*dev, D**-0.5, use_kernel=True)
    P = paged_attention.partitions(B, Hk, L)
    assert P == (1 if L < 128 else L // 128)
    assert launched == (["unikern_paged_decode_group"] if P == 1 else
                        ["unikern_paged_decode_group_parts", "unikern_paged_decode_merge"])
    np.testing.assert_allclose(np.array(got), expected(*host, D**-0.5), rtol=1e-4, atol=1e-5)


@pytest.mark.skipif(not cuda_is_default(), reason="the kernel runs on a CUDA GPU")
@pytest.mark.parametrize("kernel", ["head", "group"])
@pytest.mark.parametrize("dtype", [mx.float32, mx.bfloat16])
@pytest.mark.parametrize("shape", [(5, 32, 8, 64, 700, 300), (1, 32, 8, 64, 256, 129), (3, 16, 16, 128, 512, 70),
                                   (64, 32, 8, 64, 2048, 128), (1, 32, 8, 64, 4096, 4000),
                                   (2, 32, 8, 128, 3000, 1500)])
def test_the_cuda_kernel_gives_the_reference(shape, dtype, kernel, monkeypatch):
    B, H, Hk, D, S, L = shape
    monkeypatch.setattr(paged_attention, "KERNEL", kernel)
    _, dev = case(B, H, Hk, D, S, L, dtype, seed=B)
    scale = D**-0.5
    got = paged_attention.decode(*dev, scale, use_kernel=True)
    want = paged_attention.reference(*dev, scale)
    tol = 1e-4 if dtype == mx.float32 else 2e-2
    np.testing.assert_allclose(np.array(got.astype(mx.float32)), np.array(want.astype(mx.float32)), rtol=tol,
                               atol=tol)


@pytest.mark.anyio
async def test_one_row_reads_the_pool_through_a_traced_step(tiny_llama, paged_decode_calls):
    """With the attention reading the pool itself, a lone request's decode windows are
    traced steps (compile_one_row) and give mlx-lm's tokens."""
    calls = paged_decode_calls
    prompt = list(range(5, 45))
    # with fused projections too, as on CUDA by default: the routing finds the family's SDPA
    # (no warm-up: on a GPU it would run a two-row window through the same decode)
    overrides = {"execute": {"paged_attention": "always", "compile_decode": "always", "compile_one_row": "always",
                             "fuse_projections": "always", "cpu_kernels": False, "warmup": "never"}}
    async with unikern.Engine.from_pipeline("generate", model=tiny_llama, overrides=overrides) as engine:
        result = await engine.complete(prompt_tokens=prompt, max_tokens=12)
        stats = engine.stats()
    assert stats["paged_attention"]["enabled"] and stats["paged_attention"]["one_row_compiled"]
    # MLX's ops on a CPU, the kernel on a CUDA GPU
    assert stats["paged_attention"]["mode"] == ("kernel" if cuda_is_default() else "reference")
    assert stats["compiled_decode"]["traces"] > 0 and calls and all(s[0] == 1 for s in calls)
    ok, note = compare_greedy(result.token_ids, reference_greedy(tiny_llama, prompt, 12))
    assert ok, note


@pytest.mark.parametrize("trad", [False, True])
@pytest.mark.parametrize("dtype", [mx.float32, mx.bfloat16])
def test_rope_write_rotates_q_and_k_and_writes_the_pool(trad, dtype, monkeypatch):
    """rope_write (the fused blocks' steps of more rows, blocks.OPS_ROPE_WRITE): q and k
    rotated as RoPE does for each row's position, q returned as [B, H, 1, D], k and v in
    the pool at the rows' slots and nothing else written; on a CUDA GPU, elsewhere its
    source in the emulation (float32 only)."""
    from tests.test_quantized_rows import rope_reference

    if not cuda_is_default():
        if dtype != mx.float32 or not cuda_emulation.available():
            pytest.skip("the emulation takes float32 and needs g++ (C++20)")
        monkeypatch.setattr(pool_write, "cuda_kernel", cuda_emulation.emulated_cuda_kernels())
    B, H, Hk, D = 5, 4, 2, 32
    rng = np.random.default_rng(int(trad))
    y = rng.standard_normal((B, (H + 2 * Hk) * D)).astype(np.float32)
    pos = np.array([0, 7, 300, 12, 5], dtype=np.int32)
    slots = np.array([9, 2, 14, 6, 11], dtype=np.int32)
    inv_freq = 1.0 / (10000.0 ** (np.arange(0, D, 2, dtype=np.float32) / D))
    k_pool, v_pool = mx.zeros((Hk, 16, D), dtype), mx.zeros((Hk, 16, D), dtype)
    mx.eval(k_pool, v_pool)
    ya = mx.array(y).astype(dtype)
    q = pool_write.rope_write(ya, mx.array(pos), mx.array(inv_freq / np.pi), H, D, trad,
                              (k_pool, v_pool, mx.array(slots)))
    mx.eval(q, k_pool, v_pool)
    want = rope_reference(np.array(ya.astype(mx.float32)), pos, inv_freq, H, Hk, D, trad)
    close = dict(rtol=2e-2, atol=2e-2) if dtype == mx.bfloat16 else dict(rtol=1e-4, atol=1e-4)
    f32 = lambda a: np.array(a.astype(mx.float32))  # noqa: E731
    assert q.shape == (B, H, 1, D)
    np.testing.assert_allclose(f32(q).reshape(B, -1), want[:, : H * D], **close)
    np.testing.assert_allclose(f32(k_pool)[:, slots].transpose(1, 0, 2).reshape(B, -1), want[:, H * D : (H + Hk) * D],
                               **close)
    np.testing.assert_allclose(f32(v_pool)[:, slots].transpose(1, 0, 2).reshape(B, -1), want[:, (H + Hk) * D :],
                               **close)
    assert not f32(k_pool)[:, np.setdiff1d(np.arange(16), slots)].any()
