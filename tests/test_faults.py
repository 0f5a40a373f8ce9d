"""Stage faults (issue 6): a stage that raises fails every request in flight with an error
event naming the stage, and the worker exits non-zero within seconds, stdin still open.

Faults come from the test hook in `kernel/faults.py` (UNIKERN_INJECT_FAULT=stage:n).
The four workers start at once (starting one costs seconds), then fail one at a time.
"""

from __future__ import annotations

import subprocess
import time

import anyio
import pytest

import unikern
from tests.conftest import SMALL_KV
from tools.check.worker_client import WorkerClient
from unikern import messages as m
from unikern.errors import ConfigError, StageError
from unikern.faults import ENV_VAR, FaultyInbox, planned_fault, wrap_inbox

# stage with an inbox in the built-in `generate` pipeline -> the message that fails:
# tokenize takes Submits, schedule Tokenized + StepDone, execute Steps, output StepOutputs
FAULT_AT = {"tokenize": 3, "schedule": 6, "execute": 4, "output": 12}
NUM_REQUESTS = 4
EXIT_WITHIN_S = 10.0  # after the first error event; measured 2-3 s on a busy 2-core box


# ---- the hook itself ----------------------------------------------------------------


def test_no_variable_no_wrapper() -> None:
    inbox = object()
    assert planned_fault({}) is None
    assert wrap_inbox("schedule", inbox, None) is inbox
    assert wrap_inbox("schedule", inbox, ("execute", 1)) is inbox
    assert isinstance(wrap_inbox("execute", inbox, ("execute", 1)), FaultyInbox)


@pytest.mark.parametrize("value", ["schedule", "schedule:", ":3", "schedule:0", "schedule:x", "schedule:-1"])
def test_a_malformed_fault_plan_is_a_config_error(value: str) -> None:
    with pytest.raises(ConfigError, match=ENV_VAR):
        planned_fault({ENV_VAR: value})


@pytest.mark.anyio
async def test_the_wrapped_inbox_fails_on_its_nth_message() -> None:
    send, receive = anyio.create_memory_object_stream[int](10)
    for i in range(5):
        send.send_nowait(i)
    inbox = wrap_inbox("s", receive, ("s", 3))
    assert await inbox.receive() == 0
    got = []
    with pytest.raises(RuntimeError, match="injected fault"):
        async for message in inbox:
            got.append(message)
    assert got == [1]
    assert inbox.receive_nowait() == 3  # counting goes on; only the n-th fails
    inbox.close()
    send.close()


# ---- the library --------------------------------------------------------------------


@pytest.mark.anyio
async def test_an_engine_whose_stage_fails_raises_stage_error(tiny_llama: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(ENV_VAR, "execute:3")
    engine = unikern.Engine.from_pipeline("generate", model=tiny_llama, overrides=SMALL_KV)
    events = []
    with pytest.raises(StageError) as raised:
        async with engine:
            with anyio.fail_after(60):
                async for event in engine.generate(prompt_tokens=[5, 6, 7], max_tokens=100):
                    events.append(event)
            with pytest.raises(StageError, match="execute"):  # new requests are refused
                engine.generate(prompt="more", max_tokens=3)
    assert isinstance(events[-1], m.ErrorEvent) and events[-1].code == "stage_failed"
    assert "'execute'" in events[-1].message and "injected fault" in events[-1].message
    assert sum(isinstance(e, m.TokenEvent) for e in events) < 100
    assert raised.value.stage == "execute"
    assert "injected fault" in str(raised.value)


# ---- the worker, one per stage ------------------------------------------------------


@pytest.fixture(scope="module")
def faulted(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict]:
    """Per stage: the worker's events, when its first error came, and when it exited."""
    from unikern.testing.modelgen import cached_model

    model = str(cached_model("tiny-llama"))
    tmp = tmp_path_factory.mktemp("faults")
    clients = {
        stage: WorkerClient(
            model,
            sets=["kv.kv_budget_bytes=67108864"],
            env={ENV_VAR: f"{stage}:{n}"},
            stderr_path=tmp / f"{stage}.stderr",
        )
        for stage, n in FAULT_AT.items()
    }
    results = {}
    try:
        for client in clients.values():
            client.wait_ready()
        ids = [f"r{i}" for i in range(NUM_REQUESTS)]
        # one fault at a time, so that each exit is timed without the others' teardown
        # (each interpreter spends ~2 s of CPU finalizing torch and MLX) on the same cores
        for stage, client in clients.items():
            for rid in ids:  # stdin stays open: the worker must stop by itself
                client.send_json({"op": "generate", "id": rid, "prompt_tokens": [11, 12, 13, 14], "max_tokens": 400})
            client.wait_done(ids, timeout=60)
            first_error = min(client.ended_at.values())
            try:
                code = client.wait_exit(timeout=EXIT_WITHIN_S + 20)
                exited_at = client.eof_at or time.monotonic()
            except subprocess.TimeoutExpired:
                code, exited_at = None, time.monotonic()
            results[stage] = {
                "code": code,
                "exit_after_s": exited_at - first_error,
                "terminal": dict(client.terminal),
                "tokens": {rid: list(client.tokens.get(rid, ())) for rid in ids},
                "stderr": client.stderr_tail(),
                "not_json": list(client.not_json),
            }
    finally:
        for client in clients.values():
            client.close()
    return results


@pytest.mark.timeout(200)
@pytest.mark.parametrize("stage", list(FAULT_AT))
def test_every_request_in_flight_gets_an_error_naming_the_stage(faulted: dict, stage: str) -> None:
    result = faulted[stage]
    assert len(result["terminal"]) == NUM_REQUESTS
    for rid, event in result["terminal"].items():
        assert event["event"] == "error", event
        assert event["code"] == "stage_failed"
        assert f"stage {stage!r} failed" in event["message"] and "injected fault" in event["message"]
        assert event["line"] == int(rid[1:]) + 1
        assert len(result["tokens"][rid]) < 400
    assert result["not_json"] == []


@pytest.mark.timeout(200)
@pytest.mark.parametrize("stage", list(FAULT_AT))
def test_the_worker_exits_non_zero_within_seconds(faulted: dict, stage: str) -> None:
    result = faulted[stage]
    assert result["code"] is not None, f"still running with stdin open\n{result['stderr']}"
    assert result["code"] == 1, result["stderr"]
    assert result["exit_after_s"] < EXIT_WITHIN_S
    assert "stage failed" in result["stderr"] and stage in result["stderr"]


def test_every_stage_with_an_inbox_is_covered() -> None:
    from unikern.spec import load_pipeline

    spec = load_pipeline("generate")
    with_inbox = {name for name, cls in spec.stage_classes().items() if cls.consumes}
    assert with_inbox == set(FAULT_AT)
