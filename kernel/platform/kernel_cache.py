"""Where MLX keeps the GPU kernels it compiles at run time: under the user's cache
directory, so that a second start finds them instead of compiling them again."""

from __future__ import annotations

import functools
import hashlib
import os
import struct
from importlib import metadata
from pathlib import Path
from typing import Any

# MLX's CUDA backend compiles its kernels with NVRTC on first use and reads this variable
# once; left unset it caches under the temporary directory (/tmp/mlx/<version>/ptx),
# which many machines clear at boot and containers never keep
PTX_CACHE_VARIABLE = "MLX_PTX_CACHE_DIR"


def default_dir(environ: os._Environ[str] | dict[str, str] = os.environ) -> Path:
    """`$XDG_CACHE_HOME/unikern/mlx-kernels/<mlx version>`, `~/.cache` without XDG. The
    version is part of the path: kernels of one MLX release never load into another."""
    base = environ.get("XDG_CACHE_HOME") or str(Path(environ.get("HOME") or Path.home()) / ".cache")
    try:
        version = metadata.version("mlx")
    except metadata.PackageNotFoundError:  # a source build of MLX
        version = "unknown"
    return Path(base) / "unikern" / "mlx-kernels" / version


def configure(environ: os._Environ[str] | dict[str, str] = os.environ) -> str:
    """Point MLX's kernel cache at `default_dir()` unless the user chose one. Must run
    before MLX first compiles a kernel (unikern does it at import). Returns the dir."""
    chosen = environ.get(PTX_CACHE_VARIABLE)
    if chosen:
        return chosen
    path = default_dir(environ)
    environ[PTX_CACHE_VARIABLE] = str(path)
    return str(path)


def kernel_name(base: str, *sources: str) -> str:
    """`base` and a digest of the kernel's source (and header): the name to hand
    `mx.fast.cuda_kernel`. MLX's CUDA backend keys a compiled kernel, in the process and
    in the PTX cache above, by its name and template arguments alone; that cache outlives
    an upgrade of unikern, so a kernel whose source changed under its old name would load
    the old code."""
    digest = hashlib.sha256("\0".join(sources).encode()).hexdigest()[:12]
    return f"{base}_{digest}"


@functools.cache
def cuda_kernel(base: str, input_names: tuple[str, ...], source: str, header: str = "",
                outputs: tuple[str, ...] = ("out",), contiguous: bool = True) -> Any:
    """`mx.fast.cuda_kernel` with the outputs `outputs` (one, `out`, by default), built
    once per source and named by `kernel_name` (so its compiled code is never another
    source's). `contiguous` False: MLX hands the inputs as they are, strided ones not
    copied first (the source reads them through `<name>_strides`)."""
    import mlx.core as mx

    # the inputs and outputs are the generated kernel's signature: in the name's digest too
    name = kernel_name(base, source, header, ",".join(input_names), ",".join(outputs))
    return mx.fast.cuda_kernel(name=name, input_names=list(input_names), output_names=list(outputs),
                               source=source, header=header, ensure_row_contiguous=contiguous)


# MLX's CUDA allocator keeps every array of up to this many bytes in one pool of managed
# memory that the host writes (its scalars) and the GPU reaches across the bus: there a
# kernel's atomics, or every block's read, cost microseconds each. On an H200 a residual
# kernel whose blocks counted on a one-element counter there took 600 us instead of 10
# (tools/probe/probe_cuda.py's engine-paged-blocks-handnorm; tools/probe/probe_memory.py). Arrays a kernel
# counts on or writes for the next kernel's every block are made larger than this; float
# constants go in as template arguments (`float_bits`), not as one-element arrays.
SMALL_POOL_BYTES = 8


def off_small_pool(n: int, itemsize: int) -> int:
    """Elements to allocate for an array of at least `n` elements of `itemsize` bytes so
    that it lies in device memory, not in MLX's pool of small arrays."""
    return max(n, SMALL_POOL_BYTES // itemsize + 1)


def float_bits(value: float) -> int:
    """`value` as float32, its bits as an int: MLX's custom kernels take ints, bools and
    dtypes as template arguments; the source reads it back with `__int_as_float`."""
    return struct.unpack("<i", struct.pack("<f", value))[0]


_placeholders: dict[Any, Any] = {}


def placeholder(dtype: Any) -> Any:
    """A one-element input for a kernel's unused inputs (one per dtype, made once)."""
    import mlx.core as mx

    if dtype not in _placeholders:
        _placeholders[dtype] = mx.zeros((1,), dtype=dtype)
    return _placeholders[dtype]
