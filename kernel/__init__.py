"""unikern: an LLM inference engine for unified-memory machines, as an async microkernel."""

from __future__ import annotations

# before anything imports mlx: load an optimized BLAS (see unikern.platform.blas), and
# keep MLX's compiled GPU kernels under the user's cache dir (unikern.platform.kernel_cache)
from unikern.platform import blas as _blas
from unikern.platform import kernel_cache as _kernel_cache

_blas.preload()
_kernel_cache.configure()

from unikern.engine import Completion, Engine  # noqa: E402 (after the two calls above)
from unikern.errors import ConfigError, RequestError, StageError, UnikernError  # noqa: E402
from unikern.messages import DoneEvent, ErrorEvent, TokenEvent, Usage  # noqa: E402

__all__ = [
    "Completion",
    "ConfigError",
    "DoneEvent",
    "Engine",
    "ErrorEvent",
    "RequestError",
    "StageError",
    "TokenEvent",
    "UnikernError",
    "Usage",
]
__version__ = "0.1.0"
