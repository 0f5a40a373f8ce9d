"""Fuzzing the worker protocol and pipeline files, with a bounded budget (issue 6).

The generators live in `tools/check/fuzz.py`, which runs the same properties for longer. Here:
`decode_op` and `parse_pipeline` in-process (hypothesis, ~200 examples each), every op
with every subset of its fields missing, and one worker subprocess fed a few hundred
fuzzed lines between valid requests.
"""

from __future__ import annotations

import itertools
import json
import os
import random
import time
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tools.check import fuzz
from tools.check.bad_lines import bad_lines
from tools.check.worker_client import WorkerClient
from unikern.errors import ConfigError
from unikern.frontends.protocol import CancelOp, GenerateOp, ProtocolError, StatsOp, decode_op
from unikern.frontends.worker import OversizeLine, read_lines
from unikern.spec import PipelineErrors, load_pipeline, parse_pipeline

BOUNDED = settings(max_examples=200, deadline=None, suppress_health_check=fuzz.HEALTH, database=None)

# ---- decode_op ----------------------------------------------------------------------


@BOUNDED
@given(fuzz.protocol_lines)
def test_decode_op_returns_an_op_or_raises_protocol_error(line: bytes) -> None:
    fuzz.check_decode_op(line)


@BOUNDED
@given(fuzz.valid_ops())
def test_valid_ops_round_trip(body: dict) -> None:
    op = decode_op(fuzz.encode(body))
    assert type(op) is {"generate": GenerateOp, "cancel": CancelOp, "stats": StatsOp}[body["op"]]
    for field, value in body.items():
        if field != "op":
            got = getattr(op, field)
            if field == "messages":
                got = [{"role": m.role, "content": m.content} for m in got]
            assert got == value, field
    assert fuzz.check_decode_op(fuzz.encode(body)) == op


@pytest.mark.parametrize("op", sorted(fuzz.OP_FIELDS))
def test_every_op_with_every_subset_of_fields_missing(op: str) -> None:
    full = {"op": op, "id": "m1", "prompt": "x", "prompt_tokens": [1], "messages": [{"role": "user", "content": "x"}],
            "max_tokens": 3, "temperature": 0.5, "top_p": 0.9, "seed": 1, "stop": ["\n"]}
    fields = fuzz.OP_FIELDS[op]
    for size in range(len(fields) + 1):
        for missing in itertools.combinations(fields, size):
            body = {k: full[k] for k in fields if k not in missing}
            result = fuzz.check_decode_op(fuzz.encode(body))
            if "op" in missing:
                assert isinstance(result, ProtocolError) and "generate, cancel, stats" in str(result)
            elif "id" in missing and op != "stats":
                assert isinstance(result, ProtocolError) and "`id`" in str(result), (body, result)
            else:  # the protocol accepts it; the engine checks which prompt was given
                assert not isinstance(result, ProtocolError), (body, result)


@pytest.mark.parametrize("number", fuzz.HUGE_NUMBERS)
@pytest.mark.parametrize("field", ["max_tokens", "temperature", "top_p", "seed"])
def test_huge_numbers_are_refused_or_in_range(field: str, number: str) -> None:
    line = f'{{"op": "generate", "id": "h", "prompt": "x", "{field}": {number}}}'.encode()
    result = fuzz.check_decode_op(line)
    if isinstance(result, ProtocolError):
        assert result.request_id == "h" or "JSON" in str(result)
    else:
        assert getattr(result, field) == json.loads(number)


# ---- parse_pipeline -----------------------------------------------------------------


@BOUNDED
@given(fuzz.pipeline_texts, st.lists(fuzz.override_items, max_size=3))
def test_parse_pipeline_raises_only_pipeline_errors_naming_paths(text: str, assignments: list[str]) -> None:
    fuzz.check_parse_pipeline(text, assignments)


def test_the_builtin_pipeline_passes_the_property() -> None:
    assert fuzz.check_parse_pipeline(fuzz.BUILTIN_TEXT).name == "generate"


def test_a_yaml_syntax_error_names_the_document_path() -> None:
    with pytest.raises(PipelineErrors) as info:
        parse_pipeline("stages: [\n")
    assert all(p.startswith("$") for p in info.value.problems), info.value.problems


def test_a_pipeline_file_that_is_not_utf8_is_a_config_error(tmp_path: Path) -> None:
    path = tmp_path / "bad.yaml"
    path.write_bytes(b"name: \xff\xfe\nstages: {}\n")
    with pytest.raises(ConfigError):
        load_pipeline(str(path))


def test_pipeline_text_with_a_lone_surrogate_is_a_config_error() -> None:
    with pytest.raises(ConfigError):
        parse_pipeline("name: \ud800\nstages: {}\n")


