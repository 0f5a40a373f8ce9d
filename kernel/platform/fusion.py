"""MLX's fusion of element-wise ops inside traced (`mx.compile`d) functions, on or off.

A traced step's chains of element-wise ops (a residual add and a cast, SiLU times the up
projection) become one kernel each: MLX writes its CUDA source and compiles it with NVRTC
the first time a machine meets it (its kernel cache keeps it after), 3-5 s apiece on an
H200 (each module instantiates its kernel for every rank and index type), one after
another: 8 of them took 31 s of a 1B model's 64 s start on an empty cache
(tools/results/h200/startup-1b-read-ahead.json). With fusion off the trace keeps each op
as MLX's own precompiled kernel: nothing to compile, a launch and a round trip through
memory per op, and other roundings (execute.fuse_elementwise says what that measured).

MLX's C++ API has the switch (`mlx::core::set_compile_mode`, mode `no_fuse`), its Python
bindings do not; `set_fusion` calls the exported function of the loaded libmlx through
ctypes. It applies to the whole process, to traces made after it.
"""

from __future__ import annotations

import ctypes
import functools
from pathlib import Path

# mlx/compile.h: enum class CompileMode { disabled, no_simplify, no_fuse, enabled }
NO_FUSE, ENABLED = 2, 3
SYMBOL = "_ZN3mlx4core16set_compile_modeENS0_11CompileModeE"  # mlx::core::set_compile_mode(CompileMode)


@functools.cache
def _setter() -> ctypes._CFuncPtr | None:
    import mlx.core as mx

    package = Path(mx.__file__).resolve().parent  # mlx/core.*.so; libmlx beside it in mlx/lib
    for library in (package / "lib" / "libmlx.so", package / "lib" / "libmlx.dylib"):
        if library.exists():
            try:
                setter = getattr(ctypes.CDLL(str(library)), SYMBOL)
            except (OSError, AttributeError):
                return None
            setter.argtypes, setter.restype = [ctypes.c_int], None
            return setter
    return None


def set_fusion(on: bool) -> bool:
    """Fuse element-wise ops in traces made from now on (MLX's default), or not. False
    where this MLX build does not export the switch (then nothing changed)."""
    setter = _setter()
    if setter is None:
        return False
    setter(ENABLED if on else NO_FUSE)
    return True
