"""needs_zeroing: attention KV may start from any bytes; recurrent state must be zero."""

from __future__ import annotations

import mlx.core as mx
from mlx_lm.models import mamba
from mlx_lm.models.cache import ArraysCache, KVCache, QuantizedKVCache

from unikern.stages.kv.cache_kinds import needs_zeroing, new_state


def tiny_mamba():
    args = mamba.ModelArgs(
        model_type="mamba", vocab_size=64, hidden_size=32, intermediate_size=64, state_size=8,
        num_hidden_layers=2, conv_kernel=4, use_bias=False, use_conv_bias=True, time_step_rank=4,
    )
    mx.random.seed(0)
    model = mamba.Model(args)
    mx.eval(model.parameters())
    return model


def test_policy_per_kind():
    assert not needs_zeroing(KVCache())
    assert needs_zeroing(ArraysCache(size=2))
    assert needs_zeroing(QuantizedKVCache())
    assert needs_zeroing("SomeFutureCache")  # unknown kinds are zeroed, to be safe


def test_recurrent_state_must_start_at_zero():
    """The SSM side: a state that does not start at zero changes the output, and the
    zeroed allocation reproduces a fresh cache exactly."""
    model = tiny_mamba()
    tokens = mx.array([[3, 5, 7, 11]])
    fresh = model.make_cache()
    reference = model(tokens, cache=fresh)
    shapes = [[s.shape for s in c.cache] for c in fresh]
    dtypes = [[s.dtype for s in c.cache] for c in fresh]

    def prefilled(fill):
        caches = model.make_cache()
        for c, layer_shapes, layer_dtypes in zip(caches, shapes, dtypes, strict=True):
            for i, (shape, dtype) in enumerate(zip(layer_shapes, layer_dtypes, strict=True)):
                c[i] = new_state(shape, dtype, c, fill)
        return caches

    zeroed = model(tokens, cache=prefilled(float("nan")))  # ArraysCache: fill is ignored
    assert mx.array_equal(zeroed, reference)
    garbage = model.make_cache()
    for c, layer_shapes, layer_dtypes in zip(garbage, shapes, dtypes, strict=True):
        for i, (shape, dtype) in enumerate(zip(layer_shapes, layer_dtypes, strict=True)):
            c[i] = mx.full(shape, 0.5, dtype=dtype)
    assert not mx.allclose(model(tokens, cache=garbage), reference)


def test_attention_pool_takes_the_fill_it_is_given():
    """The attention side keeps whatever bytes it gets (here NaN); masking, not zeroing,
    keeps them out of outputs (tests/test_parity.py::test_unwritten_slots_never_reach_output)."""
    pool_slab = new_state((2, 8, 4), mx.float32, "KVCache", float("nan"))
    assert bool(mx.isnan(pool_slab).all())


def test_recurrent_layers_get_zeroed_state_slots():
    """The paged pool serves recurrent models through state slots (stages/kv/state_pool.py),
    allocated zeroed as needs_zeroing asks; attention KV stays masked, not zeroed."""
    from unikern.stages.execute.model import ModelGeometry
    from unikern.stages.kv.state_pool import StatePool

    geometry = ModelGeometry(tiny_mamba(), "mamba")
    assert [s.kind for s in geometry.layers] == ["state", "state"] and geometry.has_state
    pool = StatePool([s.state for s in geometry.layers])
    pool.ensure_capacity(3)
    assert all(not bool(mx.any(a)) for arrays in pool.arrays for a in arrays)
