"""The pool write kernel's markers are evaluated with the pool. The kernel
(cuda/pool_write.py) writes the pool arrays in place, which MLX does not see: it runs
only when something evaluated takes its marker. A prompt's chunk that samples nothing
evaluates none of its forward's outputs, so the runner evaluates the markers with the
pool arrays (runner._written), and the traced prefill returns them as outputs (its pool
arrays come back as its very inputs). Without that a chunk's keys and values never reach
the pool, and the prompt's next chunk and later prefix hits read what was there before:
tests/test_partial_prefix.py, whose first request's 512-token chunk goes through the
traced prefill and samples nothing, failed on an H100 at a margin of 0.40 (before this
was found; the GPU has not run it since)."""

from __future__ import annotations

import mlx.core as mx

from tests import cuda_emulation
from tests.test_decode_blocks import emulation, greedy, paged_runner, tiny


def kernel_mode(monkeypatch) -> None:
    """The runner in the paged attention's kernel mode, as on CUDA, with the write kernel
    on and unikern's row kernel off (MLX's gathers)."""
    from unikern.stages.execute import layouts, paged_cache
    from unikern.stages.execute import runner as runner_module

    monkeypatch.setattr(paged_cache, "WRITE_IN_PLACE", True)
    monkeypatch.setattr(paged_cache, "ROW_KERNEL", False)
    monkeypatch.setattr(runner_module, "cuda_is_default", lambda: True)
    monkeypatch.setattr(layouts, "cuda_is_default", lambda: False)  # MLX's ops for the step layout


@emulation
def test_a_chunk_that_samples_nothing_still_writes_the_pool(monkeypatch):
    """A 12-token chunk that samples nothing, over blocks that are not consecutive (so
    the forward gathers and writes by slots, not slices), then the prompt's last 8
    tokens: the write kernel emulated as a GPU runs it (tests/cuda_emulation.LazyWrites)
    loses none of the first chunk's writes, and the last chunk gives mlx-lm's token."""
    from unikern import messages as m
    from unikern.stages.execute.cuda import paged_attention, pool_write

    kernel_mode(monkeypatch)
    writes = cuda_emulation.LazyWrites()
    monkeypatch.setattr(pool_write, "cuda_kernel", writes)
    monkeypatch.setattr(paged_attention, "cuda_kernel", cuda_emulation.emulated_cuda_kernels())
    model = tiny("llama", hidden_size=128, intermediate_size=96)  # head_dim 32
    prompt = [(7 * j) % 90 + 3 for j in range(20)]
    runner, geo = paged_runner(model)
    assert runner.paged == "kernel"
    table = (5, 2, 9, 3, 7)  # 4-slot blocks, none consecutive
    params = m.SamplingParams(max_tokens=4)
    runner.run(m.Step(0, (m.SeqWork("a", tuple(prompt[:12]), 0, table, False, params),), 1), {})
    assert writes.settle() == 0
    got = runner.run(m.Step(1, (m.SeqWork("a", tuple(prompt[12:]), 12, table, True, params),), 1), {})
    assert writes.settle() == 0
    assert got == {"a": greedy(model, prompt, 1)}


def test_the_traced_prefill_hands_back_its_write_markers(monkeypatch):
    """A fresh prompt's chunk that samples nothing, through the traced prefill: every
    layer's write marker comes out of the traced function and is evaluated with the pool
    (a stand-in for the kernel computes its marker from the keys with MLX's ops: the
    emulation cannot run inside a trace)."""
    from unikern import messages as m
    from unikern.stages.execute import paged_cache
    from unikern.stages.execute.runner import ModelRunner

    kernel_mode(monkeypatch)

    def write(keys, values, pool_k, pool_v, slots):
        return keys.reshape(-1)[:4] * 0 + values.reshape(-1)[:4] * 0 + 1

    monkeypatch.setattr(paged_cache, "pool_writer", lambda paged: write if paged == "kernel" else None)
    model = tiny("llama", hidden_size=128, intermediate_size=96)
    plain, geo = paged_runner(model)
    runner = ModelRunner(model, plain.pool, paged_attention=True, geometry=geo, compile_decode=True,
                         compile_prefill=True)
    assert runner.paged == "kernel" and runner.compiled_prefill is not None
    params = m.SamplingParams(max_tokens=4)
    prompt = tuple((5 * j) % 90 + 2 for j in range(12))
    runner.run(m.Step(0, (m.SeqWork("a", prompt, 0, (5, 2, 9), False, params),), 1), {})
    assert runner.compiled_prefill.forwards == 1
    markers = list(runner._writes)
    assert len(markers) == geo.num_layers
    assert all(cuda_emulation.evaluated(a) for a in markers)
    mx.eval(markers)
