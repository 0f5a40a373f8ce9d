"""A decode step's RoPE split into launches MLX's CUDA backend takes.

MLX 0.32's CUDA RoPE kernel fails to launch (`cudaLaunchKernelExC(...) failed: invalid
argument`) on a step of one token per row, [rows, heads, 1, D], at head size 16 once
rows x heads reaches 512; 256 launch, and so do 2,048 at head sizes 32 and 64, one row of
512 heads and any prompt [1, heads, L, 16] tried (an H100, 2026-12-06: the failing call
named by tools/probe/probe_launch.py, the shapes by the probe below). mlx-lm meets it too:
a batch of 128 rows of a model with 4 heads of 16. In unikern a decode window of 64 rows
of tiny-qwen2 hit it (q and k of its 4 + 4 heads through one RoPE call, blocks.py).

`route_ropes(model)` gives each attention layer's RoPE module (whatever its class: nn.RoPE,
mlx-lm's Llama3RoPE, YaRN, ...) a call that splits such a step along its rows into parts
of at most MAX_ROW_HEADS rows x heads, each with its rows' offsets, and concatenates
them; every other input goes through the module's own call unchanged. Only on CUDA, only
for modules rotating fewer than SMALL_HEAD dimensions.

    # the probe: rows x heads at head size 16, an offset per row
    mx.eval(mx.fast.rope(mx.zeros((64, 8, 1, 16), mx.bfloat16), 16, traditional=False,
                         base=1e6, scale=1.0, offset=mx.arange(64)))   # fails on CUDA
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx
import mlx.nn as nn

from unikern.stages.execute.routing import layers_of

MAX_ROW_HEADS = 256  # rows x heads per launch: launched at head size 16 (512 did not)
SMALL_HEAD = 32  # head sizes below this are split (16 failed; 32 and 64 launched at 2,048)


def needs_split(x: mx.array) -> bool:
    """Whether `x` is a step MLX's CUDA RoPE may not launch: one token a row, several rows,
    a small head and more rows x heads than MAX_ROW_HEADS."""
    return (x.ndim == 4 and x.shape[0] > 1 and x.shape[2] == 1 and x.shape[-1] < SMALL_HEAD
            and x.shape[0] * x.shape[1] > MAX_ROW_HEADS)


class SplitRoPE:
    """Mixed in before a RoPE module's class: steps that `needs_split` go through the
    class's own call in parts of rows; `unsplit` is that class."""

    unsplit: type

    def __call__(self, x: mx.array, offset: Any = 0) -> mx.array:
        call = super().__call__  # type: ignore[misc]
        if not needs_split(x):
            return call(x, offset=offset)
        rows = x.shape[0]
        per_part = max(1, MAX_ROW_HEADS // x.shape[1])
        per_row = isinstance(offset, mx.array) and offset.ndim == 1 and offset.size == rows
        parts = [call(x[start:start + per_part], offset=offset[start:start + per_part] if per_row else offset)
                 for start in range(0, rows, per_part)]
        return mx.concatenate(parts, axis=0)


_SPLIT: dict[type, type] = {}


def split_class(cls: type) -> type:
    """SplitRoPE mixed into `cls` (one class per RoPE class, made once)."""
    if cls not in _SPLIT:
        _SPLIT[cls] = type(f"Split{cls.__name__}", (SplitRoPE, cls), {"unsplit": cls})
    return _SPLIT[cls]


def rope_class(rope: Any) -> type:
    """The RoPE module's own class, under a split one."""
    return getattr(type(rope), "unsplit", type(rope))


def route_ropes(model: nn.Module) -> int:
    """Give each attention layer's RoPE module of `model` that rotates fewer than SMALL_HEAD
    dimensions (`dims`; a module without it too) the split call, in place (its state
    untouched); returns how many."""
    routed = 0
    for layer in layers_of(model):
        rope = getattr(getattr(layer, "self_attn", None), "rope", None)
        if (isinstance(rope, nn.Module) and not isinstance(rope, SplitRoPE)
                and getattr(rope, "dims", 0) < SMALL_HEAD):
            rope.__class__ = split_class(type(rope))
            routed += 1
    return routed
