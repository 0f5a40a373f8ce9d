"""A residual add and the RMS norm that reads its sum as one kernel (execute.fuse_norms).

A pre-norm decoder block adds each sublayer's output to the residual stream and
normalizes the sum for the next sublayer: an add kernel and a norm kernel, twice per
block. One decode token of the 1B shape on an H200 ran 33 adds and 34 norms among its
242 kernels (CUPTI, tools/probe/probe_cuda.py's engine variants), at a token that MLX's
replay of the traced step, not the GPU, paces. Here one kernel (cuda/residual_norm.py)
gives both the sum (rounded to the model's dtype, as MLX's add rounds it) and its norm (as
MLX's CUDA rms_norm computes it: float32 sum of squares, the normalized value rounded to
the dtype, then times the weight in the dtype). Elsewhere the two are MLX's own ops, so
on a CPU the fused blocks compute bit for bit what the family's code does.

mlx-lm's blocks of the families in BLOCKS all run the same four lines (attention on the
input's norm, add, MLP on the sum's norm, add); the fused block runs them with the two
adds fused into the norms after them. Its second add's norm belongs to the next block
(its input norm) or, after the last block, to the model (its final norm): those norms
are handed their output with the input it is for (the pattern of fused.py's
projections), and compute it themselves for any other input. Not measured on a GPU yet,
so off by default."""

from __future__ import annotations

from typing import Any

import mlx.core as mx
import mlx.nn as nn

from unikern.platform import cuda_is_default
from unikern.stages.execute.cuda.residual_norm import add_rms_norm

# block classes (module, name) whose __call__ is the four lines fused below; a test holds
# mlx-lm's source to that (tests/test_residual_norms.py)
BLOCKS = {
    ("mlx_lm.models.llama", "TransformerBlock"),
    ("mlx_lm.models.qwen2", "TransformerBlock"),
    ("mlx_lm.models.qwen3", "TransformerBlock"),
    ("mlx_lm.models.phi3", "TransformerBlock"),
}


class HandedRMSNorm(nn.RMSNorm):
    """An nn.RMSNorm that may be handed its output for one input (computed with the add
    that made the input); any other input it normalizes itself."""

    def hand(self, x: mx.array, out: mx.array) -> None:
        self.__dict__.update(_x=x, _out=out)

    def __call__(self, x: mx.array) -> mx.array:
        d = self.__dict__
        out, handed = d.get("_out"), d.get("_x")
        d.update(_x=None, _out=None)
        if out is not None and x is handed:
            d["handed"] = d.get("handed", 0) + 1
            return out
        if out is not None:
            d["misses"] = d.get("misses", 0) + 1
        return super().__call__(x)


class FusedNormBlock:
    """The fused block's __call__, mixed into the family's class (see the module's notes)."""

    def __call__(self, x: mx.array, mask: Any = None, cache: Any = None) -> mx.array:
        use_kernel = self.__dict__["_use_kernel"]
        r = self.self_attn(self.input_layernorm(x), mask, cache)
        h, n = add_rms_norm(x, r, self.post_attention_layernorm, use_kernel)
        r = self.mlp(n)
        following = self.__dict__["_next_norm"]
        if following is None:
            return h + r
        out, n = add_rms_norm(h, r, following, use_kernel)
        following.hand(out, n)
        return out


_CLASSES: dict[type, type] = {}


def fuse_residual_norms(model: Any, use_kernel: bool | None = None) -> int:
    """Fuse the residual adds of `model`'s blocks into the norms after them where the
    family is in BLOCKS; returns how many blocks were fused (0: the model as it was).
    `use_kernel`: the CUDA kernel (default: where MLX's default device is CUDA)."""
    stack = getattr(model, "model", None)
    layers = getattr(stack, "layers", None)
    final = getattr(stack, "norm", None)
    if not layers or final is None:
        return 0
    if any((type(b).__module__, type(b).__name__) not in BLOCKS for b in layers):
        return 0
    norms = [b.get("input_layernorm") for b in layers] + [b.get("post_attention_layernorm") for b in layers]
    if any(type(n) is not nn.RMSNorm for n in [*norms, final]):
        return 0
    use_kernel = cuda_is_default() if use_kernel is None else use_kernel
    following = [b["input_layernorm"] for b in layers[1:]] + [final]
    for block, after in zip(layers, following, strict=True):
        after.__class__ = HandedRMSNorm  # exactly an nn.RMSNorm, checked above
        cls = type(block)
        if cls not in _CLASSES:
            _CLASSES[cls] = type(f"FusedNorm{cls.__name__}", (FusedNormBlock, cls), {})
        block.__class__ = _CLASSES[cls]
        block.__dict__.update(_next_norm=after, _use_kernel=use_kernel)
    return len(layers)


def handed_counts(model: Any) -> dict[str, int]:
    """How often the fused norms used the output handed to them, and how often they were
    handed one for another input than theirs (0 in the families of BLOCKS); zeros for
    None (no blocks fused: nothing to walk)."""
    norms = [m for _, m in model.named_modules() if isinstance(m, HandedRMSNorm)] if model is not None else []
    return {"handed": sum(n.__dict__.get("handed", 0) for n in norms),
            "misses": sum(n.__dict__.get("misses", 0) for n in norms)}
