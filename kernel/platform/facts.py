"""Platform accounting: which backend runs MLX, how much memory it has, and the KV budget,
so that sizing decisions come from one place."""

from __future__ import annotations

from types import ModuleType
from typing import Any, Literal

import msgspec

from unikern.errors import ConfigError, UnikernError
from unikern.platform import blas

__all__ = ["Backend", "Platform"]

Backend = Literal["metal", "cuda", "cpu"]


class Platform(msgspec.Struct, frozen=True):
    """What this machine is. On unified memory (Apple Silicon, and MLX's CUDA backend, whose
    arrays live in CUDA managed memory) host and device share the same bytes, so pinned host
    buffers are never useful. Total memory is the system RAM on Metal and CPU, the device's
    memory on CUDA."""

    backend: Backend
    unified_memory: bool
    total_memory: int  # bytes
    device_count: int
    pin_memory: bool
    blas: str
    device_name: str
    # bytes MLX lets this process allocate (mx.get_memory_limit: its default, or what
    # mx.set_memory_limit set, e.g. for a GPU shared with other servers); 0: not known.
    # The KV budget stays inside it
    memory_limit: int = 0

    @classmethod
    def detect(
        cls, mx_module: ModuleType | Any = None, psutil_module: ModuleType | Any = None
    ) -> Platform:
        """Ask MLX (and psutil) what this machine is. Modules are injectable for tests."""
        if mx_module is None:
            import mlx.core as mx_module
        if psutil_module is None:
            import psutil as psutil_module
        system_ram = int(psutil_module.virtual_memory().total)
        limit = getattr(mx_module, "get_memory_limit", None)
        memory_limit = int(limit()) if limit is not None else 0

        if mx_module.metal.is_available():
            details = mx_module.metal.device_info()
            return cls(
                backend="metal",
                unified_memory=True,
                total_memory=system_ram,
                device_count=1,
                pin_memory=False,
                blas="metal",  # GEMMs run in MLX's own Metal kernels
                device_name=str(details.get("device_name") or details.get("architecture", "")),
                memory_limit=memory_limit,
            )
        if mx_module.cuda.is_available():
            details = mx_module.device_info(mx_module.gpu)
            device_memory = details.get("total_memory") or details.get("memory_size")
            if not device_memory:
                raise UnikernError(
                    f"MLX CUDA device_info() reports no total_memory (keys: {sorted(details)})"
                )
            return cls(
                backend="cuda",
                unified_memory=True,  # MLX allocates CUDA managed memory
                total_memory=int(device_memory),
                device_count=1,
                pin_memory=False,
                blas="cublas",
                device_name=str(details.get("device_name", "")),
                memory_limit=memory_limit,
            )
        details = mx_module.device_info(mx_module.cpu)
        return cls(
            backend="cpu",
            unified_memory=True,  # the CPU "device" is system RAM itself
            total_memory=system_ram,
            device_count=1,
            pin_memory=False,
            blas=blas.info().library,
            device_name=str(details.get("device_name", "")),
            memory_limit=memory_limit,
        )

    def kv_budget_bytes(
        self, memory_fraction: float, weights_bytes: int, activation_reserve_bytes: int
    ) -> int:
        """The KV pool's capacity ceiling: `fraction x total - weights - reserve`, the first
        term no more than MLX's memory limit (which the weights count against too)."""
        if not 0.0 < memory_fraction <= 1.0:
            raise ConfigError(f"memory_fraction must be in (0, 1], got {memory_fraction!r}")
        if weights_bytes < 0 or activation_reserve_bytes < 0:
            raise ConfigError(
                f"weights_bytes ({weights_bytes}) and activation_reserve_bytes "
                f"({activation_reserve_bytes}) must be >= 0"
            )
        usable = int(memory_fraction * self.total_memory)
        capped = 0 < self.memory_limit < usable
        if capped:
            usable = self.memory_limit
        budget = usable - weights_bytes - activation_reserve_bytes
        if budget <= 0:
            start = (f"MLX's memory limit {self.memory_limit} bytes (below memory_fraction {memory_fraction} x "
                     f"total_memory {self.total_memory})" if capped else
                     f"memory_fraction {memory_fraction} x total_memory {self.total_memory} = {usable} bytes")
            raise ConfigError(
                f"no memory left for the KV cache: {start}, minus weights {weights_bytes} and activation "
                f"reserve {activation_reserve_bytes} = {budget} bytes; "
                + ("raise MLX's limit (mx.set_memory_limit) or use a smaller model" if capped
                   else "raise memory_fraction or use a smaller model")
            )
        return budget

    def to_stats(self) -> dict[str, Any]:
        return msgspec.structs.asdict(self)
