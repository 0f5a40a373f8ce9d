"""PyTorch kernels where MLX's CPU backend is slow (it evaluates `exp` one element at a
time): the SwiGLU activation and the attention softmax, run in place on MLX's buffers
through zero-copy views, for float32 models (see README, "CPU kernels")."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import mlx.core as mx
import mlx.nn as nn
import structlog
from mlx_lm.models.activations import swiglu

from unikern.stages.execute.routing import layers_of, route_attention

if TYPE_CHECKING:
    from unikern.platform.bridge import Bridge

log = structlog.get_logger()

# below this many elements MLX's own op is cheaper than a synchronisation, and it keeps
# the step lazy so that decode lookahead still overlaps graph building with compute
MIN_ELEMENTS = 16384



def _bridge() -> Bridge:
    from unikern.platform import shared_bridge

    return shared_bridge()


def silu_mul_(gate: mx.array, up: mx.array) -> mx.array:
    """`silu(gate) * up`, written into gate's buffer; returns gate."""
    import torch.nn.functional as F

    bridge = _bridge()
    mx.eval(gate, up)
    g = bridge.to_torch(gate)
    F.silu(g, inplace=True)
    g.mul_(bridge.to_torch(up))
    return gate


def silu_mul_halves_(both: mx.array) -> mx.array:
    """`silu(gate) * up` for [..., gate | up], written into the gate half; returns that half."""
    import torch.nn.functional as F

    mx.eval(both)
    t = _bridge().to_torch(both)
    half = t.shape[-1] // 2
    gate = t[..., :half]
    F.silu(gate, inplace=True)
    gate.mul_(t[..., half:])
    return both[..., :half]


def softmax_(scores: mx.array) -> mx.array:
    """Softmax over the last axis, written into scores' buffer; returns scores."""
    import torch

    s = _bridge().to_torch(scores)
    s.copy_(torch.softmax(s, dim=-1))
    return scores


class SwiGLU(nn.Module):
    """down(silu(gate(x)) * up(x)) with the activation in PyTorch, in place. An MLP whose
    gate and up projections are fused (execute.fuse_projections) keeps its one matmul:
    the activation runs on the two halves of its output."""

    def __init__(self, mlp: nn.Module) -> None:
        super().__init__()
        if "fused_gate_proj" in mlp:
            self.fused_gate_proj = mlp.fused_gate_proj
        else:
            self.gate_proj = mlp.gate_proj
            self.up_proj = mlp.up_proj
        self.down_proj = mlp.down_proj

    def __call__(self, x: mx.array) -> mx.array:
        if "fused_gate_proj" in self:
            both = self.fused_gate_proj(x)
            gate, up = mx.split(both, 2, axis=-1)
        else:
            gate, up = self.gate_proj(x), self.up_proj(x)
        if gate.size < MIN_ELEMENTS:
            return self.down_proj(swiglu(gate, up))
        if "fused_gate_proj" in self:
            return self.down_proj(silu_mul_halves_(both))
        return self.down_proj(silu_mul_(gate, up))


def _swap_mlp(layer: Any, hidden: int) -> bool:
    mlp = getattr(layer, "mlp", None)
    if mlp is None or isinstance(mlp, SwiGLU):
        return isinstance(mlp, SwiGLU)
    if not all(hasattr(mlp, name) for name in ("gate_proj", "up_proj", "down_proj")):
        return False
    fast = SwiGLU(mlp)
    probe = mx.random.normal((1, 4, hidden), key=mx.random.key(7))
    try:
        same = bool(mx.allclose(mlp(probe), fast(probe), rtol=1e-5, atol=1e-6))
    except Exception:  # an MLP of another shape: keep it
        return False
    if same:
        layer.mlp = fast
    return same


def install(model: Any, dtype: mx.Dtype) -> dict[str, Any]:
    """Swap in the kernels where they apply; returns what was done, for stats.

    Only the engine's own model instance changes: each MLP is swapped for `SwiGLU` (the
    same Linear modules) after a probe shows it computes what the original did; attention
    goes through one module-global wrapper (`route_attention`).
    """
    import torch

    if dtype != mx.float32:
        return {"enabled": False, "reason": f"{dtype} model: the PyTorch kernels serve float32 only"}
    layers = layers_of(model)
    if not layers:
        return {"enabled": False, "reason": "the model exposes no `layers`"}
    hidden = int(getattr(getattr(model, "args", None), "hidden_size", 0) or 0)
    mlps = sum(_swap_mlp(layer, hidden) for layer in layers) if hidden else 0
    attention = sum(route_attention(layer) for layer in layers)
    if torch.get_num_threads() > 1:
        # MLX's CPU stream and the BLAS threads already occupy the cores: spinning
        # OpenMP workers fight them
        torch.set_num_threads(1)
    report = {"enabled": True, "swiglu_layers": mlps, "attention_layers": attention, "layers": len(layers)}
    log.debug("cpu_kernels.installed", **report)
    return report
