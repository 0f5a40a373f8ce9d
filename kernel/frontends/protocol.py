"""The worker's NDJSON protocol: request ops in, events out (DESIGN.md section 3)."""

from __future__ import annotations

from typing import Annotated, Any

import msgspec

Meta = msgspec.Meta


class ChatMessage(msgspec.Struct, forbid_unknown_fields=True):
    role: str
    content: str


class GenerateOp(msgspec.Struct, tag="generate", tag_field="op", forbid_unknown_fields=True):
    id: Annotated[str, Meta(min_length=1, max_length=256)]
    prompt: str | None = None
    prompt_tokens: list[Annotated[int, Meta(ge=0, lt=2**31)]] | None = None
    messages: list[ChatMessage] | None = None
    max_tokens: Annotated[int, Meta(ge=0, le=1_000_000)] = 256  # 0: with prompt_logprobs only
    temperature: Annotated[float, Meta(ge=0.0, le=100.0)] = 0.0
    top_p: Annotated[float, Meta(gt=0.0, le=1.0)] = 1.0
    seed: Annotated[int, Meta(ge=0, le=2**63 - 1)] | None = None
    stop: list[Annotated[str, Meta(min_length=1)]] | Annotated[str, Meta(min_length=1)] | None = None
    top_k: Annotated[int, Meta(ge=0, lt=2**31)] = 0
    min_p: Annotated[float, Meta(ge=0.0, le=1.0)] = 0.0
    repetition_penalty: Annotated[float, Meta(gt=0.0, le=10.0)] = 1.0
    presence_penalty: Annotated[float, Meta(ge=-2.0, le=2.0)] = 0.0
    frequency_penalty: Annotated[float, Meta(ge=-2.0, le=2.0)] = 0.0
    logit_bias: dict[str, Annotated[float, Meta(ge=-100.0, le=100.0)]] | None = None
    logprobs: bool = False
    top_logprobs: Annotated[int, Meta(ge=0, le=20)] = 0
    response_format: dict[str, Any] | None = None
    # the prompt's log-probabilities with this many alternatives each, on the done event
    prompt_logprobs: Annotated[int, Meta(ge=0, le=20)] | None = None

    def sampling(self) -> dict[str, Any]:
        """The fields Engine.generate takes as sampling keywords."""
        return {name: getattr(self, name) for name in SAMPLING_FIELDS}


SAMPLING_FIELDS = (
    "max_tokens", "temperature", "top_p", "seed", "stop", "top_k", "min_p", "repetition_penalty",
    "presence_penalty", "frequency_penalty", "logit_bias", "logprobs", "top_logprobs", "response_format",
    "prompt_logprobs",
)


class CancelOp(msgspec.Struct, tag="cancel", tag_field="op", forbid_unknown_fields=True):
    id: str


class StatsOp(msgspec.Struct, tag="stats", tag_field="op", forbid_unknown_fields=True):
    pass


Op = GenerateOp | CancelOp | StatsOp
OPS = ("generate", "cancel", "stats")

_decoder = msgspec.json.Decoder(Op)
_any_decoder = msgspec.json.Decoder()
_encoder = msgspec.json.Encoder()


class ProtocolError(Exception):
    def __init__(self, message: str, request_id: str | None = None) -> None:
        super().__init__(message)
        self.request_id = request_id


def decode_op(line: bytes) -> Op:
    """Parse one request line; ProtocolError says what is wrong (and the id, if any)."""
    try:
        text = line.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ProtocolError(f"the line is not valid UTF-8 (byte {exc.start})") from None
    try:
        raw = _any_decoder.decode(text)
    except msgspec.DecodeError as exc:
        raise ProtocolError(f"not valid JSON: {exc}", _salvage_id(text)) from None
    except RecursionError:
        raise ProtocolError("not valid JSON: nested too deeply") from None
    request_id = raw.get("id") if isinstance(raw, dict) and isinstance(raw.get("id"), str) else None
    if not isinstance(raw, dict):
        raise ProtocolError(f"expected a JSON object with an `op` ({', '.join(OPS)}), got {type(raw).__name__}")
    op = raw.get("op")
    if op not in OPS:
        raise ProtocolError(f"unknown op {op!r}; valid ops: {', '.join(OPS)}", request_id)
    try:
        return _decoder.decode(text)
    except msgspec.ValidationError as exc:
        raise ProtocolError(_explain(exc), request_id) from None


def _salvage_id(text: str) -> str | None:
    """The request id of a line msgspec refused but Python's json may still read
    (e.g. a number out of float range), so the error can name its request."""
    import json

    try:
        raw = json.loads(text)
    except (ValueError, RecursionError):
        return None
    value = raw.get("id") if isinstance(raw, dict) else None
    return value if isinstance(value, str) else None


def _explain(exc: msgspec.ValidationError) -> str:
    text = str(exc)
    if "Object contains unknown field" in text:
        return text.replace("Object contains unknown field", "unknown field")
    return text


def encode_event(event: Any) -> bytes:
    return _encoder.encode(event) + b"\n"
