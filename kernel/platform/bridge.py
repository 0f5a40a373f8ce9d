"""Zero-copy bridge: MLX owns the big buffers, torch and numpy view them; every view is
checked against the address MLX exports and every copy is counted, so a silent copy of a
large buffer cannot hide."""

from __future__ import annotations

import ctypes
import threading
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np
import structlog

from unikern.errors import RequestError, UnikernError

if TYPE_CHECKING:
    import mlx.core as mx
    import torch

__all__ = [
    "Bridge",
    "BridgeCopyError",
    "BridgeError",
    "LogitsProcessor",
    "apply_torch_logits_processors",
    "mlx_buffer",
]

log = structlog.get_logger()

# proc(token_ids, logits_row) returns the row's new values: the row itself (masked in
# place, no copy) or a float tensor of its shape (copied into it).
LogitsProcessor = Callable[[list[int], "torch.Tensor"], "torch.Tensor"]


class BridgeError(UnikernError):
    """An array cannot be viewed as asked (dtype, strides, device)."""


class BridgeCopyError(BridgeError):
    """A view turned out not to share memory, or strict mode refused a copy."""


# --------------------------------------------------------------------------- DLPack


class _DLDevice(ctypes.Structure):
    _fields_ = [("device_type", ctypes.c_int32), ("device_id", ctypes.c_int32)]


class _DLDataType(ctypes.Structure):
    _fields_ = [("code", ctypes.c_uint8), ("bits", ctypes.c_uint8), ("lanes", ctypes.c_uint16)]


class _DLTensor(ctypes.Structure):
    _fields_ = [
        ("data", ctypes.c_void_p),
        ("device", _DLDevice),
        ("ndim", ctypes.c_int32),
        ("dtype", _DLDataType),
        ("shape", ctypes.POINTER(ctypes.c_int64)),
        ("strides", ctypes.POINTER(ctypes.c_int64)),
        ("byte_offset", ctypes.c_uint64),
    ]


_capsule_pointer = ctypes.pythonapi.PyCapsule_GetPointer
_capsule_pointer.restype = ctypes.c_void_p
_capsule_pointer.argtypes = [ctypes.py_object, ctypes.c_char_p]


def mlx_buffer(a: mx.array) -> tuple[int, tuple[int, ...]]:
    """(address of element 0, strides in elements) as MLX exports them via DLPack.

    The capsule is not consumed: its destructor releases MLX's reference.
    """
    capsule = a.__dlpack__()
    tensor = _DLTensor.from_address(_capsule_pointer(capsule, b"dltensor"))
    ndim = tensor.ndim
    shape = tuple(tensor.shape[i] for i in range(ndim))
    if tensor.strides:
        strides = tuple(tensor.strides[i] for i in range(ndim))
    else:  # NULL strides mean compact row-major
        strides, step = [], 1
        for size in reversed(shape):
            strides.insert(0, step)
            step *= size
        strides = tuple(strides)
    return (tensor.data or 0) + tensor.byte_offset, strides


# --------------------------------------------------------------------------- Bridge


