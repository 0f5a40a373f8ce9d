"""HTTP errors, and their bodies in OpenAI's and in Anthropic's JSON shape."""

from __future__ import annotations

import re
from typing import Any

import msgspec

# status -> (OpenAI error type, Anthropic error type)
_TYPES = {
    400: ("invalid_request_error", "invalid_request_error"),
    401: ("invalid_request_error", "authentication_error"),
    404: ("invalid_request_error", "not_found_error"),
    405: ("invalid_request_error", "invalid_request_error"),
    413: ("invalid_request_error", "request_too_large"),
    429: ("rate_limit_exceeded", "rate_limit_error"),
    500: ("server_error", "api_error"),
    503: ("server_error", "overloaded_error"),
}

# engine error codes (RequestError.code, ErrorEvent.code) -> HTTP status
_ENGINE_STATUS = {
    "bad_request": 400,
    "prompt_too_long": 400,
    "duplicate_id": 400,
    "overloaded": 429,
}
_OPENAI_CODES = {"prompt_too_long": "context_length_exceeded"}


class APIError(Exception):
    """A request's failure as the client sees it: status, message and the field at fault."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.headers = headers or {}

    def openai_body(self) -> dict[str, Any]:
        kind = _TYPES.get(self.status, _TYPES[500])[0]
        return {"error": {"message": self.message, "type": kind, "param": self.param, "code": self.code}}

    def anthropic_body(self) -> dict[str, Any]:
        kind = _TYPES.get(self.status, _TYPES[500])[1]
        return {"type": "error", "error": {"type": kind, "message": self.message}}


def from_engine(code: str, message: str, *, retry_after_seconds: int = 1) -> APIError:
    """An engine failure (a RequestError raised at submit, or an ErrorEvent) as an APIError."""
    status = _ENGINE_STATUS.get(code, 500)
    headers = {"Retry-After": str(retry_after_seconds)} if status == 429 else None
    return APIError(status, message, param=_leading_field(message), code=_OPENAI_CODES.get(code, code), headers=headers)


def from_validation(exc: msgspec.ValidationError | msgspec.DecodeError) -> APIError:
    """A body msgspec refused: name the field from its `$.path`."""
    text = str(exc)
    found = re.search(r" - at `\$\.?([^`]*)`", text)
    param = found.group(1) if found and found.group(1) else None
    if isinstance(exc, msgspec.DecodeError) and not isinstance(exc, msgspec.ValidationError):
        return APIError(400, f"the body is not valid JSON: {text}")
    return APIError(400, text.replace("Object missing required field", "missing required field"), param=param)


def _leading_field(message: str) -> str | None:
    """`temperature must be ...` -> `temperature`: the engine names the field first."""
    found = re.match(r"([a-z_]+)(\[[^\]]*\])?(:| must| is)", message)
    return found.group(1) if found else None
