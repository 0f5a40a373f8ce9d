"""Memory pages under MLX's CPU backend: zero arrays reserved without being committed,
pages given back with madvise(MADV_DONTNEED) and counted with mincore. Linux only."""

from __future__ import annotations

import ctypes
import io
import math
import os

import mlx.core as mx
import numpy as np
import structlog

from unikern.platform.bridge import mlx_buffer

log = structlog.get_logger()

PAGE_BYTES = os.sysconf("SC_PAGE_SIZE")
MADV_DONTNEED = 4

_libc = ctypes.CDLL(None, use_errno=True)
_libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
_libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]


def interior(address: int, nbytes: int) -> tuple[int, int]:
    """(first, end) of the whole pages inside [address, address + nbytes)."""
    first = -(-address // PAGE_BYTES) * PAGE_BYTES
    end = (address + nbytes) // PAGE_BYTES * PAGE_BYTES
    return first, max(first, end)


def release(address: int, nbytes: int) -> int:
    """Give back the whole pages inside the range: they read as zeros afterwards (private
    anonymous memory) and commit again when written. Returns the bytes given back."""
    first, end = interior(address, nbytes)
    if end > first and _libc.madvise(first, end - first, MADV_DONTNEED) != 0:
        raise OSError(ctypes.get_errno(), f"madvise(MADV_DONTNEED) failed at {first:#x}+{end - first}")
    return end - first


def resident_pages(address: int, nbytes: int) -> np.ndarray:
    """Per whole page inside the range: 1 if it is resident (committed), else 0."""
    first, end = interior(address, nbytes)
    vec = np.zeros((end - first) // PAGE_BYTES, np.uint8)
    if len(vec) and _libc.mincore(first, end - first, vec.ctypes.data) != 0:
        raise OSError(ctypes.get_errno(), f"mincore failed at {first:#x}+{end - first}")
    return vec


def zero_range(address: int, nbytes: int) -> None:
    """Make [address, address + nbytes) read as zeros, committing at most the two partial
    pages at its edges."""
    first, end = interior(address, nbytes)
    if end <= first:
        ctypes.memset(address, 0, nbytes)
        return
    ctypes.memset(address, 0, first - address)
    ctypes.memset(end, 0, address + nbytes - end)
    release(first, end - first)


class _UnwrittenNpy(io.RawIOBase):
    """A .npy stream of `nbytes` uint8 whose data is never written: mx.load reads the data
    into the new array's own buffer through readinto, which zeroes it by page release
    instead (the trick that lets MLX allocate without touching every page)."""

    def __init__(self, nbytes: int) -> None:
        if nbytes % PAGE_BYTES:
            raise ValueError(f"reserve whole pages: {nbytes} bytes is not a multiple of {PAGE_BYTES}")
        header = io.BytesIO()
        # pages x page bytes: MLX parses each dimension of a .npy header as a C int, so one
        # dimension of every byte overflowed past 2 GiB (IndexError: stoi)
        shape = (nbytes // PAGE_BYTES, PAGE_BYTES)
        np.lib.format.write_array_header_1_0(header, {"descr": "|u1", "fortran_order": False, "shape": shape})
        self.header = header.getvalue()
        self.size = len(self.header) + nbytes
        self.pos = 0
        self.data_reads: list[tuple[int, int]] = []  # (address, bytes) handed to readinto

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        self.pos = {io.SEEK_SET: 0, io.SEEK_CUR: self.pos, io.SEEK_END: self.size}[whence] + offset
        return self.pos

    def tell(self) -> int:
        return self.pos

    def readinto(self, buffer) -> int:
        view = memoryview(buffer).cast("B")
        if self.pos < len(self.header):
            chunk = self.header[self.pos : self.pos + len(view)]
            view[: len(chunk)] = chunk
            self.pos += len(chunk)
            return len(chunk)
        n = min(len(view), self.size - self.pos)
        if n:
            address = ctypes.addressof(ctypes.c_char.from_buffer(view))
            zero_range(address, n)
            self.data_reads.append((address, n))
        self.pos += n
        return n


def reserve_zeros(shape: tuple[int, ...], dtype: mx.Dtype) -> mx.array:
    """A zero array whose whole pages are not committed until written, starting on a page
    boundary (so a block's pages are its own). Falls back to mx.zeros, committed then
    released, if MLX does not read into the array's own buffer."""
    nbytes = math.prod(shape) * dtype.size
    if math.prod(shape) + PAGE_BYTES >= 2**31:  # as_strided takes a flat view of 32-bit size
        log.warning("kv_pool_reserve_fallback", reason="an array of 2**31 elements or more")
        return _zeros_released(shape, dtype)
    loaded_bytes = (-(-nbytes // PAGE_BYTES) + 1) * PAGE_BYTES  # whole pages, plus one to align
    stream = _UnwrittenNpy(loaded_bytes)
    raw = mx.load(stream, format="npy")
    mx.eval(raw)
    address = mlx_buffer(raw)[0]
    if sum(n for _, n in stream.data_reads) != loaded_bytes or stream.data_reads[0][0] != address:
        log.warning("kv_pool_reserve_fallback", reason="mx.load did not read into the array's buffer")
        return _zeros_released(shape, dtype)
    offset = -address % PAGE_BYTES
    # a strided view from the first whole page (MLX's dimensions are 32-bit, so the bytes
    # cannot be one flat axis past 2 GiB); the element offset needs dtype-aligned buffers
    assert offset % dtype.size == 0, (address, dtype)
    strides = [math.prod(shape[i + 1 :]) for i in range(len(shape))]
    array = mx.as_strided(raw.view(dtype), shape, strides, offset // dtype.size)
    mx.eval(array)
    del raw  # the view alone holds the buffer now, so writes into it are donated in place
    if mlx_buffer(array)[0] != address + offset:
        log.warning("kv_pool_reserve_fallback", reason="the typed view is not the loaded buffer")
        return _zeros_released(shape, dtype)
    return array


def _zeros_released(shape: tuple[int, ...], dtype: mx.Dtype) -> mx.array:
    array = mx.zeros(shape, dtype=dtype)
    mx.eval(array)
    zero_range(mlx_buffer(array)[0], array.nbytes)
    return array
