"""Which cache kinds may start from uncommitted (unwritten) memory and which must be zeroed,
so that memory is zeroed only where a never-written value could reach an output."""

from __future__ import annotations

from typing import Any

# attention KV is masked past each sequence's length, so a never-written slot can never
# reach an output (tests/test_parity.py fills the pool's unwritten slots with NaN and gets
# identical tokens)
MASKED_KINDS = frozenset(
    {"KVCache", "BatchKVCache", "RotatingKVCache", "BatchRotatingKVCache", "ChunkedKVCache", "ConcatenateKVCache"}
)
# recurrent state (SSM / Mamba `ArraysCache`) and quantized "mixed precision" caches read
# every element of their state at every step: they must start at zero
ZEROED_KINDS = frozenset({"ArraysCache", "MambaCache", "QuantizedKVCache"})


def cache_kind(cache: Any) -> str:
    return cache if isinstance(cache, str) else type(cache).__name__


def needs_zeroing(cache: Any) -> bool:
    """True unless the kind is known to be masked; an unknown kind is zeroed to be safe."""
    return cache_kind(cache) not in MASKED_KINDS


def new_state(shape: tuple[int, ...], dtype: Any, kind: Any, fill: float = 0.0):
    """Memory for a cache of `kind`: zeros where the kind needs them; otherwise `fill`
    (what the bytes hold does not matter, which tests prove with NaN)."""
    import mlx.core as mx

    return mx.zeros(shape, dtype=dtype) if needs_zeroing(kind) else mx.full(shape, fill, dtype=dtype)
