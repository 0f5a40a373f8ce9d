"""A decode window's tokens handed on while it runs (execute.stream_interval_ms,
stages/execute/streaming.py; Scheduler.on_window_tokens): the same tokens and finishes as
at the window's end, the first of them sooner."""

from __future__ import annotations

import threading
import time

import anyio
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from test_lookahead import EOS, window_tokens

import unikern
from tests.conftest import SMALL_KV, compare_greedy, reference_greedy
from unikern import messages as m
from unikern.stages.execute.stage import MLXExecuteParams
from unikern.stages.execute.streaming import STEP_END, WindowStream
from unikern.stages.kv.blocks import BlockManager
from unikern.stages.schedule.policy import Scheduler


def drive(shown: list[float] | None):
    """The policy's loop with lookahead windows; `shown`: for each window, WindowTokens
    with that share of its steps come first (cycled; None: none come). The tokens in the
    order they went out, each request's finish, and the tokens that went out early."""
    blocks = BlockManager(64, 16)
    sched = Scheduler(blocks, max_num_seqs=8, max_num_batched_tokens=64, eos_token_ids=[EOS],
                      context_length=512, decode_lookahead=4, decode_lookahead_max=8)
    for i in range(6):
        sched.add(m.Tokenized(f"r{i}", tuple(range(5 + i, 25 + 3 * i)), m.SamplingParams(max_tokens=15 + 3 * i)))
    out: dict[str, list[int]] = {f"r{i}": [] for i in range(6)}
    finished, early, windows = {}, 0, 0
    while (step := sched.schedule()) is not None:
        sampled = {w.request_id: window_tokens(w.request_id, sched.by_id[w.request_id].tokens, step.num_steps)
                   for w in step.work if w.sample}
        if shown and step.num_steps > 1:
            share = shown[windows % len(shown)]
            windows += 1
            for k in sorted({1, int(share * (step.num_steps - 1))}):  # two hand-ons at most
                for t in sched.on_window_tokens(step, {r: s[:k] for r, s in sampled.items()}):
                    assert not t.last and t.token_id != EOS  # a finish goes with the StepDone
                    out[t.request_id].append(t.token_id)
                    early += 1
        outcome = sched.on_step_done(step, sampled)
        for t in outcome.tokens:
            out[t.request_id].append(t.token_id)
        for f in outcome.finished:
            finished[f.request_id] = (f.reason, f.usage.completion_tokens)
    assert not sched.has_work() and blocks.num_used == 0
    return out, finished, early


def test_window_tokens_sent_early_change_no_token_and_no_finish():
    base, base_finished, none_early = drive(None)
    out, finished, early = drive([1.0, 0.5, 0.0])
    assert none_early == 0 and early > 0
    assert out == base and finished == base_finished
    for rid, (_, count) in finished.items():
        assert count == len(out[rid])


@settings(max_examples=25, deadline=None)
@given(st.lists(st.floats(0.0, 1.0), min_size=1, max_size=5))
def test_any_share_of_a_window_sent_early_gives_the_same_stream(shares):
    base, base_finished, _ = drive(None)
    out, finished, _ = drive(shares)
    assert out == base and finished == base_finished


def test_a_request_ended_inside_a_window_counts_the_tokens_it_was_sent():
    """Aborted (the caller cancelled, a stop string matched) after some of a window's tokens
    went out and before its StepDone: its usage counts what it was sent."""
    blocks = BlockManager(64, 16)
    sched = Scheduler(blocks, max_num_seqs=8, max_num_batched_tokens=64, eos_token_ids=[EOS],
                      context_length=512, decode_lookahead=8, decode_lookahead_max=8)
    sched.add(m.Tokenized("r", (5, 6, 7), m.SamplingParams(max_tokens=40)))
    sent = 0
    while True:
        step = sched.schedule()
        tokens = {"r": [11 + i for i in range(step.num_steps)]}
        if step.num_steps > 1:
            sent += len(sched.on_window_tokens(step, {"r": tokens["r"][:3]}))
            finished = sched.abort("r", "cancelled")
            break
        sent += len(sched.on_step_done(step, tokens).tokens)
    assert sent == 4 and finished.usage.completion_tokens == 4  # the prompt's token, then 3 of the window
    assert sched.on_step_done(step, tokens).tokens == [] and blocks.num_used == 0


def test_stream_interval_must_not_be_negative():
    assert any("stream_interval_ms" in p for p in MLXExecuteParams(stream_interval_ms=-1).validate())
    assert not MLXExecuteParams(stream_interval_ms=0).validate()


class Step:
    """A step's tokens, as an MLX array's `tolist` gives them."""

    def __init__(self, tokens: list[int]) -> None:
        self.tokens = tokens

    def tolist(self) -> list[int]:
        return self.tokens


def drained(q) -> list:
    items = []
    while not q.empty():
        items.append(q.get())
    return items


