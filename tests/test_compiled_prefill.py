"""The traced prefill (execute.compile_prefill): fresh prompts' forwards through one
`mx.compile`d function per length bucket give the tokens and pool contents the forward
built op by op gives (mlx-lm's greedy tokens through the engine: test_compiled_decode.py).
On the CPU backend it runs only when asked, with the CPU kernels off, which is how these
tests reach it."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from tests.test_prefill_layout import greedy
from unikern.stages.execute.layouts import ZERO_BLOCK
from unikern.stages.execute.model import ModelGeometry
from unikern.stages.execute.runner import ModelRunner
from unikern.stages.kv.pool import KVPool


def runner_for(path: str, compile_prefill: bool = True) -> ModelRunner:
    from mlx_lm import load

    model, _ = load(path)
    geo = ModelGeometry(model)
    pool = KVPool(num_layers=geo.num_layers, num_kv_heads=geo.num_kv_heads, head_dim=geo.head_dim,
                  dtype=geo.dtype, block_size=16, kernel_block_size=16, num_blocks=64, slab_blocks=64)
    return ModelRunner(model, pool, compile_decode=True, compile_prefill=compile_prefill)


def written(runner: ModelRunner, slots: np.ndarray) -> list[np.ndarray]:
    """Every layer's keys and values at `slots` (float32)."""
    mx.eval(runner.pool.keys, runner.pool.values)
    return [np.array(a[:, mx.array(slots)].astype(mx.float32)) for a in runner.pool.keys + runner.pool.values]


@pytest.mark.parametrize("family", ["tiny-llama", "tiny-qwen2"])  # float32 untied; bfloat16 tied
def test_traced_prefill_writes_and_samples_what_the_ops_do(family, model_dir):
    """One prompt, then two of different lengths in one padded forward (rows 37 and 30
    tokens: bucket 48): the same first tokens and the same keys and values at every
    prompt position as the forward built op by op, the padding in the scratch block; one
    trace per (rows, bucket), the second prompt of the same bucket replayed."""
    path = model_dir(family)
    tables = {"a": tuple(range(2, 6)), "b": tuple(range(9, 5, -1))}  # b's blocks not in order
    prompts = {"a": tuple((7 * j) % 900 + 5 for j in range(37)), "b": tuple((11 * j) % 900 + 3 for j in range(30))}
    slots = np.concatenate([np.arange(2 * 16, 2 * 16 + 37),
                            (np.array(tables["b"])[:, None] * 16 + np.arange(16)).reshape(-1)[:30]])
    traced, plain = runner_for(path), runner_for(path, compile_prefill=False)
    assert traced.compiled_prefill is not None and plain.compiled_prefill is None
    results = []
    for runner in (traced, plain):
        one = greedy(runner, {"a": prompts["a"]}, tables, steps=0)
        assert greedy(runner, {"a": prompts["a"][:33]}, tables, steps=0)  # bucket 48 again
        assert greedy(runner, {"a": prompts["a"]}, tables, steps=0) == one
        results.append((one, greedy(runner, prompts, tables, steps=0), written(runner, slots)))
    assert traced.compiled_prefill.traces == 2 and traced.compiled_prefill.forwards == 4
    (one, both, pool), (want_one, want_both, want_pool) = results
    assert one == want_one and both == want_both
    tol = 1e-5 if traced.pool.dtype == mx.float32 else 1e-2
    for got, want in zip(pool, want_pool, strict=True):
        np.testing.assert_allclose(got, want, rtol=tol, atol=tol)
    # the padded positions went to the scratch block: the zero block, which masked reads
    # take, is still zeros
    assert not any(a.any() for a in written(traced, np.arange(ZERO_BLOCK * 16, ZERO_BLOCK * 16 + 16)))


def test_prompts_past_the_start_or_the_bound_run_op_by_op(tiny_llama, monkeypatch):
    """A prompt's second chunk (start > 0: it reads the pool), a one-token forward and
    forwards of more than max_tokens take the op-by-op forward: no trace."""
    from unikern.stages.execute.compiled import CompiledPrefill

    monkeypatch.setattr(CompiledPrefill, "max_tokens", 64)
    runner = runner_for(tiny_llama)
    tables = {"a": tuple(range(2, 10)), "b": tuple(range(10, 18))}
    long = tuple(range(5, 105))  # 100 tokens: bucket 112 > 64
    greedy(runner, {"a": long}, tables, steps=0)
    greedy(runner, {"a": (9,)}, tables, steps=0)
    greedy(runner, {"a": long + long[:20]}, tables, start=100, steps=0)
    assert runner.compiled_prefill.traces == 0 and runner.compiled_prefill.forwards == 0
    greedy(runner, {"a": long[:40], "b": long[:40]}, tables, steps=0)  # 2 x 48 > 64
    assert runner.compiled_prefill.forwards == 0
    greedy(runner, {"a": long[:40]}, tables, steps=0)
    assert runner.compiled_prefill.forwards == 1


def test_auto_traces_the_prefill_of_unquantized_models_where_the_decode_is_traced():
    """ranks.traces_prefill: "auto" with the traced decode on an unquantized model only
    (4-bit models were not measured with it), "always" and "never" whatever the model."""
    import mlx.nn as nn

    from unikern.stages.execute.ranks import traces_prefill

    model = nn.Sequential(nn.Linear(64, 64), nn.RMSNorm(64))
    assert traces_prefill("auto", True, model) and not traces_prefill("auto", False, model)
    nn.quantize(model, group_size=32, bits=4)
    assert not traces_prefill("auto", True, model)
    assert traces_prefill("always", False, model) and not traces_prefill("never", True, model)
