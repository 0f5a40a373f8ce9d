"""Unquantized bfloat16 linear layers through unikern's tensor-core kernel for steps of a
few to 64 rows (execute.dense_mma).

On an H200 MLX multiplies every matmul of more than one row through cuBLASLt, and
encoding one costs the host 13-17 us, against 3-4 us for MLX's one-row GEMV and for a
custom kernel (tools/probe/probe_ops.py). A decode step of the 1B shape runs 65 of them, about
1 ms of the host's time per step, where the step's GPU time at 64 rows is 2.3 ms and at
16 rows less: the step is paced by the host (tools/probe/step_gaps.py). The kernel
(cuda/bf16_mma.py) is the 4-bit tensor-core kernel's (mma.sync m16n8k16, float32 sums, up
to 64 rows per pass) with its weights read as they are instead of dequantized. Steps of
up to 4 rows keep the fused blocks' GEMVs (blocks.py) or MLX's GEMV; steps of more than
MAX_ROWS rows (prefill) keep cuBLASLt, which is the faster there."""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn

from unikern.stages.execute.cuda.bf16_mma import applies, matmul


class MMALinear(nn.Linear):
    """An `nn.Linear` whose steps of bf16_mma.MIN_ROWS to MAX_ROWS bfloat16 rows go
    through the kernel; any other input, as `nn.Linear` multiplies it. Same parameters."""

    def __call__(self, x: mx.array) -> mx.array:
        if not applies(self["weight"], x):
            return super().__call__(x)
        y = matmul(x, self["weight"])
        return y + self["bias"] if "bias" in self else y


def route_dense_layers(model: nn.Module) -> int:
    """Give every plain `nn.Linear` of `model` (the fused projections' concatenated layers
    among them) the kernel's call; returns how many were routed."""
    routed = 0
    for _, module in model.named_modules():
        if type(module) is nn.Linear:
            module.__class__ = MMALinear
        routed += type(module) is MMALinear
    return routed