class Bridge:
    """Views MLX arrays from torch/numpy and imports torch tensors, counting every copy.

    Every view is checked: the torch tensor's `data_ptr()` (or the numpy array's data
    address) must equal the address MLX exports through DLPack, else `BridgeCopyError`.
    The one path that copies (`from_torch` when MLX cannot import without a copy, always
    the case on CPU in mlx 0.32) is counted and logged, or refused in strict mode.

    Lifetime: a view keeps the MLX buffer alive (torch through the DLPack deleter, numpy
    through the memoryview), so dropping the `mx.array` never frees memory under a view.
    While a view exists MLX does not donate the buffer to later ops (so in mlx 0.32.4).

    Writes through a view are seen by every MLX op evaluated afterwards (MLX reads the
    buffer, it does not cache values); arrays MLX evaluated before the write keep the old
    values, as for any input that changes after use.

    Strides: transposed and sliced arrays are viewed with their strides, zero-copy.
    Negative strides (`a[::-1]`) are refused for torch, which cannot represent them
    (passing them to `torch.from_dlpack` aborts the process in torch 2.x).
    """

    def __init__(self, strict: bool = False) -> None:
        self.strict = strict
        self._lock = threading.Lock()
        self._zero_copy_views = 0
        self._copies = 0

    @property
    def zero_copy_views(self) -> int:
        return self._zero_copy_views

    @property
    def copies(self) -> int:
        return self._copies

    def stats(self) -> dict[str, int]:
        with self._lock:
            return {"zero_copy_views": self._zero_copy_views, "copies": self._copies}

    def _count(self, *, view: bool) -> None:
        with self._lock:
            if view:
                self._zero_copy_views += 1
            else:
                self._copies += 1

    def to_torch(self, a: mx.array) -> torch.Tensor:
        """A torch tensor over `a`'s own memory (evaluates `a` first)."""
        import mlx.core as mx
        import torch

        mx.eval(a)
        address, strides = mlx_buffer(a)
        if any(stride < 0 for stride in strides):
            raise BridgeError(
                f"cannot view an MLX array with negative strides {strides} from torch "
                "(reversed slice); make it contiguous in MLX first (mx.contiguous)"
            )
        tensor = torch.from_dlpack(a)
        if tensor.data_ptr() != address or tuple(tensor.stride()) != strides:
            raise BridgeCopyError(
                f"torch.from_dlpack did not view the MLX buffer: data_ptr "
                f"{tensor.data_ptr():#x} strides {tuple(tensor.stride())}, MLX "
                f"{address:#x} strides {strides}"
            )
        self._count(view=True)
        return tensor

    def to_numpy(self, a: mx.array) -> np.ndarray:
        """A writable numpy array over `a`'s own memory, through the buffer protocol."""
        import mlx.core as mx

        mx.eval(a)
        address, _ = mlx_buffer(a)
        try:
            view = np.asarray(memoryview(a))
        except (ValueError, TypeError) as exc:
            raise BridgeError(
                f"numpy cannot view an MLX {a.dtype} array ({exc}); use to_torch"
            ) from exc
        if view.__array_interface__["data"][0] != address:
            raise BridgeCopyError(
                f"numpy view is at {view.__array_interface__['data'][0]:#x}, "
                f"MLX buffer at {address:#x}"
            )
        self._count(view=True)
        return view

    def from_torch(self, t: torch.Tensor, strict: bool | None = None) -> mx.array:
        """An MLX array with `t`'s values: zero-copy where MLX can import, else one copy."""
        import mlx.core as mx
        import torch

        try:
            imported = mx.from_dlpack(t, copy=False)
        except (ValueError, RuntimeError, TypeError) as exc:
            why = str(exc)
        else:
            address, _ = mlx_buffer(imported)
            if address != t.data_ptr():
                raise BridgeCopyError(
                    f"mx.from_dlpack(copy=False) gave {address:#x}, torch has {t.data_ptr():#x}"
                )
            self._count(view=True)
            return imported

        if self.strict if strict is None else strict:
            raise BridgeCopyError(
                f"from_torch would copy {t.numel() * t.element_size()} bytes "
                f"({tuple(t.shape)} {t.dtype} on {t.device}): {why}"
            )
        host = t.detach().cpu()
        if host.dtype == torch.bfloat16:  # numpy has no bfloat16: move the bits
            copied = mx.array(host.view(torch.int16).numpy()).view(mx.bfloat16)
        else:
            copied = mx.array(host.numpy())
        self._count(view=False)
        log.debug(
            "bridge.copy",
            shape=tuple(t.shape),
            dtype=str(t.dtype),
            nbytes=t.numel() * t.element_size(),
            reason=why,
        )
        return copied


# --------------------------------------------------------------------------- logits


def apply_torch_logits_processors(
    logits: mx.array,
    rows: Sequence[tuple[int, Sequence[LogitsProcessor], list[int]]],
    bridge: Bridge,
) -> dict[int, str]:
    """Run torch logits processors on rows of `logits` [batch, vocab], in place.

    One zero-copy view serves every row. A processor returns its row, or None, after
    masking it in place, or new values, which are written back into the row (the shared
    buffer, no copy of the batch). MLX ops evaluated afterwards see the new values.

    A processor that raises or returns anything else than None or a float tensor of the
    row's shape (a list, integers, a slice of the row) fails its own row only: the result maps
    each such row to a message naming the processor and what was wrong, and that row's
    later processors are skipped. Misuse by the caller still raises.
    """
    if not rows:
        return {}
    if logits.ndim != 2:
        raise BridgeError(f"logits must be 2-D [batch, vocab], got shape {tuple(logits.shape)}")
    view = bridge.to_torch(logits)
    batch, vocab = view.shape
    if any(
        stride == 0 and size > 1 for stride, size in zip(view.stride(), view.shape, strict=True)
    ):
        raise BridgeError(f"logits are broadcast (strides {view.stride()}): rows would alias")
    failed: dict[int, str] = {}
    for row_index, processors, token_ids in rows:
        if not 0 <= row_index < batch:
            raise RequestError(f"logits row {row_index} out of range for batch {batch}")
        row = view[row_index]
        for processor in processors:
            name = getattr(processor, "__qualname__", None) or repr(processor)
            try:
                result: Any = processor(token_ids, row)
                if result is None:  # masked in place, the zero-copy way
                    continue
                _check_processor_output(result, row)
                if result.data_ptr() != row.data_ptr() or result.stride() != row.stride():
                    row.copy_(result)
            except Exception as exc:  # the user's code: its failure is its request's
                failed[row_index] = f"logits processor {name} failed: {type(exc).__name__}: {exc}"
                break
    return failed


def _check_processor_output(result: Any, row: torch.Tensor) -> None:
    """Raise unless `result` is a float tensor of the row's shape: host-side metadata
    only (a NaN-only row is caught with the others on the device, `row_is_usable`)."""
    import torch

    expected = f"a float tensor of shape {tuple(row.shape)}"
    if not isinstance(result, torch.Tensor):
        raise TypeError(f"returned {type(result).__name__}, expected {expected} (or None when masked in place)")
    if tuple(result.shape) != tuple(row.shape):
        raise ValueError(f"returned shape {tuple(result.shape)}, expected {expected}")
    if not result.is_floating_point():
        raise TypeError(f"returned dtype {result.dtype}, expected {expected}")
