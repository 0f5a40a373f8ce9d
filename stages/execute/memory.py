"""What the execute stage says when the device runs out of memory in a step: MLX's own
error ("cudaMallocAsync ... out of memory" on CUDA, "[metal::malloc] ..." on Metal) names
no setting, so it is raised again as DeviceMemoryError with what MLX held at the time and
the settings that lower what the engine asks for. Plain synchronous code."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import mlx.core as mx

from unikern.errors import DeviceMemoryError

GiB = 1 << 30

# how MLX's allocators word a failed allocation (CUDA, Metal, the CPU backend)
OUT_OF_MEMORY_MARKS = ("out of memory", "insufficient memory", "failed to allocate", "attempting to allocate")


def is_out_of_memory(exc: BaseException) -> bool:
    return isinstance(exc, RuntimeError) and any(mark in str(exc).lower() for mark in OUT_OF_MEMORY_MARKS)


def device_memory_error(exc: BaseException, pools: Iterable[Any] = ()) -> DeviceMemoryError:
    """`exc` (MLX's allocation failure in a step) as a DeviceMemoryError: MLX's active,
    cached and peak bytes and its memory limit, the committed bytes of the KV `pools` (a
    mixed model's windowed layers keep a pool of their own; None entries are skipped), and
    what to change."""

    def gib(value: float) -> str:
        return f"{value / GiB:.2f} GiB"

    held = [f"active {gib(mx.get_active_memory())}", f"cached {gib(mx.get_cache_memory())}",
            f"peak {gib(mx.get_peak_memory())}", f"limit {gib(mx.get_memory_limit())}"]
    committed = [pool.resident_bytes for pool in pools if pool is not None]
    if committed:
        held.append(f"KV pool committed {gib(sum(committed))}")
    return DeviceMemoryError(
        f"the device ran out of memory in a model step ({exc}); MLX held {', '.join(held)}. "
        "Other processes on the same device count too (nvidia-smi lists them). To ask for less: "
        "a smaller kv.memory_fraction or kv.kv_budget_bytes, fewer schedule.max_num_seqs or "
        "schedule.max_num_batched_tokens, or a lower MLX memory limit for this process "
        "(mx.set_memory_limit, which also caps the KV budget) so MLX frees its cache sooner"
    )
