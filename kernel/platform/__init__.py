"""The platform layer: what machine this is (`facts`), the BLAS under MLX's CPU backend,
the zero-copy bridge to PyTorch and numpy, and weight pinning. The process-wide
instances the stages share live here."""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from unikern.platform.bridge import Bridge
    from unikern.platform.facts import Platform


def cuda_is_default() -> bool:
    """Whether MLX's default device is a CUDA GPU: where unikern's `mx.fast.cuda_kernel`
    kernels and NCCL run (a CUDA machine whose default device is set to the CPU says no)."""
    import mlx.core as mx

    return mx.default_device() == mx.gpu and mx.cuda.is_available()


# CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT in CUDA's driver API
_SM_COUNT_ATTRIBUTE = 16


@functools.cache
def cuda_sm_count(library: str = "libcuda.so.1") -> int | None:
    """The streaming multiprocessors of CUDA device 0 (the one MLX's default GPU is, after
    CUDA_VISIBLE_DEVICES; a MIG slice's own count), asked of the CUDA driver through
    ctypes, so neither PyTorch nor a toolkit is needed; None where there is no driver or
    it cannot say."""
    import ctypes

    try:
        driver = ctypes.CDLL(library)
    except OSError:
        return None
    device, count = ctypes.c_int(), ctypes.c_int()
    if driver.cuInit(0) or driver.cuDeviceGet(ctypes.byref(device), 0):
        return None
    if driver.cuDeviceGetAttribute(ctypes.byref(count), _SM_COUNT_ATTRIBUTE, device):
        return None
    return count.value or None


@functools.cache
def _detected() -> Platform:
    from unikern.platform.facts import Platform

    return Platform.detect()


def current_platform() -> Platform:
    """This machine's facts, detected once per process, with MLX's memory limit as it is
    now (a program may set it at any time: the KV budget of an engine started after reads
    the new one)."""
    import mlx.core as mx
    import msgspec

    found = _detected()
    limit = int(mx.get_memory_limit())
    return found if limit == found.memory_limit else msgspec.structs.replace(found, memory_limit=limit)


@functools.cache
def shared_bridge() -> Bridge:
    """One Bridge per process, so `stats.bridge` counts every view the engine made."""
    from unikern.platform.bridge import Bridge

    return Bridge()


def bridge_stats() -> dict[str, int]:
    if shared_bridge.cache_info().currsize == 0:
        return {"zero_copy_views": 0, "copies": 0}
    return shared_bridge().stats()
