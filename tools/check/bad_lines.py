"""Protocol lines a worker must answer with exactly one error event each: random bytes,
truncated or mutated JSON, wrong values, unknown fields, huge numbers, deep nesting, and
requests that decode but the engine refuses. tools/check/load.py --mode bad-lines and
tools/check/fuzz.py --worker-lines interleave them with valid requests."""

from __future__ import annotations

import json
import random
from dataclasses import dataclass
from typing import Any

from unikern.frontends.protocol import ProtocolError, decode_op

HUGE_NUMBERS = ("1e400", "-1e400", "1e-400", "9" * 30, "-" + "9" * 30, "9" * 5000, "18446744073709551616", "1.7976931348623157e309", "0.0000001", "-0")


def encode(body: Any) -> bytes:
    return json.dumps(body, ensure_ascii=False).encode("utf-8", "surrogatepass")


@dataclass(frozen=True)
class BadLine:
    data: bytes  # no newline inside
    expected_id: str | None  # the `id` of the one error event it must get
    kind: str


SEMANTIC = (  # decode fine, refused by the engine: (body without id, needs a fresh id)
    ("vocab", {"op": "generate", "prompt_tokens": [1, 2, 99_999_999]}),
    ("empty_tokens", {"op": "generate", "prompt_tokens": []}),
    ("empty_prompt", {"op": "generate", "prompt": ""}),
    ("two_prompts", {"op": "generate", "prompt": "a", "prompt_tokens": [1]}),
    ("no_prompt", {"op": "generate", "max_tokens": 3}),
    ("no_messages", {"op": "generate", "messages": []}),
    ("too_long", {"op": "generate", "prompt_tokens": [7] * 40_000}),  # over any test model's context
    ("cancel_unknown", {"op": "cancel"}),
)
WRONG_VALUES = {
    "max_tokens": [0, -1, "5", 1e30, 10**30, True, None, [1]],
    "temperature": [-1, 101, "x", None, [0.5]],
    "top_p": [0, 2, -0.5, "1"],
    "seed": [-1, 2**64, 1.5, "7"],
    "prompt": [5, [], {}, True],
    "prompt_tokens": [[-1], [1.5], "abc", [2**40], [None]],
    "stop": ["", [""], 5, [5]],
    "messages": ["hi", [{}], [{"role": 1, "content": "x"}], [{"role": "user"}]],
    "id": [5, "", "x" * 300, None, ["a"]],
}


def bad_lines(rng: random.Random, count: int, id_prefix: str = "bad") -> list[BadLine]:
    """`count` lines that each must get exactly one error event (checked here with
    decode_op where the protocol alone refuses them)."""
    out: list[BadLine] = []
    while len(out) < count:
        n = len(out)
        kind = rng.choice(("bytes", "truncated", "wrong_value", "unknown_field", "huge", "nested", "semantic", "not_object", "flip"))
        rid = f"{id_prefix}-{n}"
        base = {"op": "generate", "id": rid, "prompt_tokens": [5, 6, 7], "max_tokens": 4}
        if kind == "semantic":
            label, body = rng.choice(SEMANTIC)
            out.append(BadLine(encode({**body, "id": rid}), rid, f"semantic:{label}"))
            continue
        if kind == "bytes":
            data = bytes(rng.randrange(256) for _ in range(rng.randint(1, 120)))
        elif kind == "truncated":
            full = encode(base)
            data = full[: rng.randint(1, len(full) - 1)]
        elif kind == "wrong_value":
            field = rng.choice(sorted(WRONG_VALUES))
            data = encode({**base, field: rng.choice(WRONG_VALUES[field])})
        elif kind == "unknown_field":
            data = encode({**base, rng.choice(("bogus", "Max_tokens", "")): 1})
        elif kind == "huge":
            field = rng.choice(("max_tokens", "seed", "temperature"))
            data = f'{{"op": "generate", "id": "{rid}", "prompt": "x", "{field}": {rng.choice(HUGE_NUMBERS[:6])}}}'.encode()
        elif kind == "nested":
            data = b"[" * rng.randint(1, 50_000)
        elif kind == "not_object":
            data = encode(rng.choice([[base], 5, "generate", None, 1.5, []]))
        else:
            data = bytearray(encode(base))
            data[rng.randrange(len(data))] ^= 1 << rng.randrange(8)
            data = bytes(data)
        data = data.replace(b"\n", b" ")
        if not data.strip():
            continue
        try:
            decode_op(data.strip())  # what the worker decodes
        except ProtocolError as exc:
            out.append(BadLine(data, exc.request_id, kind))
    return out