def test_yaml_aliases_cannot_blow_up_the_error_message() -> None:
    levels = "".join(
        f"  - &a{i} [" + ", ".join([f"*a{i - 1}"] * 9 if i else ["lol"] * 9) + "]\n" for i in range(6)
    )
    text = f"x:\n{levels}stages:\n  t: {{type: tokenize, model: *a5}}\n"  # ~400 bytes
    assert len(text) < 1000
    started = time.monotonic()
    with pytest.raises(PipelineErrors) as info:
        parse_pipeline(text)
    assert len(str(info.value)) < 10_000, f"{len(str(info.value))} characters"  # 9**5 leaves now
    assert time.monotonic() - started < 1.0


# ---- the worker's line reader -------------------------------------------------------


@BOUNDED
@given(
    st.lists(
        st.binary(max_size=300).map(lambda b: b.replace(b"\n", b""))
        | st.integers(0, 150_000).map(lambda n: b"z" * n)
        | st.integers(998, 1003).map(lambda n: b"e" * n),  # around the limit
        max_size=12,
    ),
    st.booleans(),
)
def test_read_lines_splits_like_bytes_split_and_bounds_long_lines(tmp_path_factory, lines: list[bytes], final_newline: bool) -> None:
    limit = 1000
    data = b"\n".join(lines) + (b"\n" if final_newline and lines else b"")
    path = tmp_path_factory.mktemp("lines") / "input"
    path.write_bytes(data)
    fd = os.open(path, os.O_RDONLY)
    try:
        got = list(read_lines(fd, max_line_bytes=limit))  # os.read gives 64 KiB chunks
    finally:
        os.close(fd)
    expected = data.split(b"\n")
    if expected[-1] == b"":
        expected.pop()
    assert len(got) == len(expected)
    for i, (line, want) in enumerate(zip(got, expected, strict=True)):
        raw_length = len(want) + (1 if i < len(expected) - 1 or data.endswith(b"\n") else 0)
        if raw_length > limit + 2:  # room for "\r\n"; the worker checks the stripped line
            assert line == OversizeLine(raw_length)
        else:
            assert line.rstrip(b"\n") == want


# ---- one worker, fuzzed lines between valid requests --------------------------------

NUM_BAD = 300
NUM_VALID = 30
OVERSIZE_BYTES = (16 << 20) + 10  # the worker's limit is 16 MiB


@pytest.mark.timeout(150)
def test_a_worker_answers_every_fuzzed_line_and_serves_the_valid_ones(tiny_llama: str, tmp_path: Path) -> None:
    rng = random.Random(6)
    bad = bad_lines(rng, NUM_BAD)
    assert len({b.kind for b in bad}) >= 8  # every kind of damage is in the mix
    client = WorkerClient(tiny_llama, sets=["kv.kv_budget_bytes=67108864"], stderr_path=tmp_path / "stderr.txt")
    try:
        client.wait_ready()
        bad_at, blank_at, valid = {}, [], {}
        per_valid = NUM_BAD // NUM_VALID
        for i in range(NUM_VALID):
            for line in bad[i * per_valid : (i + 1) * per_valid]:
                bad_at[client.send(line.data)] = line
            if i % 10 == 3:
                blank_at.append(client.send(b"  \t \r"))
            rid = f"v-{i}"
            body = {"op": "generate", "id": rid, "prompt_tokens": [rng.randrange(10, 1000) for _ in range(rng.randint(1, 40))], "max_tokens": rng.randint(1, 6)}
            client.send_json(body)
            valid[rid] = body
        oversize_line = client.send(b'{"op": "stats", "pad": "' + b"x" * OVERSIZE_BYTES + b'"}')
        client.wait_done(list(valid), timeout=90)
        client.send_json({"op": "stats"})  # once every request ended: no block in use
        client.close_stdin()
        exit_code = client.wait_exit(timeout=120)
    finally:
        client.close()

    assert exit_code == 0, client.stderr_tail()
    assert client.not_json == []
    for number, line in bad_at.items():
        answers = client.by_line.get(number, [])
        assert len(answers) == 1, (line, answers)
        assert answers[0]["event"] == "error" and answers[0]["id"] == line.expected_id, (line, answers)
        assert answers[0]["message"].strip()
    for number in blank_at:
        assert number not in client.by_line
    [oversize] = client.by_line[oversize_line]
    assert oversize["event"] == "error" and "at most" in oversize["message"]
    answered_lines = set(client.by_line)
    assert answered_lines == set(bad_at) | {oversize_line}  # nothing else got an error
    for rid, body in valid.items():
        done = client.terminal[rid]
        assert done["event"] == "done" and done["finish_reason"] == "length", done
        assert len(client.tokens[rid]) == body["max_tokens"] == done["usage"]["completion_tokens"]
    stats = client.stats_events()
    assert len(stats) == 1 and stats[0]["kv"]["blocks_used"] == 0
