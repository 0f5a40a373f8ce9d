"""The decode step's RoPE split into launches MLX's CUDA RoPE takes (stages/execute/ropes.py):
the same values as one call, in parts of at most MAX_ROW_HEADS rows x heads, each with its
rows' offsets; other shapes untouched; the fused blocks still read a split RoPE's angles."""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from mlx_lm.models.rope_utils import Llama3RoPE

from unikern.stages.execute import blocks, ropes


def counted(monkeypatch) -> list[tuple[int, ...]]:
    """The shapes mx.fast.rope is called with, from here on."""
    shapes, rope = [], mx.fast.rope
    monkeypatch.setattr(mx.fast, "rope", lambda x, *a, **k: shapes.append(tuple(x.shape)) or rope(x, *a, **k))
    return shapes


def llama3(dims: int) -> Llama3RoPE:
    return Llama3RoPE(dims, max_position_embeddings=2048, base=500000.0,
                      scaling_config={"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                      "original_max_position_embeddings": 512})


@pytest.mark.parametrize("make", [lambda: nn.RoPE(16, base=1e6), lambda: nn.RoPE(16, traditional=True), lambda: llama3(16)])
@pytest.mark.parametrize("per_row", [True, False])
def test_a_many_row_step_is_split_and_gives_the_same_values(make, per_row, monkeypatch):
    x = mx.random.normal((64, 8, 1, 16), key=mx.random.key(1)).astype(mx.bfloat16)
    offset = mx.arange(100, 164, dtype=mx.int32) if per_row else 37
    rope = make()
    # the reference a row at a time: the whole step in one call is the launch that fails on CUDA
    want = mx.concatenate([rope(x[i:i + 1], offset=offset[i:i + 1] if per_row else offset) for i in range(64)])
    rope.__class__ = ropes.split_class(type(rope))
    shapes = counted(monkeypatch)
    got = rope(x, offset=offset)
    assert shapes == [(32, 8, 1, 16)] * 2  # 256 rows x heads a launch
    np.testing.assert_array_equal(np.array(got.astype(mx.float32)), np.array(want.astype(mx.float32)))


@pytest.mark.parametrize("shape", [(32, 8, 1, 16),  # 256 rows x heads: one launch
                                   (1, 512, 1, 16),  # one row
                                   (64, 8, 3, 16),  # several tokens a row
                                   (64, 8, 1, 32)])  # a head of 32
def test_other_steps_go_through_in_one_call(shape, monkeypatch):
    rope = nn.RoPE(shape[-1])
    rope.__class__ = ropes.split_class(nn.RoPE)
    shapes = counted(monkeypatch)
    rope(mx.zeros(shape), offset=3)
    assert shapes == [shape]


def test_routing_takes_small_heads_rope_only_and_the_blocks_still_read_its_angles():
    from mlx_lm.models import llama

    def model(head_dim):
        return llama.Model(llama.ModelArgs(model_type="llama", hidden_size=4 * head_dim, num_hidden_layers=2,
                                           intermediate_size=64, num_attention_heads=4, num_key_value_heads=2,
                                           rms_norm_eps=1e-5, vocab_size=97, rope_theta=10000.0))

    small, large = model(16), model(64)
    want = blocks.inverse_frequencies(small.layers[0].self_attn.rope, 16)
    assert ropes.route_ropes(small) == 2 and ropes.route_ropes(small) == 0  # (once)
    assert ropes.route_ropes(large) == 0
    rope = small.layers[0].self_attn.rope
    assert isinstance(rope, nn.RoPE) and ropes.rope_class(rope) is nn.RoPE
    got = blocks.inverse_frequencies(rope, 16)
    assert got is not None and got[1] == want[1]
    np.testing.assert_array_equal(np.array(got[0]), np.array(want[0]))
    x = mx.random.normal((64, 4, 1, 16))
    np.testing.assert_array_equal(np.array(rope(x, offset=5)), np.array(mx.fast.rope(x, 16, traditional=False,
                                                                                     base=10000.0, scale=1.0, offset=5)))
