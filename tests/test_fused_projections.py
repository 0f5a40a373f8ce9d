"""q/k/v and gate/up projections through one concatenated weight (stages/execute/fused.py):
the same outputs as the separate layers, one matmul per group, and a correct result in a
family that does not pass each projection the layer's own input."""

import mlx.core as mx
import mlx.nn as nn
import pytest
from mlx.utils import tree_flatten
from mlx_lm import load
from mlx_lm.models.cache import make_prompt_cache

from unikern.platform import cuda_is_default
from unikern.stages.execute import cpu_kernels
from unikern.stages.execute.fused import HandedProjection, fallback_calls, fuse_projections
from unikern.stages.execute.quantized import route_quantized_layers
from unikern.stages.execute.ranks import fuses_quantized
from unikern.testing.modelgen import cached_model

TOKENS = mx.array([[5, 6, 7, 8, 9, 10, 11, 12], [13, 14, 15, 16, 17, 18, 19, 20]])


def logits(model):
    return model(TOKENS, cache=make_prompt_cache(model))


@pytest.mark.parametrize("bits", [None, 4])
def test_a_fused_model_gives_the_separate_layers_outputs(bits):
    path = str(cached_model("llama-5m"))
    plain, _ = load(path)
    fused, _ = load(path)
    if bits:
        nn.quantize(plain, group_size=32, bits=bits)
        nn.quantize(fused, group_size=32, bits=bits)
    before = sum(v.size for _, v in tree_flatten(fused.parameters()))
    layers = len(fused.model.layers)
    assert fuse_projections(fused) == 2 * layers
    names = [k for k, _ in tree_flatten(fused.parameters())]
    assert not any(".q_proj." in n or ".gate_proj." in n for n in names)  # the separate weights are gone
    assert sum(".fused_q_proj.weight" in n for n in names) == layers
    assert sum(v.size for _, v in tree_flatten(fused.parameters())) == before
    if bits:  # the fused layers are plain quantized layers: the row routing reaches them
        assert route_quantized_layers(fused, 8) == 4 * layers + 1  # qkv, o, gate|up, down; lm_head
        route_quantized_layers(plain, 8)
    assert mx.allclose(logits(fused), logits(plain), rtol=1e-5, atol=1e-5)
    assert fallback_calls(fused) == 0
    one_row = mx.array([[5]])
    assert mx.allclose(fused(one_row, cache=make_prompt_cache(fused)), plain(one_row, cache=make_prompt_cache(plain)),
                       rtol=1e-5, atol=1e-5)


class Counting(nn.Module):
    def __init__(self, inner):
        super().__init__()
        self.inner = inner
        self.__dict__["calls"] = 0

    def __call__(self, x):
        self.__dict__["calls"] += 1
        return self.inner(x)


def test_one_matmul_per_group():
    """Each layer multiplies its input once for q, k and v and once for gate and up."""
    model, _ = load(str(cached_model("llama-5m")))
    fuse_projections(model)
    counters = []
    for layer in model.model.layers:
        for owner, name in ((layer.self_attn, "fused_q_proj"), (layer.mlp, "fused_gate_proj")):
            owner[name] = Counting(owner[name])
            counters.append(owner[name])
    model(TOKENS, cache=make_prompt_cache(model))
    assert [c.calls for c in counters] == [1] * 2 * len(model.model.layers)
    assert isinstance(model.model.layers[0].self_attn.k_proj, HandedProjection) and fallback_calls(model) == 0


class ScaledKeys(nn.Module):
    """An attention-like module that feeds k_proj another input than q_proj's."""

    def __init__(self):
        super().__init__()
        self.q_proj = nn.Linear(64, 64)
        self.k_proj = nn.Linear(64, 32)
        self.v_proj = nn.Linear(64, 32)

    def __call__(self, x):
        return mx.concatenate([self.q_proj(x), self.k_proj(2 * x), self.v_proj(x)], axis=-1)


