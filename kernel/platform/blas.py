"""Fast BLAS for MLX's CPU backend, whose Linux wheel links the netlib reference BLAS:
preload an optimized CBLAS before `mlx` is imported. Never import mlx at top level here:
`unikern/__init__.py` calls `preload()` before anything else imports mlx."""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import glob
import importlib.util
import os
import platform as _platform
import struct
import sys
import threading
from typing import Any, Literal

import msgspec
import structlog

from unikern.errors import ConfigError

__all__ = ["BlasInfo", "info", "preload", "ENV_VAR"]

ENV_VAR = "UNIKERN_BLAS"
REFERENCE = "reference"
_SYMBOL = "cblas_sgemm"

log = structlog.get_logger()

Source = Literal["auto", "env", "argument", "off", "already-imported"]


class BlasInfo(msgspec.Struct, frozen=True):
    """Which CBLAS serves MLX's `cblas_sgemm`: a library path, or "reference"."""

    library: str
    source: Source
    reason: str


class _State:
    """What `preload()` decided; the CDLL handles keep the libraries loaded."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.result: BlasInfo | None = None
        self.handles: list[ctypes.CDLL] = []


_state = _State()


# --------------------------------------------------------------------------- preload


def preload(path: str | None = None) -> BlasInfo:
    """Load an optimized CBLAS with RTLD_GLOBAL unless `mlx.core` is already imported.

    `path` (or env `UNIKERN_BLAS` when `path` is None) is `"auto"` (default), `"off"`,
    or a path to a CBLAS shared library. Missing libraries under `auto` fall back to
    the reference BLAS; an explicit path that is absent or unloadable raises
    `ConfigError`. Idempotent: the first successful decision stands for the process and
    is returned again; `info()` reports what MLX actually uses now.

    Why it works: MLX's wheel links `mlx_cpu.libs/libblas-*.so`, but symbols are looked up
    in the global scope before a library's own dependencies, so a CBLAS loaded with
    RTLD_GLOBAL *before* `libmlx.so` serves MLX's `cblas_sgemm` instead. After
    `mlx.core` is imported its symbols are bound and nothing here can change them.
    """
    with _state.lock:
        if _state.result is not None:
            return _state.result
        choice, source = _choice(path)
        if "mlx.core" in sys.modules:
            now = info()
            _state.result = BlasInfo(
                library=now.library,
                source="already-imported",
                reason=f"mlx.core was imported before preload(); {now.reason}",
            )
            if choice not in ("auto", "off"):
                log.warning("blas.preload_too_late", requested=choice, library=now.library)
            return _state.result

        if choice == "off":
            _state.result = BlasInfo(REFERENCE, "off", f"{ENV_VAR}=off: optimized BLAS disabled")
        elif sys.platform == "darwin":
            _state.result = BlasInfo(
                "Accelerate", source, "macOS: MLX links Apple Accelerate; nothing to preload"
            )
        elif choice == "auto":
            _state.result = _preload_auto()
        else:
            _state.result = _preload_explicit(choice, source)
        return _state.result


def _choice(path: str | None) -> tuple[str, Source]:
    if path is not None:
        return (path if path in ("auto", "off") else os.path.expanduser(path)), "argument"
    env = os.environ.get(ENV_VAR, "").strip()
    if not env or env == "auto":
        return "auto", "auto"
    return (env if env == "off" else os.path.expanduser(env)), "env"


def _candidates() -> list[tuple[str, list[str]]]:
    """(library, libraries to load before it) in search order."""
    arch = f"{_platform.machine()}-linux-gnu"
    found: list[tuple[str, list[str]]] = [
        (f"/usr/lib/{arch}/openblas-pthread/libopenblas.so.0", []),
        (f"/usr/lib/{arch}/openblas-openmp/libopenblas.so.0", []),
    ]
    by_name = ctypes.util.find_library("openblas")
    if by_name:
        found.append((by_name, []))
    lib_dir = os.path.join(sys.prefix, "lib")
    iomp = [p for p in sorted(glob.glob(os.path.join(lib_dir, "libiomp5.so*")))][:1]
    for mkl in sorted(glob.glob(os.path.join(lib_dir, "libmkl_rt.so*"))):
        found.append((mkl, iomp))
    return found


def _preload_auto() -> BlasInfo:
    tried: list[str] = []
    for library, before in _candidates():
        if os.path.isabs(library) and not os.path.exists(library):
            tried.append(f"{library} (absent)")
            continue
        try:
            _load(library, before)
        except (OSError, ConfigError) as exc:
            tried.append(f"{library} ({exc})")
            continue
        return BlasInfo(_loaded_path(library), "auto", f"preloaded {library} with RTLD_GLOBAL")
    return BlasInfo(REFERENCE, "auto", "no optimized CBLAS found; tried " + "; ".join(tried))


def _preload_explicit(library: str, source: Source) -> BlasInfo:
    origin = f"{ENV_VAR}={library}" if source == "env" else f"preload({library!r})"
    if not os.path.exists(library):
        raise ConfigError(
            f"{origin}: no such file; use 'auto', 'off' or the path of a CBLAS library "
            "such as /usr/lib/x86_64-linux-gnu/openblas-pthread/libopenblas.so.0"
        )
    try:
        _load(library, [])
    except OSError as exc:
        raise ConfigError(f"{origin}: cannot load it: {exc}") from exc
    return BlasInfo(_loaded_path(library), source, f"preloaded {library} with RTLD_GLOBAL")


def _load(library: str, before: list[str]) -> None:
    handles = [ctypes.CDLL(dep, mode=ctypes.RTLD_GLOBAL) for dep in before]
    handle = ctypes.CDLL(library, mode=ctypes.RTLD_GLOBAL)
    if not hasattr(handle, _SYMBOL):
        raise ConfigError(f"{library} loads but has no {_SYMBOL}: not a CBLAS")
    _state.handles.extend([*handles, handle])


def _loaded_path(library: str) -> str:
    """The file the dynamic loader actually mapped for `library` (a name or a path)."""
    handle = ctypes.CDLL(library, mode=ctypes.RTLD_GLOBAL)
    where = _dladdr(ctypes.cast(getattr(handle, _SYMBOL), ctypes.c_void_p).value)
    return where or library


# --------------------------------------------------------------------------- info


def info() -> BlasInfo:
    """The library that serves (or, before `import mlx`, will serve) MLX's `cblas_sgemm`.

    It does not assume: once MLX is loaded it reads the address in `libmlx.so`'s GOT slot
    for `cblas_sgemm` and asks `dladdr` which library it points into.
    """
    source: Source = _state.result.source if _state.result else "auto"
    if sys.platform == "darwin":
        return BlasInfo("Accelerate", source, "macOS: MLX links Apple Accelerate")
    if "mlx.core" in sys.modules:
        if _state.result is None:
            source = "already-imported"
        bound = _mlx_bound_provider()
        if bound is not None:
            library, how = bound
            return BlasInfo(_classify(library), source, f"{how}: {library}")
        provider = _global_provider()
        if provider is not None:
            return BlasInfo(
                _classify(provider), source, f"global {_SYMBOL} (GOT not readable): {provider}"
            )
        linked = _mapped_reference()
        return BlasInfo(REFERENCE, source, f"no global {_SYMBOL}; MLX uses its own {linked}")
    provider = _global_provider()
    if provider is None:
        return BlasInfo(
            REFERENCE, source, f"mlx not imported yet and no global {_SYMBOL}: reference BLAS"
        )
    return BlasInfo(
        _classify(provider), source, f"mlx not imported yet; global {_SYMBOL} is in {provider}"
    )


def _classify(path: str) -> str:
    real = os.path.realpath(path)
    name = os.path.basename(real)
    if "mlx_cpu.libs" in real or (name.startswith("libblas") and "openblas" not in real):
        return REFERENCE
    return path


def _global_provider() -> str | None:
    try:
        function = getattr(ctypes.CDLL(None), _SYMBOL)
    except AttributeError:
        return None
    return _dladdr(ctypes.cast(function, ctypes.c_void_p).value)


def _mapped_reference() -> str:
    with open("/proc/self/maps") as maps:
        for line in maps:
            parts = line.split()
            if len(parts) >= 6 and "libblas" in os.path.basename(parts[5]):
                return parts[5]
    return "BLAS"


class _DlInfo(ctypes.Structure):
    _fields_ = [
        ("dli_fname", ctypes.c_char_p),
        ("dli_fbase", ctypes.c_void_p),
        ("dli_sname", ctypes.c_char_p),
        ("dli_saddr", ctypes.c_void_p),
    ]


def _dladdr(address: int | None) -> str | None:
    if not address:
        return None
    libc = ctypes.CDLL(None)
    libc.dladdr.argtypes = [ctypes.c_void_p, ctypes.POINTER(_DlInfo)]
    found = _DlInfo()
    if not libc.dladdr(ctypes.c_void_p(address), ctypes.byref(found)) or not found.dli_fname:
        return None
    return os.path.normpath(os.fsdecode(found.dli_fname))


# --------------------------------------------------------------------------- GOT reading


class _PhdrInfo(ctypes.Structure):
    _fields_ = [("dlpi_addr", ctypes.c_void_p), ("dlpi_name", ctypes.c_char_p)]


def _loaded_objects() -> list[tuple[str, int]]:
    """(path, load base) of every loaded object, in load order."""
    found: list[tuple[str, int]] = []
    callback_type = ctypes.CFUNCTYPE(
        ctypes.c_int, ctypes.POINTER(_PhdrInfo), ctypes.c_size_t, ctypes.c_void_p
    )

    def visit(phdr_info, _size: int, _data: int) -> int:
        name = phdr_info.contents.dlpi_name
        if name:
            found.append((os.fsdecode(name), phdr_info.contents.dlpi_addr or 0))
        return 0

    libc = ctypes.CDLL(None)
    libc.dl_iterate_phdr.argtypes = [callback_type, ctypes.c_void_p]
    libc.dl_iterate_phdr(callback_type(visit), None)
    return found


def _mlx_bound_provider() -> tuple[str, str] | None:
    """Where the `cblas_sgemm` slot of MLX's own library points, or None if unreadable."""
    spec = importlib.util.find_spec("mlx")
    roots = [os.path.realpath(p) for p in (spec.submodule_search_locations or [])] if spec else []
    for path, base in _loaded_objects():
        if "mlx" not in path:
            continue
        real = os.path.realpath(path)
        if not any(real.startswith(root + os.sep) for root in roots):
            continue
        try:
            slot = _got_slot_offset(real, _SYMBOL)
        except (OSError, ValueError, struct.error):
            continue
        if slot is None:
            continue
        target = _dladdr(ctypes.c_uint64.from_address(base + slot).value)
        if target and os.path.realpath(target) != real:
            return target, f"{os.path.basename(real)} binds {_SYMBOL} to"
    return None


