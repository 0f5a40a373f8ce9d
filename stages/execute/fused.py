"""Projections of the same input multiplied as one: an attention layer's q/k/v and an
MLP's gate/up through one concatenated weight (execute.fuse_projections).

A one-row decode step on an H200 spent 970 us per token of the 1B shape in MLX's GEMV
kernel over 113 matrices, and 624 us over the 65 that fusing leaves: the narrow k/v
projections (2048 -> 512) run far from the memory's speed, and every kernel costs a
launch (CUPTI, tools/probe/probe_cuda.py's fused variant). The engine
at 16 and 64 requests gained 9-18% there; the 4-bit 8B shape did not gain through MLX's
quantized kernels (-5%, one run), so "auto" joins quantized layers only where unikern's
own 4-bit kernels multiply them (stages/execute/ranks.py, fuses_quantized).

mlx-lm's model code stays as it is: the fused module's class gains a `__call__` that
multiplies once and hands each projection its slice of the output, then runs the
family's own `__call__`, in which `self.q_proj(x)` returns that slice. A projection
called on any other input than the one handed (a family that transforms x first)
multiplies through its rows of the fused weight instead, so the result is always the
unfused one."""

from __future__ import annotations

from typing import Any

import mlx.core as mx
import mlx.nn as nn

GROUPS = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"))
_FUSED_CLASSES: dict[type, type] = {}


class HandedProjection(nn.Module):
    """Stands in for one of the fused projections: gives back the slice of the fused
    output its owner handed it for this input, once; otherwise its own rows of the
    fused weight. It holds no parameters (the owner's `fused_<group>` module does)."""

    def __init__(self, fused: nn.Module, lo: int, hi: int) -> None:
        super().__init__()
        self.__dict__.update(_fused=fused, _lo=lo, _hi=hi, _x=None, _out=None, misses=0)

    def hand(self, x: mx.array, out: mx.array) -> None:
        self.__dict__.update(_x=x, _out=out)

    def __call__(self, x: mx.array) -> mx.array:
        d = self.__dict__
        out, handed = d["_out"], d["_x"]
        d.update(_x=None, _out=None)
        if out is not None and x is handed:
            return out
        d["misses"] += 1  # not the owner's input: this projection alone
        return _rows(d["_fused"], x, d["_lo"], d["_hi"])


def _rows(fused: nn.Module, x: mx.array, lo: int, hi: int) -> mx.array:
    """x through rows [lo, hi) of a fused layer's weight (contiguous views, no copy)."""
    if isinstance(fused, nn.QuantizedLinear):
        biases = fused.get("biases")
        y = mx.quantized_matmul(x, fused["weight"][lo:hi], scales=fused["scales"][lo:hi],
                                biases=None if biases is None else biases[lo:hi], transpose=True,
                                group_size=fused.group_size, bits=fused.bits, mode=fused.mode)
    else:
        y = x @ fused["weight"][lo:hi].T
    return y + fused["bias"][lo:hi] if "bias" in fused else y


def _fused_class(cls: type) -> type:
    """`cls` with a `__call__` that hands the fused projections' outputs out first."""
    if cls not in _FUSED_CLASSES:

        def __call__(self, x, *args, **kwargs):
            for group in self._fused_groups:
                y = self[f"fused_{group[0]}"](x)
                for name in group:
                    part = self[name]
                    part.hand(x, y[..., part._lo : part._hi])
            try:
                return cls.__call__(self, x, *args, **kwargs)
            finally:  # nothing handed outlives the call (a trace's arrays included)
                for group in self._fused_groups:
                    for name in group:
                        self[name].__dict__.update(_x=None, _out=None)

        _FUSED_CLASSES[cls] = type(f"Fused{cls.__name__}", (cls,), {"__call__": __call__})
    return _FUSED_CLASSES[cls]


def _concatenated(layers: list[nn.Module], quantized: bool) -> nn.Module | None:
    """One layer computing every layer's output side by side, or None when they cannot
    be joined (other types, input widths, quantization settings, or mixed biases)."""
    kind = type(layers[0])
    kinds = (nn.Linear, nn.QuantizedLinear) if quantized else (nn.Linear,)
    if kind not in kinds or any(type(layer) is not kind for layer in layers):
        return None
    if len({layer["weight"].shape[1] for layer in layers}) != 1 or len({"bias" in layer for layer in layers}) != 1:
        return None
    keys = ["weight", "bias"]
    if kind is nn.QuantizedLinear:
        settings = {(layer.group_size, layer.bits, layer.mode, "biases" in layer) for layer in layers}
        if len(settings) != 1:
            return None
        keys += ["scales", "biases"]
    fused = kind.__new__(kind)
    nn.Module.__init__(fused)
    for attr in ("group_size", "bits", "mode"):
        if hasattr(layers[0], attr):
            setattr(fused, attr, getattr(layers[0], attr))
    for key in keys:
        if key in layers[0]:
            fused[key] = mx.concatenate([layer[key] for layer in layers], axis=0)
    if kind is nn.QuantizedLinear:
        fused.freeze()  # as nn.QuantizedLinear keeps its own
    return fused


def fuse_projections(model: Any, quantized: bool = True) -> int:
    """Fuse every q/k/v and gate/up group of `model` whose layers can be joined (quantized
    layers too if `quantized`); returns how many groups were fused. The separate weights
    are dropped as each group is built."""
    count = 0
    for _, module in list(model.named_modules()):
        groups = []
        for names in GROUPS:
            layers = [module.get(name) if isinstance(module.get(name), nn.Module) else None for name in names]
            if any(layer is None for layer in layers):
                continue
            fused = _concatenated(layers, quantized)
            if fused is None:
                continue
            module[f"fused_{names[0]}"] = fused
            lo = 0
            for name, layer in zip(names, layers, strict=True):
                hi = lo + layer["weight"].shape[0]
                module[name] = HandedProjection(fused, lo, hi)
                lo = hi
            groups.append(names)
            mx.eval(fused.parameters())  # one group at a time: the separate weights go as it is built
        if groups:
            module._fused_groups = tuple(groups)
            module.__class__ = _fused_class(type(module))
            count += len(groups)
    return count


def fallback_calls(model: Any) -> int:
    """How many projection calls were not handed their output (0 in the families that
    pass the layer's own input to each projection)."""
    return sum(m.misses for _, m in model.named_modules() if isinstance(m, HandedProjection))
