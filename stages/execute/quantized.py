"""Quantized linear layers that multiply many rows by dequantizing their weights first."""

from __future__ import annotations

import os
from typing import Any

import mlx.core as mx
import mlx.nn as nn
from mlx.nn.layers.distributed import (
    QuantizedAllToShardedLinear,
    QuantizedShardedToAllLinear,
    sum_gradients,
)

from unikern.stages.execute.cuda import q4_gemv
from unikern.stages.execute.cuda.q4_gemv import gemv, gemv_applies
from unikern.stages.execute.cuda.q4_mma import mma, mma_applies

# Rows from which a step multiplies dequantized weights (None: never), by backend. MLX's
# CPU and CUDA quantized matmuls cost about one row's time per row (CPU, 4096x4096 4-bit:
# 15.8 ms per row against 120 ms for 64 rows dequantized first; an H200 at the 8B shape
# ran 64 rows in ~210 ms against 7.6 ms for one), while dequantizing costs one pass over
# the weights whatever the rows. Metal's quantized kernels tile rows well: left alone.
AUTO_ROWS = {"cpu": 8, "cuda": 8, "metal": None}
# The activations' dtypes whose steps "auto" dequantizes, by backend (absent: any). MLX's
# CPU quantized matmul sums each output k by k in the activations' dtype, rounding every
# product and partial sum to it (mlx/backend/cpu/quantized.cpp, _qmm_t): bfloat16 and
# float16 rows sum in 8 and 11 bits, which no matmul (float32 sums) gives back, and
# mlx-lm's tokens changed (tests/test_quantized_parity.py); float32 rows sum in float32
# either way, bit for bit under MLX's reference BLAS, in another order under a preloaded
# one, as unquantized float32 layers' batched rows do.
AUTO_DTYPES = {"cpu": ("float32",)}
# The same with unikern's CUDA kernels below it (execute.quantized_gemv / quantized_mma).
# The GEMV, measured at the 8B shape on an H200 (tools/bench/bench_gpu.py, execute.quantized_gemv
# always against never): steps of 16 rows 728 -> 894 tok/s against dequantized weights, 64
# rows 2,579 -> 1,074; so from 17 rows. The tensor-core kernel (a 64-row decode step 14.7
# ms through it, 55.1 through the GEMV, 196.5 through MLX's quantized matmul:
# tools/probe/probe_cuda.py; against dequantized weights see execute.quantized_mma): from 65 rows.
KERNEL_ROWS = {"gemv": 17, "mma": 65}
# blocks.py's 4-bit blocks add their residuals inside the GEMV (`res`): 2 of a block's
# kernels fewer per one-row token (an 8B token's 64 adds: 827 -> 763 primitives, 4.94 ->
# 4.34 ms in the runner on an H200, tools/probe/probe_cuda.py's engine-paged-q-blocks-res).
GEMV_RESIDUAL = True
# blocks.py's 4-bit blocks rotate q and k inside the q/k/v GEMV and write k and v into the
# pool from it (`gemv_rope`), where the paged kernel reads them back: an 8B one-row token's
# 32 RoPE kernels, 32 pool writes and ~190 views fewer.
GEMV_ROPE = True
# and their gate/up GEMV gives silu(gate) * up itself (`gemv_swiglu`): 32 SwiGLU kernels
# and 32 splits fewer per 8B one-row token. With GEMV_ROPE, 4.02 -> 3.30 ms per 8B one-row
# token in the runner on an H200, 348 -> 252 kernels (tools/probe/probe_cuda.py's
# engine-paged-q-blocks-s17 against -epi).
GEMV_SWIGLU = True
# UNIKERN_Q4_GEMV="SUMS=1 WARPS=1 UNROLL=4": the 4-bit GEMV's block shape and summing
# (q4_gemv's GEMV_* constants) for a process, to compare them on a GPU in servers and
# engines that tools/probe/bench_q4_gemv.py cannot reach (bench_http's peers)
GEMV_SETTINGS_VARIABLE = "UNIKERN_Q4_GEMV"


def set_gemv_constants(settings: str) -> dict[str, int]:
    """q4_gemv's GEMV_<NAME> constants from "NAME=VALUE ..." (spaces or commas); returns
    what it set. An unknown name raises ConfigError with the ones there are."""
    from unikern.errors import ConfigError

    known = sorted(name.removeprefix("GEMV_") for name in vars(q4_gemv) if name.startswith("GEMV_"))
    chosen = {}
    for item in settings.replace(",", " ").split():
        name, _, value = item.partition("=")
        if name.upper() not in known or not value.lstrip("-").isdigit():
            raise ConfigError(f"{GEMV_SETTINGS_VARIABLE}: {item!r} is not NAME=INTEGER with NAME one of {known}")
        chosen[f"GEMV_{name.upper()}"] = int(value)
    for name, value in chosen.items():
        setattr(q4_gemv, name, type(getattr(q4_gemv, name))(value))
    return chosen


if os.environ.get(GEMV_SETTINGS_VARIABLE):
    set_gemv_constants(os.environ[GEMV_SETTINGS_VARIABLE])


def epilogue_gemv_applies(layer: nn.Module, x: mx.array, setting: bool) -> bool:
    """Where blocks.py's 4-bit blocks take `gemv_rope` (setting GEMV_ROPE) or
    `gemv_swiglu` (GEMV_SWIGLU): a routed layer without a bias whose step of x's rows
    goes through the GEMV kernel."""
    return setting and isinstance(layer, RowRouting) and "bias" not in layer and takes_gemv(layer, x)


