"""Mixture-of-experts projections whose sorted input reaches MLX with the row pitch it reads.

A step with 64 or more (token, expert) pairs makes mlx-lm's SwitchGLU sort the pairs by
expert and call each projection (`SwitchLinear`) as `mx.gather_mm(x, w, rhs_indices,
sorted_indices=True)` with `x` of shape [pairs, 1, K]. MLX's CUDA backend (0.32.4) runs
that call as one grouped GEMM whose row pitch is `x`'s stride along its singleton axis
(`gather_mm_rhs` takes `strides(-2)` of any row-contiguous input as `lda`). A size-1 axis's
stride means nothing in MLX's layout, and some ops leave it 0: with element-wise fusion off
(execute.fuse_elementwise, off on CUDA by default) the shapeless `mx.compile`d SwiGLU of
gpt-oss (`swiglu_oai`) hands the down projection exactly such an input. At pitch 0 every
pair of an expert's group reads the group's first row, and gpt-oss's prompt of 601 tokens
gave token 1017 where mlx-lm gave 760 on an H100, layer 0's MLP output 0.98 off
(tools/results/h200/layers-gpt-oss-h100-cf77de2.txt); tests/test_expert_inputs.py
reproduces that token on the CPU by reading the rows at the pitch the CUDA backend reads.
MLX's Metal backend read the same stride until 0.32.1 (ml-explore/mlx#3960).

`route_experts(model)` gives every SwitchLinear a call whose sorted input is reshaped to
[pairs, K] and back first: a view with canonical strides (pitch K), no copy, on every
backend alike. Quantized experts (`QuantizedSwitchLinear`, `mx.gather_qmm`) are left as
they are: MLX's CUDA gather_qmm reads its input densely (its source: `ensure_row_contiguous`,
then offsets of K), never by that stride."""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.switch_layers import SwitchLinear


class PitchedSwitchLinear(SwitchLinear):
    """mlx-lm's SwitchLinear, its sorted one-row-matrix input re-strided first."""

    def __call__(self, x: mx.array, indices: mx.array, sorted_indices: bool = False) -> mx.array:
        if sorted_indices and x.ndim >= 2 and x.shape[-2] == 1:
            x = x.reshape(-1, x.shape[-1]).reshape(x.shape)
        return super().__call__(x, indices, sorted_indices)


def route_experts(model: nn.Module) -> int:
    """Give every expert projection of `model` (exactly mlx-lm's SwitchLinear) the
    re-strided call, in place (weights untouched); returns how many."""
    routed = 0
    for _, module in model.named_modules():
        if type(module) is SwitchLinear:
            module.__class__ = PitchedSwitchLinear
            routed += 1
    return routed