def test_the_reader_hands_on_each_rows_tokens_so_far_and_never_the_last_step():
    steps = [Step([10 + i, 20 + i]) for i in range(5)]
    every = WindowStream(0.0)
    q = every.open(7)
    reader = every.reader(7, ["a", "b"])
    reader.read_to(steps, 2)
    reader.read_to(steps, 2)  # nothing new
    reader.read_to(steps, 4)
    every.close(7)
    assert drained(q) == [{"a": [10], "b": [20]}, {"a": [10, 11], "b": [20, 21]},
                          {"a": [10, 11, 12], "b": [20, 21, 22]}, {"a": [10, 11, 12, 13], "b": [20, 21, 22, 23]},
                          STEP_END]
    assert every.sent == 4 and every.reader(7, ["a", "b"]) is None  # closed: nothing more goes on
    rarely = WindowStream(3600.0)
    q = rarely.open(1)
    rarely.reader(1, ["a", "b"]).read_to(steps, 4)
    assert q.empty() and rarely.sent == 0


def test_stopping_ends_the_queues_of_steps_that_never_ran():
    stream = WindowStream(0.0)
    queues = [stream.open(i) for i in range(3)]
    stream.close(1)
    stream.close_all()
    assert [drained(q) for q in queues] == [[STEP_END]] * 3


PROMPT = [5, 6, 7, 8, 9]
MAX_TOKENS = 24
HOLD_S = 1.0  # how long the test keeps each window's StepDone back


def engine(path: str, interval_ms: float | None):
    return unikern.Engine.from_pipeline("generate", model=path, overrides={
        **SMALL_KV, "schedule": {"decode_lookahead": 8, "decode_lookahead_max": 8},
        "execute": {"stream_interval_ms": interval_ms}})


async def arrivals(path: str, interval_ms: float | None) -> tuple[list[int], list[tuple[str, int]], dict]:
    """A greedy request's tokens, and what happened in order: ("token", i) as the caller
    got token i, ("window", n) as the model thread gave back a window of n steps, after
    holding it HOLD_S past its last step."""
    events: list[tuple[str, int]] = []
    lock = threading.Lock()
    async with engine(path, interval_ms) as eng:
        await eng.complete(prompt_tokens=PROMPT, max_tokens=1)  # the runner is made by then
        runner = eng._router.stages["execute"].runner
        execute = runner.execute

        def held(step, seeds):
            done = execute(step, seeds)
            if step.num_steps > 1:
                time.sleep(HOLD_S)
                with lock:
                    events.append(("window", step.num_steps))
            return done

        runner.execute = held
        tokens = []
        async for event in eng.generate(prompt_tokens=PROMPT, max_tokens=MAX_TOKENS):
            if isinstance(event, m.TokenEvent):
                with lock:
                    events.append(("token", len(tokens)))
                tokens.append(event.token_id)
        return tokens, events, eng.stats()["window_tokens"]


def tokens_before_their_window(events: list[tuple[str, int]]) -> int:
    """Tokens the caller got before the model thread gave back the window that sampled
    them: beyond what the windows given back before them sampled."""
    early, delivered, windows_done = 0, 0, 0
    for kind, n in events:
        if kind == "window":
            windows_done += n
        else:
            delivered += 1
            # token 0 comes from the prompt's step; windows sample the ones after it
            early += delivered - 1 > windows_done
    return early


@pytest.mark.anyio
async def test_a_windows_tokens_reach_the_caller_while_it_still_runs(tiny_llama):
    ref = reference_greedy(tiny_llama, PROMPT, MAX_TOKENS)
    streamed, events, stats = await arrivals(tiny_llama, 0)
    at_end, end_events, end_stats = await arrivals(tiny_llama, None)
    assert compare_greedy(streamed, ref)[0] and streamed == at_end
    assert ("window", 8) in events and stats["sent"] > 0 and end_stats["sent"] == 0
    # held back, a window's StepDone lets nothing through before it; handed on, each of
    # its steps but the last reaches the caller first
    assert tokens_before_their_window(end_events) == 0
    assert tokens_before_their_window(events) >= 7


@pytest.mark.anyio
async def test_an_interval_longer_than_the_window_sends_nothing_early(tiny_llama):
    streamed, events, stats = await arrivals(tiny_llama, 60_000)
    assert stats["sent"] == 0 and tokens_before_their_window(events) == 0
    assert len(streamed) == MAX_TOKENS


@pytest.mark.anyio
async def test_requests_finishing_inside_windows_end_as_without_window_tokens(tiny_llama):
    """Several rows, some ending inside a window (max_tokens): their streams and finishes as
    at the window's end."""

    async def run(interval_ms):
        async with engine(tiny_llama, interval_ms) as eng:
            results = [None] * 6

            async def one(i):
                results[i] = await eng.complete(prompt_tokens=[5, 6 + i, 7], max_tokens=9 + 5 * i)

            async with anyio.create_task_group() as tg:
                for i in range(6):
                    tg.start_soon(one, i)
            return [(r.token_ids, r.finish_reason) for r in results], eng.stats()["window_tokens"]

    streamed, stats = await run(0)
    at_end, _ = await run(None)
    assert streamed == at_end and stats["sent"] > 0