def takes_gemv(layer: nn.Module, x: mx.array) -> bool:
    """Whether a routed layer's step of x's rows goes through the GEMV kernel (_matmul's
    routing): fewer rows than `dequantize_rows`, not the tensor-core kernel's, the GEMV
    on and taking the shapes."""
    rows = x.size // x.shape[-1] if x.ndim else 1
    return (rows < layer.dequantize_rows and not (layer.mma and rows > GEMV_ROWS and mma_applies(layer, x))
            and layer.gemv and gemv_applies(layer, x))


GEMV_ROWS = 8  # with both kernels on, the GEMV keeps steps of up to this many rows


def _matmul(layer: nn.Module, x: mx.array) -> mx.array:
    """x @ layer's weights^T, without its bias. Below `layer.dequantize_rows` rows: the
    tensor-core kernel above GEMV_ROWS rows when `layer.mma`, else the GEMV when
    `layer.gemv`, else MLX's quantized kernel (each where it applies); from there, the
    dequantized weights (in x's dtype, a transient array) where x's dtype is one of
    `layer.dequantize_dtypes` (None: any), else MLX's kernel too."""
    rows = x.size // x.shape[-1] if x.ndim else 1
    w, scales, biases = layer["weight"], layer["scales"], layer.get("biases")
    dtypes = layer.dequantize_dtypes
    if rows < layer.dequantize_rows or (dtypes is not None and x.dtype not in dtypes):
        if layer.mma and rows > GEMV_ROWS and mma_applies(layer, x):
            return mma(x, w, scales, biases, layer.group_size, split=layer.mma_split)
        if takes_gemv(layer, x):
            return gemv(x, w, scales, biases, layer.group_size)
        return mx.quantized_matmul(x, w, scales=scales, biases=biases, transpose=True, group_size=layer.group_size,
                                   bits=layer.bits, mode=layer.mode)
    return x @ mx.dequantize(w, scales, biases, group_size=layer.group_size, bits=layer.bits, mode=layer.mode,
                             dtype=x.dtype).T


class RowRouting:
    """The settings route_quantized_layers gives each routed layer (read by _matmul)."""

    dequantize_rows: int
    # the activations' dtypes dequantized (None: any); a frozenset, since nn.Module keeps
    # tuples among its parameters
    dequantize_dtypes: frozenset[mx.Dtype] | None = None
    gemv: bool = False  # steps of few rows through the GEMV kernel above
    mma: bool = False  # and of more than GEMV_ROWS through the tensor-core kernel
    mma_split: bool = False  # its weights as two bf16 halves each (float32-exact)


class RowRoutedQuantizedLinear(RowRouting, nn.QuantizedLinear):
    """An affine `nn.QuantizedLinear` that, for inputs of at least `dequantize_rows` rows,
    expands its weights to the activations' dtype (a transient array, one layer at a
    time) and runs a plain matmul; fewer rows keep MLX's quantized kernel. The parameters
    are the same arrays, so pinning, identity and memory use do not change."""

    def __call__(self, x: mx.array) -> mx.array:
        y = _matmul(self, x)
        return y + self["bias"] if "bias" in self else y

    def plus(self, x: mx.array, res: mx.array) -> mx.array:
        """res + self(x), the same values: inside the GEMV kernel where it takes the step
        (GEMV_RESIDUAL, no bias, res of x's rows and dtype), else the add after it."""
        if (GEMV_RESIDUAL and "bias" not in self and takes_gemv(self, x)
                and res.dtype == x.dtype and res.size == x.size // x.shape[-1] * self["weight"].shape[0]):
            return gemv(x, self["weight"], self["scales"], self.get("biases"), self.group_size, res=res)
        return res + self(x)


class RowRoutedAllToSharded(RowRouting, QuantizedAllToShardedLinear):
    """mlx-lm's tensor-parallel shard of a quantized layer (columns), routed the same way."""

    def __call__(self, x: mx.array) -> mx.array:
        y = _matmul(self, sum_gradients(self.group)(x))
        return y + self["bias"] if "bias" in self else y


class RowRoutedShardedToAll(RowRouting, QuantizedShardedToAllLinear):
    """mlx-lm's tensor-parallel shard of a quantized layer (rows, summed across ranks)."""

    def __call__(self, x: mx.array) -> mx.array:
        y = mx.distributed.all_sum(_matmul(self, x), group=self.group)
        return y + self["bias"] if "bias" in self else y


ROUTED = {nn.QuantizedLinear: RowRoutedQuantizedLinear, QuantizedAllToShardedLinear: RowRoutedAllToSharded,
          QuantizedShardedToAllLinear: RowRoutedShardedToAll}


def route_quantized_layers(model: Any, rows: int | None, gemv: bool = False, mma: bool = False,
                           mma_split: bool = False, dtypes: tuple[str, ...] | None = None) -> int:
    """Give every affine quantized linear layer of `model` (plain, or a tensor-parallel
    shard) the row-routed call: dequantized weights from `rows` rows (None: never) for
    activations of `dtypes` (names, as AUTO_DTYPES; None: any), and below that the GEMV
    kernel (`gemv`) and the tensor-core kernel (`mma`, with the weights in two bf16
    halves when `mma_split`) where they apply. Returns how many layers were routed (0
    when nothing is asked for or the model is not quantized)."""
    if rows is None and not gemv and not mma:
        return 0
    routed = 0
    for _, module in model.named_modules():
        if type(module) in ROUTED and module.mode == "affine":
            module.__class__ = ROUTED[type(module)]
        if type(module) in ROUTED.values():  # routed now, or by an earlier call
            module.dequantize_rows = rows if rows is not None else 1 << 62
            module.dequantize_dtypes = None if dtypes is None else frozenset(getattr(mx, name) for name in dtypes)
            module.gemv, module.mma, module.mma_split = gemv, mma, mma_split
            routed += 1
    return routed
