"""The worker protocol's sampling additions (DESIGN.md section 3): token events carry
`logprob` and `top_logprobs` only when asked, `response_format` constrains the text,
a bad format is a bad_request naming its line, and a request that fails alone on the
model thread gets an error event with code processor_failed while the worker serves on."""

from __future__ import annotations

import io
import json
import sys

import pytest
from conftest import SMALL_KV
from test_processor_faults import ExplodingMatcher
from test_worker import WorkerProcess, terminal

from unikern.frontends.worker import Worker
from unikern.stages.execute.structured import GrammarCompiler

SCHEMA = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 9},
                                           "ok": {"type": "boolean"}},
          "required": ["n", "ok"], "additionalProperties": False}
REQUESTS = {
    "lp": {"prompt_tokens": [5, 6, 7], "max_tokens": 6, "logprobs": True, "top_logprobs": 3},
    "lp-only": {"prompt_tokens": [5, 6, 7], "max_tokens": 3, "logprobs": True},
    "plain": {"prompt_tokens": [5, 6, 7], "max_tokens": 3},
    "json": {"prompt": "x", "max_tokens": 32,
             "response_format": {"type": "json_schema", "json_schema": {"name": "n", "schema": SCHEMA}}},
    "bad-format": {"prompt": "x", "response_format": {"type": "regex", "pattern": "a(b"}},
}


@pytest.fixture(scope="module")
def transcript(tmp_path_factory: pytest.TempPathFactory) -> dict:
    from unikern.testing.modelgen import cached_model

    args = [sys.executable, "-m", "unikern", "worker", "--model", str(cached_model("tiny-llama")),
            "--set", f"kv.kv_budget_bytes={SMALL_KV['kv']['kv_budget_bytes']}"]
    w = WorkerProcess(args, tmp_path_factory.mktemp("worker") / "stderr.txt")
    lines = {}
    try:
        w.wait_until("ready", lambda ev: len(ev) >= 1)
        for rid, body in REQUESTS.items():
            lines[rid] = w.send_json({"op": "generate", "id": rid, **body})
        w.close_stdin()
        assert w.wait_eof() == 0
    finally:
        w.close()
    events = [e for e in w.events if isinstance(e, dict)]
    assert all(terminal(events, rid) for rid in REQUESTS)
    return {"events": events, "lines": lines}


def of(transcript: dict, rid: str, kind: str) -> list[dict]:
    return [e for e in transcript["events"] if e.get("id") == rid and e["event"] == kind]


def test_token_events_carry_logprobs_only_when_asked(transcript: dict) -> None:
    asked = of(transcript, "lp", "token")
    assert len(asked) == 6
    for event in asked:
        top = event["top_logprobs"]
        assert event["logprob"] <= 0 and len(top) == 3 and set(top[0]) == {"token_id", "logprob"}
        assert [t["logprob"] for t in top] == sorted((t["logprob"] for t in top), reverse=True)
        assert top[0]["token_id"] == event["token_id"]  # greedy: the chosen token is the best
    assert all("logprob" in e and "top_logprobs" not in e for e in of(transcript, "lp-only", "token"))
    assert all("logprob" not in e and "top_logprobs" not in e for e in of(transcript, "plain", "token"))
    assert [e["token_id"] for e in asked[:3]] == [e["token_id"] for e in of(transcript, "plain", "token")]


def test_response_format_constrains_the_text(transcript: dict) -> None:
    import jsonschema

    text = "".join(e["text"] for e in of(transcript, "json", "token"))
    jsonschema.validate(json.loads(text), SCHEMA)
    assert of(transcript, "json", "done")[0]["finish_reason"] == "stop"


def test_a_bad_response_format_is_a_bad_request_on_its_line(transcript: dict) -> None:
    (error,) = of(transcript, "bad-format", "error")
    assert error["code"] == "bad_request" and error["line"] == transcript["lines"]["bad-format"]
    assert "regex" in error["message"] and "unclosed group" in error["message"]


@pytest.mark.anyio
async def test_a_request_failing_alone_is_a_processor_failed_event(tiny_llama, monkeypatch) -> None:
    import unikern

    compile = GrammarCompiler.compile
    monkeypatch.setattr(GrammarCompiler, "compile", lambda self, fmt: ExplodingMatcher(compile(self, fmt)))
    regex = {"type": "regex", "pattern": "[0-9]{8}"}
    lines = [json.dumps({"op": "generate", "id": rid, **body}).encode() for rid, body in [
        ("bomb", {"prompt": "n:", "max_tokens": 12, "response_format": regex}),
        ("fine", {"prompt_tokens": [5, 6, 7], "max_tokens": 5}),
    ]]

    async def feed():
        for line in lines:
            yield line

    out = io.BytesIO()
    async with unikern.Engine.from_pipeline("generate", model=tiny_llama, overrides=SMALL_KV) as engine:
        code = await Worker(engine, out).serve(feed())
    events = [json.loads(line) for line in out.getvalue().splitlines()]
    (error,) = [e for e in events if e["event"] == "error"]
    assert error["id"] == "bomb" and error["code"] == "processor_failed" and error["line"] == 1
    assert "matcher exploded" in error["message"]
    assert [e["finish_reason"] for e in events if e["event"] == "done"] == ["length"]
    assert code == 0  # the worker served on and exits 0
