"""Admission control (issue 16): a bounded waiting queue, `schedule.max_waiting`, decided
by the scheduler's plain policy; past it a request is refused at once as `overloaded`.
And the schedule <-> output cycle of bounded inboxes never waits on itself."""

from __future__ import annotations

import string

import anyio
import pytest

import unikern
from tests.conftest import SMALL_KV
from unikern import messages as m
from unikern.errors import RequestError
from unikern.stages.kv.blocks import BlockManager
from unikern.stages.schedule.policy import Scheduler
from unikern.stages.schedule.stage import MIN_WAITING, ScheduleParams


def request(rid: str, n: int = 4) -> m.Tokenized:
    return m.Tokenized(rid, tuple(range(5, 5 + n)), m.SamplingParams(max_tokens=4))


def test_the_policy_refuses_past_max_waiting_and_admits_again_once_room_frees():
    sched = Scheduler(BlockManager(64, 16, b"ns"), max_num_seqs=2, max_num_batched_tokens=64,
                      eos_token_ids=[0], context_length=512, max_waiting=3)
    assert [sched.add(request(f"r{i}")) for i in range(3)] == [None] * 3
    refusal = sched.add(request("r3"))
    assert refusal is not None and refusal.code == "overloaded"
    assert "schedule.max_waiting" in refusal.message and "is 3" in refusal.message
    assert "r3" not in sched.by_id and len(sched.waiting) == 3
    assert sched.num_refused_overloaded == 1
    step = sched.schedule()  # two of the three are admitted: room for two more
    assert len(step.work) == 2 and len(sched.waiting) == 1
    assert sched.add(request("r4")) is None and sched.add(request("r5")) is None
    assert sched.add(request("r6")).code == "overloaded"
    # a request that can never fit is a bad request, whatever the queue
    assert sched.add(request("huge", 64 * 16)).code == "bad_request"


def test_max_waiting_defaults_to_four_steps_of_rows_with_a_floor():
    assert ScheduleParams().waiting_limit() == max(MIN_WAITING, 4 * 64)
    assert ScheduleParams(max_num_seqs=2).waiting_limit() == MIN_WAITING
    assert ScheduleParams(max_num_seqs=512, max_num_batched_tokens=4096).waiting_limit() == 2048
    assert ScheduleParams(max_waiting=7).waiting_limit() == 7
    assert ScheduleParams(max_waiting=0).validate() == ["max_waiting: must be >= 1, got 0"]


@pytest.mark.anyio
@pytest.mark.parametrize("pipeline", ["generate", "generate-offload"])
async def test_the_engine_refuses_at_once_past_max_waiting(pipeline, tiny_llama, tmp_path):
    overrides = {**SMALL_KV, "schedule": {"max_num_seqs": 1, "max_waiting": 1}}
    if pipeline == "generate-offload":
        overrides["disk"] = {"path": str(tmp_path / "kv")}
    outcomes: dict[int, str] = {}
    async with unikern.Engine.from_pipeline(pipeline, model=tiny_llama, overrides=overrides) as engine:

        async def one(i: int) -> None:
            try:
                result = await engine.complete(prompt_tokens=[5 + i, 6, 7], max_tokens=4)
                outcomes[i] = result.finish_reason
            except RequestError as exc:
                assert "schedule.max_waiting" in str(exc), exc
                outcomes[i] = exc.code

        async with anyio.create_task_group() as tg:
            for i in range(8):  # one runs, one waits, the others arrive while it runs
                tg.start_soon(one, i)
        stats = engine.stats()["schedule"]
    refused = sum(1 for v in outcomes.values() if v == "overloaded")
    assert len(outcomes) == 8 and set(outcomes.values()) <= {"length", "overloaded"}
    assert refused >= 1 and stats["refused_overloaded"] == refused
    assert stats["max_waiting"] == 1 and stats["waiting"] == 0


@pytest.mark.anyio
@pytest.mark.parametrize("inbox_size", [0, 1, 2])
async def test_schedule_and_output_never_wait_on_each_other(inbox_size, tiny_llama, monkeypatch):
    """With inboxes of 0-2 messages, a burst of requests that each stop at their first
    token (output sends schedule an Abort per request while schedule sends output a
    StepOutput per step and per abort) all end. Before output parked its Aborts
    (output.AbortOutbox), this hung with 2-message inboxes: schedule blocked on output's
    inbox, output on schedule's."""
    monkeypatch.setattr("unikern.router.INBOX_SIZE", inbox_size)
    stop = list(string.printable)  # every token with a printable character stops
    reasons: dict[str, int] = {}
    async with unikern.Engine.from_pipeline("generate", model=tiny_llama, overrides=SMALL_KV) as engine:

        async def one(i: int) -> None:
            try:
                result = await engine.complete(prompt_tokens=[5 + i % 900, 6, 7], max_tokens=8, stop=stop)
                key = result.finish_reason
            except RequestError as exc:
                key = exc.code
            reasons[key] = reasons.get(key, 0) + 1

        with anyio.fail_after(120):  # a deadlock detector, not a speed claim (it takes < 1 s)
            async with anyio.create_task_group() as tg:
                for i in range(600):
                    tg.start_soon(one, i)
        assert engine.stats()["kv"]["blocks_used"] == 0
    assert sum(reasons.values()) == 600 and reasons.get("stop", 0) > 0, reasons
    assert set(reasons) <= {"stop", "length", "overloaded"}, reasons
