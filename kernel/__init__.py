"""unikern: an LLM inference engine for unified-memory machines, as an async microkernel."""

from __future__ import annotations

try:  # load an optimized BLAS before anything imports mlx (see unikern.platform.blas)
    from unikern.platform import blas as _blas

    _blas.preload()
except ImportError:  # pragma: no cover - blas.py arrives with the platform layer
    pass

from unikern.engine import Completion, Engine
from unikern.errors import ConfigError, RequestError, StageError, UnikernError
from unikern.messages import DoneEvent, ErrorEvent, TokenEvent, Usage

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
