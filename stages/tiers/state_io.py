"""Recurrent-state checkpoints as contiguous payloads: one slot of every state array of every
recurrent layer, copied between the state pool and a buffer (the disk payload) through
zero-copy views of the pool's own arrays, and the key a checkpoint is filed under."""

from __future__ import annotations

import hashlib
import math
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass

import mlx.core as mx
import numpy as np

from unikern.platform.bridge import Bridge, BridgeCopyError, mlx_buffer
from unikern.stages.kv.state_pool import StatePool

STATE_KEY_BYTES = 16


@dataclass(frozen=True)
class StateLayout:
    """Per state array, layers in order: (shape without the slot axis, dtype name, itemsize).

    A checkpoint's payload is every array's slot row, one after the other. The header
    records one dtype and a flat shape: the arrays' dtype when they share one (so byte
    shuffling still sees whole elements), else bytes."""

    arrays: tuple[tuple[tuple[int, ...], str, int], ...]

    @classmethod
    def of(cls, states: StatePool) -> StateLayout:
        return cls(tuple(
            (tuple(shape), str(dtype).rsplit(".", 1)[-1], dtype.size)
            for layer in states.layer_states for shape, dtype in layer
        ))

    @property
    def row_bytes(self) -> list[int]:
        return [math.prod(shape) * itemsize for shape, _, itemsize in self.arrays]

    @property
    def nbytes(self) -> int:
        return sum(self.row_bytes)

    @property
    def dtype(self) -> str:
        names = {name for _, name, _ in self.arrays}
        return names.pop() if len(names) == 1 else "uint8"

    @property
    def shape(self) -> tuple[int]:
        itemsize = self.arrays[0][2] if self.dtype != "uint8" else 1
        return (self.nbytes // itemsize,)

    def new_buffer(self) -> np.ndarray:
        return np.empty(self.nbytes, np.uint8)

    def key(self, block_hash: bytes) -> bytes:
        """The disk key of the checkpoint after the block named `block_hash`. The chained
        hash already names the model and the block size; the layout makes a checkpoint of
        another state layout a miss, never a wrong load, and keys never meet KV keys."""
        h = hashlib.blake2b(digest_size=STATE_KEY_BYTES, person=b"unikern-state-v1")
        h.update(repr(self.arrays).encode())
        h.update(block_hash)
        return h.digest()


@contextmanager
def state_views(states: StatePool, bridge: Bridge) -> Iterator[list[np.ndarray]]:
    """Per state array (layers in order), a writable byte view [slots, row bytes] of the
    pool's own memory; dropped on exit. Model thread only, as `block_io.pool_views`."""
    views: list[np.ndarray] = []
    try:
        for arrays in states.arrays:
            for array in arrays:
                mx.eval(array)
                as_bytes = array.view(mx.uint8)
                view = bridge.to_numpy(as_bytes)
                if view.__array_interface__["data"][0] != mlx_buffer(array)[0] or not view.flags.c_contiguous:
                    raise BridgeCopyError("a state pool view is not the pool's own contiguous memory")
                views.append(view.reshape(view.shape[0], -1))
                del as_bytes
        yield views
    finally:
        views.clear()


def copy_state_out(states: StatePool, bridge: Bridge, slots: Sequence[int], buffers: Sequence[np.ndarray]) -> None:
    """Copy each checkpoint slot's state into its buffer (layout `StateLayout.of(states)`)."""
    sizes = StateLayout.of(states).row_bytes
    with state_views(states, bridge) as views:
        for slot, buffer in zip(slots, buffers, strict=True):
            offset = 0
            for view, size in zip(views, sizes, strict=True):
                buffer[offset : offset + size] = view[slot]
                offset += size


def copy_state_in(states: StatePool, bridge: Bridge, slots: Sequence[int], buffers: Sequence[np.ndarray]) -> None:
    """Write each buffer into its checkpoint slot, growing the state pool first."""
    if not slots:
        return
    states.ensure_capacity(max(slots) + 1)
    sizes = StateLayout.of(states).row_bytes
    with state_views(states, bridge) as views:
        for slot, buffer in zip(slots, buffers, strict=True):
            offset = 0
            for view, size in zip(views, sizes, strict=True):
                view[slot] = buffer[offset : offset + size]
                offset += size
