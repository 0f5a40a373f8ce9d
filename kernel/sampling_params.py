"""Checking a request's sampling fields at the front door, with messages that name the
field, the value and what would be valid; the result is the message's SamplingParams."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

from unikern.errors import RequestError
from unikern.messages import SamplingParams

MAX_TOP_LOGPROBS = 20
RESPONSE_FORMATS = ("text", "json_object", "json_schema", "regex", "grammar")


def _number(name: str, value: Any, low: float, high: float, *, open_low: bool = False) -> float:
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
    if ok:
        ok = (value > low if open_low else value >= low) and value <= high
    if not ok:
        bracket = "(" if open_low else "["
        raise RequestError(f"{name} must be a number in {bracket}{low}, {high}], got {value!r}")
    return float(value)


def _integer(name: str, value: Any, low: int, high: int) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or not low <= value <= high:
        raise RequestError(f"{name} must be an integer in [{low}, {high}], got {value!r}")
    return value


def _logit_bias(value: Mapping[Any, Any] | None) -> tuple[tuple[int, float], ...]:
    if not value:
        return ()
    if not isinstance(value, Mapping):
        raise RequestError(f"logit_bias must map token ids to biases, got {type(value).__name__}")
    pairs = {}
    for key, bias in value.items():
        try:
            token = int(key)
        except (TypeError, ValueError):
            raise RequestError(f"logit_bias: key {key!r} is not a token id") from None
        if token < 0:
            raise RequestError(f"logit_bias: token id {token} is negative")
        pairs[token] = _number(f"logit_bias[{key!r}]", bias, -100.0, 100.0)
    return tuple(sorted(pairs.items()))


def _response_format(value: Any) -> dict[str, Any] | None:
    if value is None:
        return None
    if not isinstance(value, Mapping) or value.get("type") not in RESPONSE_FORMATS:
        raise RequestError(
            f"response_format must be an object whose type is one of {', '.join(RESPONSE_FORMATS)}, got {value!r}"
        )
    kind = value["type"]
    if kind == "text":
        return None
    need = {"json_schema": "json_schema", "regex": "pattern", "grammar": "grammar"}.get(kind)
    if need is not None and need not in value:
        raise RequestError(f"response_format of type {kind!r} needs the field {need!r}")
    if kind == "json_schema" and not isinstance(value["json_schema"], Mapping):
        raise RequestError("response_format.json_schema must be an object with a `schema`")
    return dict(value)


def sampling_params(
    *,
    max_tokens: int = 256,
    temperature: float = 0.0,
    top_p: float = 1.0,
    top_k: int = 0,
    min_p: float = 0.0,
    seed: int | None = None,
    stop: str | Sequence[str] | None = (),
    repetition_penalty: float = 1.0,
    presence_penalty: float = 0.0,
    frequency_penalty: float = 0.0,
    logit_bias: Mapping[Any, float] | None = None,
    logprobs: bool = False,
    top_logprobs: int = 0,
    response_format: Mapping[str, Any] | None = None,
    prompt_logprobs: int | None = None,
) -> SamplingParams:
    """Validated SamplingParams; RequestError (code bad_request) names the first bad field.
    max_tokens may be 0 (the prompt's log-probabilities alone) only with prompt_logprobs."""
    if prompt_logprobs is not None:
        prompt_logprobs = _integer("prompt_logprobs", prompt_logprobs, 0, MAX_TOP_LOGPROBS)
    least = 0 if prompt_logprobs is not None else 1
    if not isinstance(max_tokens, int) or isinstance(max_tokens, bool) or max_tokens < least:
        raise RequestError(f"max_tokens must be an integer >= 1 (or 0 with prompt_logprobs), got {max_tokens!r}")
    if seed is not None:
        _integer("seed", seed, 0, 2**63 - 1)
    if stop is None:
        stop = ()
    if isinstance(stop, str):
        stop = (stop,)
    if any(not isinstance(s, str) or not s for s in stop):
        raise RequestError(f"stop must be a list of non-empty strings, got {stop!r}")
    if not isinstance(logprobs, bool):
        raise RequestError(f"logprobs must be true or false, got {logprobs!r}")
    top_logprobs = _integer("top_logprobs", top_logprobs, 0, MAX_TOP_LOGPROBS)
    return SamplingParams(
        temperature=_number("temperature", temperature, 0.0, 100.0),
        top_p=_number("top_p", top_p, 0.0, 1.0, open_low=True),
        seed=seed,
        max_tokens=max_tokens,
        stop=tuple(stop),
        top_k=_integer("top_k", top_k, 0, 2**31 - 1),
        min_p=_number("min_p", min_p, 0.0, 1.0),
        repetition_penalty=_number("repetition_penalty", repetition_penalty, 0.0, 10.0, open_low=True),
        presence_penalty=_number("presence_penalty", presence_penalty, -2.0, 2.0),
        frequency_penalty=_number("frequency_penalty", frequency_penalty, -2.0, 2.0),
        logit_bias=_logit_bias(logit_bias),
        logprobs=logprobs or top_logprobs > 0,
        top_logprobs=top_logprobs,
        response_format=_response_format(response_format),
        prompt_logprobs=prompt_logprobs,
    )
