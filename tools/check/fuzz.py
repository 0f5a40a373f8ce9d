"""Fuzzers for the worker protocol and for pipeline files.

The same generators serve the bounded tests (`tests/test_fuzz.py`) and longer runs here:

    python -m tools.check.fuzz --examples 20000            # the in-process properties
    python -m tools.check.fuzz --worker-lines 5000 --model DIR   # one worker fed fuzzed lines

Properties checked:
- `decode_op` on any bytes returns an op or raises ProtocolError, nothing else; what it
  returns survives an encode/decode round trip.
- `parse_pipeline` on any text (and `--set` overrides) returns a spec or raises
  PipelineErrors whose every problem names a path (`$...` or `--set ...`); a spec it
  returns converts into each stage's Params.
- `--worker-lines`: a worker fed tools/check/bad_lines.py's lines between valid requests
  answers each with one error event, with the id the worker can know
  (`BadLine.expected_id`).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from importlib import resources
from typing import Any

import msgspec
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tools.check.bad_lines import HUGE_NUMBERS, encode
from unikern.errors import ConfigError
from unikern.frontends.protocol import CancelOp, GenerateOp, ProtocolError, StatsOp, decode_op
from unikern.spec import PipelineErrors, PipelineSpec, parse_overrides, parse_pipeline

# ---- protocol lines -----------------------------------------------------------------

GENERATE_FIELDS = ("id", "prompt", "prompt_tokens", "messages", "max_tokens", "temperature", "top_p", "seed", "stop")
OP_FIELDS = {"generate": ("op", *GENERATE_FIELDS), "cancel": ("op", "id"), "stats": ("op",)}

ids = st.text(min_size=1, max_size=20)
json_scalars = (
    st.none() | st.booleans() | st.integers() | st.integers(min_value=2**62, max_value=2**80)
    | st.floats(allow_nan=False, allow_infinity=False) | st.text(max_size=20)
)
json_values = st.recursive(
    json_scalars,
    lambda inner: st.lists(inner, max_size=4)
    | st.dictionaries(st.sampled_from(GENERATE_FIELDS) | st.text(max_size=8), inner, max_size=4),
    max_leaves=12,
)


@st.composite
def valid_ops(draw) -> dict[str, Any]:
    """A request the protocol accepts (the engine may still refuse, e.g. a token id)."""
    op = draw(st.sampled_from(("generate", "generate", "cancel", "stats")))
    if op == "stats":
        return {"op": "stats"}
    if op == "cancel":
        return {"op": "cancel", "id": draw(ids)}
    body: dict[str, Any] = {"op": "generate", "id": draw(ids)}
    source = draw(st.sampled_from(("prompt", "prompt_tokens", "messages")))
    if source == "prompt":
        body["prompt"] = draw(st.text(max_size=30))
    elif source == "prompt_tokens":
        body["prompt_tokens"] = draw(st.lists(st.integers(0, 2**31 - 1), max_size=8))
    else:
        body["messages"] = draw(st.lists(st.fixed_dictionaries({"role": st.text(max_size=8), "content": st.text(max_size=20)}), max_size=3))
    optional = {
        "max_tokens": st.integers(1, 1_000_000),
        "temperature": st.floats(0.0, 100.0),
        "top_p": st.floats(0.0, 1.0, exclude_min=True),
        "seed": st.none() | st.integers(0, 2**63 - 1),
        "stop": st.none() | st.text(min_size=1, max_size=5) | st.lists(st.text(min_size=1, max_size=5), max_size=3),
    }
    for name, strategy in optional.items():
        if draw(st.booleans()):
            body[name] = draw(strategy)
    return body


@st.composite
def mutated_ops(draw) -> dict[str, Any]:
    """A valid op with fields removed, replaced by any JSON value, or added."""
    body = dict(draw(valid_ops()))
    for _ in range(draw(st.integers(1, 3))):
        action = draw(st.sampled_from(("remove", "replace", "add")))
        if action == "remove" and body:
            body.pop(draw(st.sampled_from(sorted(body))))
        elif action == "replace":
            body[draw(st.sampled_from(OP_FIELDS["generate"]))] = draw(json_values)
        else:
            body[draw(st.text(max_size=8))] = draw(json_values)
    return body


@st.composite
def huge_number_lines(draw) -> bytes:
    field = draw(st.sampled_from(("max_tokens", "temperature", "top_p", "seed", "prompt_tokens", "id")))
    number = draw(st.sampled_from(HUGE_NUMBERS))
    value = f"[{number}]" if field == "prompt_tokens" else number
    return f'{{"op": "generate", "id": "n", "prompt": "x", "{field}": {value}}}'.encode()


@st.composite
def nested_lines(draw) -> bytes:
    depth = draw(st.integers(1, 200_000))
    opener, closer = draw(st.sampled_from((("[", "]"), ('{"a":', "}"), ('{"op": "generate", "id": "d", "prompt": [', "]}"))))
    balanced = draw(st.booleans())
    return (opener * depth + ("1" + closer * depth if balanced else "")).encode()


@st.composite
def byte_mutations(draw) -> bytes:
    data = bytearray(encode(draw(valid_ops())))
    for _ in range(draw(st.integers(1, 4))):
        i = draw(st.integers(0, max(len(data) - 1, 0)))
        action = draw(st.sampled_from(("flip", "insert", "delete", "truncate")))
        if action == "flip" and data:
            data[i] ^= 1 << draw(st.integers(0, 7))
        elif action == "insert":
            data[i:i] = draw(st.binary(min_size=1, max_size=4))
        elif action == "delete" and data:
            del data[i]
        else:
            del data[i:]
    return bytes(data)


protocol_lines = st.one_of(
    st.binary(max_size=300),
    valid_ops().map(encode),
    mutated_ops().map(encode),
    byte_mutations(),
    huge_number_lines(),
    nested_lines(),
    json_values.map(encode),
)


def check_decode_op(line: bytes) -> Any:
    """The property: an op (that round-trips) or a ProtocolError; nothing else escapes."""
    try:
        op = decode_op(line)
    except ProtocolError as exc:
        assert str(exc).strip(), f"empty message for {line[:80]!r}"
        assert exc.request_id is None or isinstance(exc.request_id, str)
        return exc
    assert isinstance(op, (GenerateOp, CancelOp, StatsOp)), op
    assert decode_op(msgspec.json.encode(op)) == op
    return op


# ---- pipeline files -----------------------------------------------------------------

BUILTIN_TEXT = resources.files("unikern.pipelines").joinpath("generate.yaml").read_text("utf-8")
BUILTIN = yaml.safe_load(BUILTIN_TEXT)
STAGE_TYPES = ("tokenize", "schedule", "kv_manager", "mlx_execute", "output")
PARAM_NAMES = sorted({k for body in BUILTIN["stages"].values() for k in body} | {"model", "memory_fraction", "kv_budget_bytes", "decode_lookahead", "max_prompt_tokens", "slab_bytes", "seed", "wire_weights", "unwritten_fill"})
YAML_PIECES = [*"abcdestype:-[]{}&*!|>#'\",?%@` \n\t0123456789._~", "stages:", "type: ", "  ", "\n  ", "\n    ", "name: ", "*a", "&a ", "tokenize", "schedule"]
YAMLISH = st.lists(st.sampled_from(YAML_PIECES), max_size=80).map("".join)


@st.composite
def mutated_builtin(draw) -> str:
    """The built-in pipeline with keys removed, values replaced, stages renamed or added."""
    doc = json.loads(json.dumps(BUILTIN))
    for _ in range(draw(st.integers(1, 4))):
        stage = draw(st.sampled_from(sorted(doc["stages"]) or ["tokenize"]))
        body = doc["stages"].get(stage)
        action = draw(st.sampled_from(("drop_stage", "drop_key", "set_param", "set_type", "rename", "add_stage", "top_level", "stage_value")))
        if action == "drop_stage":
            doc["stages"].pop(stage, None)
        elif action == "drop_key" and isinstance(body, dict) and body:
            body.pop(draw(st.sampled_from(sorted(body))))
        elif action == "set_param" and isinstance(body, dict):
            body[draw(st.sampled_from(PARAM_NAMES) | st.text(max_size=6))] = draw(json_values)
        elif action == "set_type" and isinstance(body, dict):
            body["type"] = draw(st.sampled_from(STAGE_TYPES) | json_values)
        elif action == "rename" and stage in doc["stages"]:
            doc["stages"][draw(st.text(max_size=8))] = doc["stages"].pop(stage)
        elif action == "add_stage":
            doc["stages"][draw(st.text(max_size=8))] = {"type": draw(st.sampled_from(STAGE_TYPES))}
        elif action == "top_level":
            doc[draw(st.sampled_from(("name", "description", "stages", "extra")))] = draw(json_values)
            if not isinstance(doc.get("stages"), dict):
                return yaml.safe_dump(doc)
        else:
            doc["stages"][stage] = draw(json_values)
    return yaml.safe_dump(doc, allow_unicode=True)


pipeline_texts = st.one_of(
    YAMLISH,
    st.text(max_size=200),
    json_values.map(lambda v: yaml.safe_dump(v, allow_unicode=True)),
    mutated_builtin(),
    st.tuples(st.just(BUILTIN_TEXT), st.integers(0, len(BUILTIN_TEXT))).map(lambda t: t[0][: t[1]]),
)

override_items = st.one_of(
    st.text(max_size=30),
    st.builds(
        lambda stage, key, value: f"{stage}.{key}={value}",
        st.sampled_from([*BUILTIN["stages"], "nosuch"]) | st.text(max_size=6),
        st.sampled_from(PARAM_NAMES) | st.text(max_size=6),
        st.sampled_from(["", "0", "-1", "1e400", "[1, 2]", "{a: 1}", "null", "true", "x", "0.5", "&a [*a]", "'"]) | st.text(max_size=10),
    ),
)


def check_parse_pipeline(text: str, assignments: list[str] | None = None) -> PipelineSpec | PipelineErrors:
    """The property: a spec whose params convert, or PipelineErrors naming paths."""
    try:
        overrides = parse_overrides(assignments or [])
        spec = parse_pipeline(text, overrides=overrides)
    except PipelineErrors as exc:
        assert exc.problems, exc
        for problem in exc.problems:
            assert problem.startswith(("$", "--set")) or problem.startswith("not valid YAML"), problem
        return exc
    except ConfigError as exc:  # only PipelineErrors is expected; name the gap plainly
        raise AssertionError(f"a ConfigError that is not PipelineErrors: {exc}") from exc
    for name, cls in spec.stage_classes().items():
        msgspec.convert(spec.stages[name].params, cls.Params)
    return spec


# ---- command line -------------------------------------------------------------------

HEALTH = [HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.filter_too_much]


def run_properties(examples: int) -> None:
    cfg = settings(max_examples=examples, deadline=None, suppress_health_check=HEALTH, database=None)

    @given(protocol_lines)
    def decode_op_property(line: bytes) -> None:
        check_decode_op(line)

    @given(pipeline_texts, st.lists(override_items, max_size=3))
    def parse_pipeline_property(text: str, assignments: list[str]) -> None:
        check_parse_pipeline(text, assignments)

    checks = {"decode_op": decode_op_property, "parse_pipeline": parse_pipeline_property}
    for name, check in checks.items():
        started = time.monotonic()
        cfg(check)()
        print(f"{name}: {examples} examples, no failure ({time.monotonic() - started:.1f} s)")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--examples", type=int, default=5000, help="hypothesis examples per property")
    parser.add_argument("--worker-lines", type=int, default=0, help="also feed a worker this many bad lines")
    parser.add_argument("--model", help="model directory for the worker run (default: tiny-llama)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    if args.examples:
        run_properties(args.examples)
    if args.worker_lines:
        from tools.check.load import run_bad_lines  # the same check as load.py --mode bad-lines

        model = args.model
        if model is None:
            from unikern.testing.modelgen import cached_model

            model = str(cached_model("tiny-llama"))
        summary = run_bad_lines(model, num_bad=args.worker_lines, num_valid=max(args.worker_lines // 10, 10), seed=args.seed, sets=[])
        return 0 if summary["passed"] else 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
