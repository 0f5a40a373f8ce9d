"""Where the GPU kernels compiled at run time are kept: MLX's own, and unikern's (built by
unikern as cubins, `Kernel`), under the user's cache directory, so that a second start
finds them instead of compiling them again."""

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


# what the kernels built here did in this process (stats.model.warmup's "kernels")
BUILDS = {"compiled": 0, "compile_s": 0.0, "from_disk": 0, "jit": 0}
PRECOMPILE_VARIABLE = "UNIKERN_CUDA_PRECOMPILE"  # "0": every kernel through MLX's compiler


class Kernel:
    """One kernel text, launched as `mx.fast.cuda_kernel`'s kernels are (same keywords).
    On MLX's CUDA backend each (template, input dtypes and ranks) is built once by
    unikern (platform/cuda_build.py) into a cubin kept in the kernel cache directory,
    so a second process loads it instead of compiling it again; where that cannot be
    (no NVRTC or CUDA headers found, a text that reads an input's strides, the CPU
    backend, PRECOMPILE_VARIABLE=0) MLX compiles it, as its `cuda_kernel`."""

    def __init__(self, name: str, input_names: tuple[str, ...], source: str, header: str,
                 outputs: tuple[str, ...], contiguous: bool) -> None:
        self.name, self.input_names, self.source, self.header = name, input_names, source, header
        self.outputs, self.contiguous = outputs, contiguous
        self._built: dict[tuple, tuple[str, bytes, list[int]] | None] = {}
        self._jit: Any = None  # MLX's kernel, made at its first launch

    def jit(self) -> Any:
        import mlx.core as mx

        if self._jit is None:
            self._jit = mx.fast.cuda_kernel(name=self.name, input_names=list(self.input_names),
                                            output_names=list(self.outputs), source=self.source, header=self.header,
                                            ensure_row_contiguous=self.contiguous)
        return self._jit

    def __call__(self, *, inputs: list, template: list, grid: tuple, threadgroup: tuple, output_shapes: list,
                 output_dtypes: list, init_value: float | None = None, **kwargs: Any) -> list:
        import mlx.core as mx

        built, builder = None, _builder()
        if builder is not None:
            key = (tuple((k, v if isinstance(v, int) else str(v)) for k, v in template),
                   tuple((str(a.dtype), a.ndim) for a in inputs), tuple(str(d) for d in output_dtypes))
            if key not in self._built:
                self._built[key] = builder.build(self, inputs, template, output_dtypes)
            built = self._built[key]
        if built is None:
            BUILDS["jit"] += 1
            return self.jit()(inputs=inputs, template=template, grid=grid, threadgroup=threadgroup,
                             output_shapes=output_shapes, output_dtypes=output_dtypes, init_value=init_value, **kwargs)
        name, cubin, shaped = built
        return mx.fast.precompiled_cuda_kernel(
            name=name, compiled_source=cubin, inputs=inputs, output_shapes=output_shapes, output_dtypes=output_dtypes,
            scalars=[d for i in shaped for d in inputs[i].shape], grid=grid, threadgroup=threadgroup,
            init_value=init_value, ensure_row_contiguous=self.contiguous)