@pytest.mark.parametrize("bits", [None, 4])
def test_a_projection_called_on_another_input_computes_its_own_rows(bits):
    mx.random.seed(3)
    module = ScaledKeys()
    if bits:
        nn.quantize(module, group_size=32, bits=bits)
    x = mx.random.normal((3, 64))
    expected = module(x)
    assert fuse_projections(module) == 1
    assert mx.allclose(module(x), expected, rtol=1e-5, atol=1e-5)
    assert fallback_calls(module) == 1  # k_proj's, counted for stats
    assert mx.allclose(module(x), expected, rtol=1e-5, atol=1e-5)  # nothing handed outlives a call
    assert fallback_calls(module) == 2


def test_layers_that_cannot_be_joined_stay_separate():
    class Mixed(nn.Module):
        def __init__(self):
            super().__init__()
            self.gate_proj = nn.Linear(16, 32)
            self.up_proj = nn.Linear(16, 32, bias=False)  # one with a bias, one without

    module = Mixed()
    assert fuse_projections(module) == 0 and isinstance(module.gate_proj, nn.Linear)


def test_the_cpu_swiglu_runs_on_the_fused_halves():
    """The CPU kernels' in-place SwiGLU keeps a fused MLP's one matmul and activates the
    two halves of its output (a step large enough to take the PyTorch path)."""
    path = str(cached_model("llama-5m"))
    model, _ = load(path)
    mlp = model.model.layers[0].mlp
    hidden = model.args.hidden_size
    x = mx.random.normal((1, 64, hidden), key=mx.random.key(1))
    expected = mlp(x)
    fuse_projections(model)
    fast = cpu_kernels.SwiGLU(mlp)
    assert "fused_gate_proj" in fast and x.shape[1] * model.args.intermediate_size >= cpu_kernels.MIN_ELEMENTS
    assert mx.allclose(fast(x), expected, rtol=1e-5, atol=1e-5)


def test_quantized_layers_stay_separate_unless_asked():
    """fuse_projections joins quantized layers only when asked (execute.fuse_projections
    "always", or "auto" where unikern's 4-bit kernels run them: below)."""
    model, _ = load(str(cached_model("llama-5m")))
    nn.quantize(model, group_size=32, bits=4)
    assert fuse_projections(model, quantized=False) == 0
    assert fuse_projections(model, quantized=True) == 2 * len(model.model.layers)


def test_auto_fuses_quantized_layers_where_unikerns_kernels_run_them():
    assert fuses_quantized("always", own_kernels=False) and fuses_quantized("auto", own_kernels=True)
    assert not fuses_quantized("auto", own_kernels=False) and not fuses_quantized("never", own_kernels=True)


@pytest.mark.parametrize("rows", [1, 9, 70])
def test_fused_quantized_layers_give_the_separate_layers_logits_through_the_routed_kernels(rows):
    """Joined 4-bit projections, routed as the engine routes them (unikern's GEMV and
    tensor-core kernels on CUDA, MLX's quantized kernel or dequantized weights elsewhere),
    give the logits of the separate layers."""
    cuda = cuda_is_default()
    separate, _ = load(str(cached_model("llama-5m")))
    nn.quantize(separate, group_size=32, bits=4)
    joined, _ = load(str(cached_model("llama-5m")))
    nn.quantize(joined, group_size=32, bits=4)
    assert fuse_projections(joined, quantized=True) == 2 * len(joined.model.layers)
    for model in (separate, joined):
        route_quantized_layers(model, 65 if cuda else 8, gemv=cuda, mma=cuda)
    tokens = mx.array([[(5 * j) % 200 + 3 for j in range(rows)]])
    want = separate(tokens, cache=make_prompt_cache(separate)).astype(mx.float32)
    got = joined(tokens, cache=make_prompt_cache(joined)).astype(mx.float32)
    assert fallback_calls(joined) == 0
    assert mx.allclose(got, want, rtol=1e-3, atol=1e-3 * float(mx.abs(want).max())).item()
