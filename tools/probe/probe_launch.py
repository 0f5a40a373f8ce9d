"""Which kernel launch of a model's run fails on a GPU, by name.

MLX reports a failed launch (`cudaLaunchKernelExC ... invalid argument`) at the next
evaluation, which may hold a whole forward: nothing says which kernel it was. This runs
tools/check/parity_check's engine run with each of unikern's kernel calls and MLX's fast
ops evaluated as it returns (its inputs first, on their own), so the first failure is
printed with the call's name and its arguments' shapes and dtypes.

    python -m tools.probe.probe_launch --model tiny-qwen2 [--set execute.block_kernel=never]
"""

from __future__ import annotations

import argparse
import functools
import sys
import types
from typing import Any

# (module, function): unikern's kernel calls, patched wherever a unikern module holds them
KERNEL_CALLS = [
    ("unikern.stages.execute.cuda.block_gemv", "gemv"),
    ("unikern.stages.execute.cuda.block_kernel", "block_step"),
    ("unikern.stages.execute.cuda.paged_attention", "decode"),
    ("unikern.stages.execute.cuda.pool_write", "write"),
    ("unikern.stages.execute.cuda.pool_write", "rope_write"),
    ("unikern.stages.execute.cuda.rows", "take"),
    ("unikern.stages.execute.cuda.step_layout", "step_layout"),
    ("unikern.stages.execute.cuda.residual_norm", "add_rms_norm"),
    ("unikern.stages.execute.cuda.q4_gemv", "gemv"),
]
FAST_OPS = ["scaled_dot_product_attention", "rms_norm", "layer_norm", "rope"]


def describe(value: Any) -> str:
    import mlx.core as mx

    if isinstance(value, mx.array):
        return f"{value.dtype}{list(value.shape)}"
    if isinstance(value, (list, tuple)):
        return "(" + ", ".join(describe(v) for v in value) + ")"
    if isinstance(value, types.ModuleType | types.FunctionType) or callable(value):
        return getattr(value, "__name__", type(value).__name__)
    text = repr(value)
    return text if len(text) < 40 else text[:37] + "..."


def arrays_in(value: Any) -> list:
    import mlx.core as mx

    if isinstance(value, mx.array):
        return [value]
    if isinstance(value, (list, tuple)):
        return [a for v in value for a in arrays_in(v)]
    if isinstance(value, dict):
        return [a for v in value.values() for a in arrays_in(v)]
    return []


def evaluated(fn: Any, label: str, calls: dict[str, int]) -> Any:
    import mlx.core as mx

    @functools.wraps(fn)
    def call(*args: Any, **kwargs: Any) -> Any:
        shown = ", ".join([describe(a) for a in args] + [f"{k}={describe(v)}" for k, v in kwargs.items()])
        try:
            mx.eval(arrays_in(args) + arrays_in(kwargs))
        except ValueError as exc:
            if "transformations" in str(exc):  # a compiled step's trace: it launches as one, later
                return fn(*args, **kwargs)
            raise
        except Exception as exc:
            print(f"probe_launch: the inputs of {label} failed ({exc})\n    {label}({shown})", flush=True)
            raise
        out = fn(*args, **kwargs)
        try:
            mx.eval(arrays_in(out))
        except Exception as exc:
            print(f"probe_launch: {label} failed ({exc})\n    {label}({shown})", flush=True)
            raise
        calls[label] = calls.get(label, 0) + 1
        return out

    return call


def patch(calls: dict[str, int]) -> None:
    """Every unikern module's name for a kernel call, and mx.fast's ops, through `evaluated`."""
    import importlib

    import mlx.core as mx

    import unikern.stages.execute.blocks  # noqa: F401  (the users of the calls, imported first)
    import unikern.stages.execute.paged_cache  # noqa: F401
    import unikern.stages.execute.runner  # noqa: F401

    for module_name, name in KERNEL_CALLS:
        module = importlib.import_module(module_name)
        original = getattr(module, name)
        wrapped = evaluated(original, f"{module_name.rsplit('.', 1)[-1]}.{name}", calls)
        for user in list(sys.modules.values()):
            if getattr(user, "__name__", "").startswith("unikern") and isinstance(user, types.ModuleType):
                for attr, value in list(vars(user).items()):
                    if value is original:
                        setattr(user, attr, wrapped)
    for name in FAST_OPS:
        setattr(mx.fast, name, evaluated(getattr(mx.fast, name), f"mx.fast.{name}", calls))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="tiny-qwen2", help="a modelgen preset or a model directory")
    parser.add_argument("--prompts", type=int, default=4)
    parser.add_argument("--max-tokens", type=int, default=8)
    parser.add_argument("--set", action="append", default=[], dest="overrides", metavar="STAGE.KEY=VALUE")
    args = parser.parse_args()
    from pathlib import Path

    from tools.check import parity_check
    from unikern.testing.modelgen import cached_model

    path = args.model if Path(args.model).exists() else str(cached_model(args.model))
    calls: dict[str, int] = {}
    patch(calls)
    try:
        res = parity_check.check(path, args.prompts, args.max_tokens, 64, 256, extra=args.overrides)
    finally:
        print(f"probe_launch: calls evaluated: {calls}", flush=True)
    print(f"probe_launch: no launch failed; parity {res['counts']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