class Builder:
    """Compiles kernel texts for this process's GPU with NVRTC, and keeps the cubins
    under `folder` named by a digest of the source, the compiler's options and version
    and the GPU's architecture."""

    def __init__(self, nvrtc: Any, include: str, arch: str, folder: Path) -> None:
        from unikern.platform import cuda_build

        self.nvrtc, self.include, self.arch, self.folder = nvrtc, include, arch, folder
        self.stamp = "\0".join([arch, cuda_build.nvrtc_version(nvrtc), *cuda_build.OPTIONS])

    def build(self, kernel: Kernel, inputs: list, template: list, output_dtypes: list) -> tuple[str, bytes, list[int]] | None:
        import time

        import structlog

        from unikern.platform import cuda_build

        if any(cuda_build.reads(kernel.source, arg, "strides") for arg in kernel.input_names):
            return None

        def dtype(d: Any) -> str:
            return str(d).removeprefix("mlx.core.")

        args = [(n, dtype(a.dtype), a.ndim) for n, a in zip(kernel.input_names, inputs, strict=True)]
        if any(d not in cuda_build.CUDA_TYPES for _, d, _ in args):
            return None
        outs = [(n, dtype(d)) for n, d in zip(kernel.outputs, output_dtypes, strict=True)]
        values = [(k, v if isinstance(v, int) else dtype(v)) for k, v in template]
        if any(isinstance(v, str) and v not in cuda_build.CUDA_TYPES for _, v in values):
            return None  # a float or another type as a template argument: MLX's compiler
        # named by a digest of its own text (the name left a placeholder until then)
        text, shaped = cuda_build.wrap_precompiled("@NAME@", kernel.source, kernel.header, args, outs, values)
        name = f"{kernel.name}_{cuda_build.digest(text, self.stamp)}"
        text = text.replace("@NAME@", name)
        path = self.folder / f"{name}.cubin"
        try:
            cubin = path.read_bytes()
            if cubin[:4] == b"\x7fELF":  # anything else (a file cut short elsewhere): built again
                BUILDS["from_disk"] += 1
                return name, cubin, shaped
        except OSError:
            pass
        started = time.perf_counter()
        ok, log, cubin = cuda_build.compile_source(self.nvrtc, self.include, name, text, self.arch, cubin=True)
        BUILDS["compile_s"] = round(BUILDS["compile_s"] + time.perf_counter() - started, 3)
        if not ok or not cubin:
            structlog.get_logger().warning("kernel_cache.nvrtc_failed", kernel=name, log=log[-2000:],
                                           fallback="MLX's compiler")
            return None
        BUILDS["compiled"] += 1
        try:
            self.folder.mkdir(parents=True, exist_ok=True)
            partial = path.with_suffix(f".{os.getpid()}.part")
            partial.write_bytes(cubin)
            partial.replace(path)  # whole or absent, with processes building side by side
        except OSError as exc:  # a read-only cache: this process keeps its build
            structlog.get_logger().warning("kernel_cache.not_saved", path=str(path), error=str(exc))
        return name, cubin, shaped


@functools.cache
def _builder() -> Builder | None:
    """This process's Builder, or None where MLX's compiler must build the kernels."""
    import mlx.core as mx

    if os.environ.get(PRECOMPILE_VARIABLE, "1") == "0" or not mx.cuda.is_available():
        return None
    if mx.default_device() != mx.gpu or not hasattr(mx.fast, "precompiled_cuda_kernel"):
        return None
    import structlog

    from unikern.platform import cuda_build

    try:
        nvrtc, include = cuda_build.find_nvrtc()
    except (FileNotFoundError, OSError) as exc:
        structlog.get_logger().warning("kernel_cache.no_nvrtc", reason=str(exc), fallback="MLX's compiler")
        return None
    info = mx.device_info(mx.gpu)
    arch = info.get("architecture", "")
    if not str(arch).startswith("sm_"):
        major, minor = info.get("compute_capability_major"), info.get("compute_capability_minor")
        arch = f"sm_{major}{minor}" if major is not None else _driver_arch()
    if not arch:
        return None
    folder = Path(os.environ.get(PTX_CACHE_VARIABLE) or default_dir()) / "unikern"
    return Builder(nvrtc, include, str(arch), folder)


def _driver_arch() -> str:
    """The first GPU's sm_XY from the CUDA driver, "" if it cannot say."""
    import ctypes

    try:
        cuda = ctypes.CDLL("libcuda.so.1")
        device, major, minor = ctypes.c_int(), ctypes.c_int(), ctypes.c_int()
        if cuda.cuInit(0) or cuda.cuDeviceGet(ctypes.byref(device), 0):
            return ""
        cuda.cuDeviceGetAttribute(ctypes.byref(major), 75, device)  # CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR
        cuda.cuDeviceGetAttribute(ctypes.byref(minor), 76, device)
        return f"sm_{major.value}{minor.value}"
    except OSError:
        return ""


@functools.cache
def cuda_kernel(base: str, input_names: tuple[str, ...], source: str, header: str = "",
                outputs: tuple[str, ...] = ("out",), contiguous: bool = True) -> Kernel:
    """A Kernel with the outputs `outputs` (one, `out`, by default), made once per
    source and named by `kernel_name` (so its compiled code is never another source's).
    `contiguous` False: the inputs are handed as they are, strided ones not copied
    first (the source reads them through `<name>_strides`)."""
    # the inputs and outputs are the generated kernel's signature: in the name's digest too
    name = kernel_name(base, source, header, ",".join(input_names), ",".join(outputs))
    return Kernel(name, input_names, source, header, outputs, contiguous)


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
