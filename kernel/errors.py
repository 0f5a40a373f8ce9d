"""The error hierarchy: every failure a user can see is one of these."""

from __future__ import annotations


class UnikernError(Exception):
    """Base of every error unikern raises on purpose."""


class ConfigError(UnikernError):
    """A pipeline file, stage parameter or command-line option is wrong."""


class RequestError(UnikernError):
    """A request cannot be served as written (bad field, prompt too long, ...)."""

    def __init__(self, message: str, code: str = "bad_request") -> None:
        super().__init__(message)
        self.code = code


class StageError(UnikernError):
    """A stage failed while running; names the stage and the cause."""

    def __init__(self, stage: str, cause: BaseException | str) -> None:
        detail = cause if isinstance(cause, str) else f"{type(cause).__name__}: {cause}"
        super().__init__(f"stage {stage!r} failed: {detail}")
        self.stage = stage
        self.cause = cause


class DeviceMemoryError(UnikernError):
    """A model step asked the device for memory it did not have (MLX's allocator failed);
    the message says what MLX held then and which settings lower what the engine asks."""