@functools.lru_cache(maxsize=16)
def _got_slot_offset(elf_path: str, symbol: str) -> int | None:
    """Offset (from the load base) of the relocation slot that holds `symbol`'s address.

    Parses ELF64 little-endian section headers: .dynsym, its string table, and every
    RELA section that refers to it. Returns None if the object does not import `symbol`.
    """
    with open(elf_path, "rb") as elf:
        header = elf.read(64)
        if header[:4] != b"\x7fELF" or header[4] != 2 or header[5] != 1:
            raise ValueError(f"{elf_path}: not an ELF64 little-endian object")
        (shoff,) = struct.unpack_from("<Q", header, 0x28)
        shentsize, shnum = struct.unpack_from("<HH", header, 0x3A)
        elf.seek(shoff)
        table = elf.read(shentsize * shnum)
        sections = [struct.unpack_from("<IIQQQQIIQQ", table, i * shentsize) for i in range(shnum)]

        def read(index: int) -> bytes:
            _, _, _, _, offset, size, *_ = sections[index]
            elf.seek(offset)
            return elf.read(size)

        sht_rela, sht_dynsym = 4, 11
        dynsym = next((i for i, s in enumerate(sections) if s[1] == sht_dynsym), None)
        if dynsym is None:
            return None
        strings = read(sections[dynsym][6])
        at = strings.find(b"\0" + symbol.encode() + b"\0")
        if at < 0:
            return None
        name_offset = at + 1
        symbols = read(dynsym)
        index = next(
            (
                i
                for i, (st_name, *_rest) in enumerate(struct.iter_unpack("<IBBHQQ", symbols))
                if st_name == name_offset
            ),
            None,
        )
        if index is None:
            return None
        for number, section in enumerate(sections):
            if section[1] != sht_rela or section[6] != dynsym:
                continue
            for r_offset, r_info, _addend in struct.iter_unpack("<QQq", read(number)):
                if r_info >> 32 == index:
                    return r_offset
    return None


# --------------------------------------------------------------------------- threads


class _ThreadControl:
    """get/set of the preloaded library's thread count (OpenBLAS or MKL), found once."""

    def __init__(self) -> None:
        self.get: Any = None
        self.set: Any = None
        for handle in reversed(_state.handles):
            for get, set_ in (("openblas_get_num_threads", "openblas_set_num_threads"),
                              ("mkl_get_max_threads", "mkl_set_num_threads")):
                if hasattr(handle, get) and hasattr(handle, set_):
                    self.get, self.set = getattr(handle, get), getattr(handle, set_)
                    self.get.restype = ctypes.c_int
                    self.set.argtypes = [ctypes.c_int]
                    return


_threads: _ThreadControl | None = None


def set_num_threads(n: int) -> int | None:
    """Set the preloaded BLAS's thread count; return the previous one, or None (and do
    nothing) when the BLAS under MLX has no such call (reference BLAS, Accelerate)."""
    global _threads
    if _threads is None:
        _threads = _ThreadControl()
    if _threads.set is None:
        return None
    previous = int(_threads.get())
    if previous != n:
        _threads.set(n)
    return previous
