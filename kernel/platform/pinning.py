"""Wired weights: keep model weights resident so they never page out mid-generation.
The KV pool is never wired."""

from __future__ import annotations

import ctypes
import os
import resource
import sys
import threading
from collections.abc import Callable, Sequence
from types import ModuleType
from typing import TYPE_CHECKING, Any

import msgspec
import structlog

from unikern.platform.bridge import mlx_buffer

if TYPE_CHECKING:
    import mlx.core as mx

__all__ = ["WeightWiring", "WiredReport", "unwire", "wire_weights"]

log = structlog.get_logger()

_CAP_IPC_LOCK = 14  # bit in /proc/self/status CapEff


class WiredReport(msgspec.Struct, frozen=True):
    wired_bytes: int
    requested_bytes: int
    reason: str


def has_cap_ipc_lock() -> bool:
    """Whether this process may lock memory beyond RLIMIT_MEMLOCK (Linux capability)."""
    try:
        with open("/proc/self/status") as status:
            for line in status:
                if line.startswith("CapEff:"):
                    return bool(int(line.split()[1], 16) >> _CAP_IPC_LOCK & 1)
    except OSError:
        pass
    return False


def locked_bytes() -> int:
    """This process's locked memory (VmLck), which counts against RLIMIT_MEMLOCK."""
    try:
        with open("/proc/self/status") as status:
            for line in status:
                if line.startswith("VmLck:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def _page_ranges(arrays: Sequence[mx.array], page: int) -> list[tuple[int, int]]:
    """Merged, page-aligned [start, end) ranges covering every array's elements."""
    ranges = []
    for a in arrays:
        address, strides = mlx_buffer(a)
        if a.size == 0:
            continue
        low = sum(s * (n - 1) for s, n in zip(strides, a.shape, strict=True) if s < 0) * a.itemsize
        high = (
            sum(s * (n - 1) for s, n in zip(strides, a.shape, strict=True) if s > 0) + 1
        ) * a.itemsize
        start = (address + low) & ~(page - 1)
        end = (address + high + page - 1) & ~(page - 1)
        ranges.append((start, end))
    merged: list[tuple[int, int]] = []
    for start, end in sorted(ranges):
        if merged and start <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(end, merged[-1][1]))
        else:
            merged.append((start, end))
    return merged


def _mib(n: float) -> str:
    return f"{n / (1 << 20):.1f} MiB"


class WeightWiring:
    """Wires one set of weights at a time; holds references so the locked buffers live.

    Metal: `mx.set_wired_limit(max_recommended_working_set_size)`. Linux: `mlock` the pages
    of every weight buffer, when RLIMIT_MEMLOCK (or CAP_IPC_LOCK, which lifts it) allows the
    total; otherwise nothing is wired and the report says why.
    """

    def __init__(
        self,
        mx_module: ModuleType | Any = None,
        getrlimit: Callable[[int], tuple[int, int]] = resource.getrlimit,
        has_ipc_lock: Callable[[], bool] = has_cap_ipc_lock,
    ) -> None:
        self._mx = mx_module
        self._getrlimit = getrlimit
        self._has_ipc_lock = has_ipc_lock
        self._lock = threading.Lock()
        self._arrays: list[mx.array] = []
        self._locked: list[tuple[int, int]] = []
        self._previous_wired_limit: int | None = None
        libc = ctypes.CDLL(None, use_errno=True)
        self._mlock, self._munlock = libc.mlock, libc.munlock
        for function in (self._mlock, self._munlock):
            function.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
            function.restype = ctypes.c_int

    def _mx_core(self) -> Any:
        if self._mx is None:
            import mlx.core

            self._mx = mlx.core
        return self._mx

    def wire(self, arrays: Sequence[mx.array], enabled: bool = True) -> WiredReport:
        mx = self._mx_core()
        with self._lock:
            self._release()
            mx.eval(*arrays)
            requested = sum(a.nbytes for a in arrays)
            if not enabled:
                report = WiredReport(0, requested, "wiring disabled")
            elif mx.metal.is_available():
                report = self._wire_metal(mx, requested)
            elif mx.cuda.is_available():
                report = WiredReport(
                    0, requested, "CUDA: weights live in managed device memory; nothing to wire"
                )
            elif sys.platform.startswith("linux"):
                report = self._wire_mlock(arrays, requested)
            else:
                report = WiredReport(0, requested, f"no wiring on {sys.platform} without Metal")
            if report.wired_bytes:
                self._arrays = list(arrays)
        emit = log.info if report.wired_bytes or not enabled else log.warning
        emit(
            "weights.wired",
            wired_bytes=report.wired_bytes,
            requested_bytes=report.requested_bytes,
            reason=report.reason,
        )
        return report

    def _wire_metal(self, mx: Any, requested: int) -> WiredReport:
        limit = int(mx.metal.device_info()["max_recommended_working_set_size"])
        self._previous_wired_limit = int(mx.set_wired_limit(limit))
        if requested > limit:
            return WiredReport(
                limit,
                requested,
                f"weights {_mib(requested)} exceed the Metal working set {_mib(limit)}; "
                "only part stays wired",
            )
        return WiredReport(requested, requested, f"Metal wired limit set to {_mib(limit)}")

    def _wire_mlock(self, arrays: Sequence[mx.array], requested: int) -> WiredReport:
        ranges = _page_ranges(arrays, os.sysconf("SC_PAGE_SIZE"))
        needed = sum(end - start for start, end in ranges)
        soft, _ = self._getrlimit(resource.RLIMIT_MEMLOCK)
        if self._has_ipc_lock():
            why = "CAP_IPC_LOCK lifts RLIMIT_MEMLOCK"
        elif soft == resource.RLIM_INFINITY:
            why = "RLIMIT_MEMLOCK is unlimited"
        elif locked_bytes() + needed <= soft:
            why = f"RLIMIT_MEMLOCK {_mib(soft)} allows it"
        else:
            return WiredReport(
                0,
                requested,
                f"not wired: RLIMIT_MEMLOCK is {soft} bytes ({_mib(soft)}) but the weights need "
                f"{needed} bytes ({_mib(needed)}) plus {locked_bytes()} already locked; raise "
                "it (ulimit -l, LimitMEMLOCK=) or grant CAP_IPC_LOCK",
            )
        for start, end in ranges:
            if self._mlock(start, end - start) != 0:
                errno = ctypes.get_errno()
                self._release()
                return WiredReport(
                    0, requested, f"not wired: mlock failed: {os.strerror(errno)} (errno {errno})"
                )
            self._locked.append((start, end))
        return WiredReport(requested, requested, f"mlocked {_mib(needed)} of pages; {why}")

    def _release(self) -> None:
        for start, end in self._locked:
            self._munlock(start, end - start)
        self._locked = []
        if self._previous_wired_limit is not None:
            self._mx_core().set_wired_limit(self._previous_wired_limit)
            self._previous_wired_limit = None
        self._arrays = []

    def unwire(self) -> None:
        """Unlock (or restore the Metal wired limit) and drop the references."""
        with self._lock:
            self._release()


_process_wiring: WeightWiring | None = None
_process_lock = threading.Lock()


def _default() -> WeightWiring:
    global _process_wiring
    with _process_lock:
        if _process_wiring is None:
            _process_wiring = WeightWiring()
        return _process_wiring


def wire_weights(arrays: Sequence[mx.array], enabled: bool = True) -> WiredReport:
    """Wire `arrays` for this process (replacing what was wired before)."""
    return _default().wire(arrays, enabled)


def unwire() -> None:
    """Release what `wire_weights` wired."""
    _default().unwire()
