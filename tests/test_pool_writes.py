"""Keys and values into the paged pool by unikern's kernels where the paged attention kernel
reads them back (CUDA): a decode step's from the fused block's q/k/v kernel, the 4-bit GEMV
or the write kernel; a prompt's chunks and a prefix hit's copies by the write kernel; the
embedding's lookup and the pool's reads by the row kernel. Through a runner with the
kernels in the CPU emulation (tests/cuda_emulation.py), and on a CUDA GPU: the family's
greedy tokens and no scatter. Split from tests/test_decode_blocks.py, whose helpers these
use, so that the two long files run on both test workers."""

import mlx.core as mx
import mlx.nn as nn
import pytest

from tests import cuda_emulation
from tests.test_decode_blocks import greedy, tiny
from unikern.platform import cuda_is_default
from unikern.stages.execute import blocks
from unikern.stages.execute.cuda import block_gemv, block_kernel
from unikern.stages.execute.fused import fuse_projections

emulation = pytest.mark.skipif(not cuda_emulation.available(), reason="the emulation needs g++ (C++20)")
cuda = pytest.mark.skipif(not cuda_is_default(), reason="the kernels run on a CUDA GPU")


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
        # fewer warps per block: each emulated CUDA thread is an OS thread (the kernels take any count)
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
    # head_dim 32; the 4-bit case smaller (each emulated CUDA thread is an OS thread)
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


@cuda
def test_quantized_blocks_rotate_and_write_the_pool_inside_the_gemv_on_cuda(monkeypatch):
    """The same on a CUDA GPU (run with MLX_ENABLE_TF32=0): the family's greedy tokens."""
    pool_writes_case(monkeypatch, emulate=False, fused=True, bits=4)


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
