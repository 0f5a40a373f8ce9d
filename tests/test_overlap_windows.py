"""schedule.overlap_windows: a decode window's successor planned and sent while it runs
(Scheduler.follow_up), its rows fed the tokens the window sampled last, on the device."""

from __future__ import annotations

from collections import deque

import anyio
import pytest
from test_lookahead import EOS, next_token
from test_sampling import engine, seeded_request

import unikern
from tests.conftest import SMALL_KV, compare_greedy, reference_greedy
from unikern import messages as m
from unikern.stages.kv.blocks import BlockManager
from unikern.stages.schedule.policy import Scheduler


class Device:
    """A stand-in for the model thread: each row's context as the device has it (fed
    tokens at their positions, then what it sampled), so a continuing row reads the token
    its previous window sampled last, as ModelRunner's carried array does, even when the
    scheduler has since finished that row."""

    def __init__(self, blocks: BlockManager) -> None:
        self.blocks = blocks
        self.context: dict[str, list[int]] = {}
        self.last_rows: tuple[str, ...] = ()

    def run(self, step: m.Step) -> dict[str, list[int]]:
        rows = tuple(w.request_id for w in step.work)
        if any(w.continues for w in step.work):
            assert all(w.continues for w in step.work) and rows == self.last_rows
        sampled = {}
        for w in step.work:
            assert self.blocks.blocks_needed(w.start_pos + len(w.token_ids) + step.num_steps - 1) <= len(w.block_table)
            ctx = self.context.setdefault(w.request_id, [])
            if w.continues:
                assert len(ctx) == w.start_pos + 1  # the carried token sits at start_pos
            else:
                del ctx[w.start_pos:]
                ctx.extend(w.token_ids)
            if not w.sample:
                continue
            toks = []
            for _ in range(step.num_steps):
                toks.append(next_token(w.request_id, ctx))
                ctx.append(toks[-1])
            sampled[w.request_id] = toks
        self.last_rows = rows
        return sampled


def drive(overlap: bool, num_blocks: int = 256, late: int | None = None, penalized: tuple[int, ...] = (),
          prefills: bool = False):
    """The schedule stage's loop over the policy: up to two steps in flight with overlap.
    `late`: a request added after that many steps, while windows are in flight;
    `prefills`: first windows planned while the prompts' step runs (follow_prefills)."""
    blocks = BlockManager(num_blocks, 16)
    sched = Scheduler(blocks, max_num_seqs=8, max_num_batched_tokens=64, eos_token_ids=[EOS],
                      context_length=512, decode_lookahead=2, decode_lookahead_max=16)
    sched.follow_prefills = prefills
    device = Device(blocks)

    def add(i: int) -> None:
        params = m.SamplingParams(max_tokens=30 + 7 * i, repetition_penalty=1.2 if i in penalized else 1.0)
        sched.add(m.Tokenized(f"r{i}", tuple(range(5 + i, 25 + 3 * i)), params))

    for i in range(5):
        add(i)
    out: dict[str, list[int]] = {}
    reasons = {}
    in_flight: deque[m.Step] = deque()
    shapes = []
    for n in range(1000):
        if n == late:
            add(9)
        if not in_flight and sched.has_work():
            step = sched.schedule()
            if step is not None:
                in_flight.append(step)
        if overlap and len(in_flight) == 1:
            follow = sched.follow_up(in_flight[0])
            if follow is not None:
                in_flight.append(follow)
        if not in_flight:
            break
        step = in_flight.popleft()
        shapes.append((step.num_steps, len(step.work), any(w.continues for w in step.work)))
        outcome = sched.on_step_done(step, device.run(step))
        for t in outcome.tokens:
            out.setdefault(t.request_id, []).append(t.token_id)
        for f in outcome.finished:
            reasons[f.request_id] = (f.reason, f.usage.completion_tokens)
    assert not sched.has_work() and blocks.num_used == 0
    return out, reasons, shapes, sched.num_follow_ups


def test_follow_ups_give_the_same_tokens_and_stops():
    base, base_reasons, _, none = drive(False)
    out, reasons, shapes, follow_ups = drive(True)
    assert none == 0 and follow_ups > 0
    assert sum(cont for *_, cont in shapes) == follow_ups
    assert out == base and reasons == base_reasons
    assert any(reason == "stop" for reason, _ in reasons.values())  # rows ended by EOS mid-window
    for rid, (_, count) in reasons.items():
        assert count == len(out[rid])


def test_first_windows_follow_the_prompts_step_with_the_same_tokens_and_stops():
    """follow_prefills: the rows' first window goes out while their prompts' step runs
    (continuing from the tokens it samples): the same tokens and stops as without
    overlap, and more follow-ups than overlapped windows alone, some right after a
    step that fed prompts."""
    base, base_reasons, _, _ = drive(False)
    _, _, _, windows_only = drive(True)
    out, reasons, shapes, follow_ups = drive(True, prefills=True)
    assert out == base and reasons == base_reasons
    assert follow_ups > windows_only
    assert any(steps == 1 and nxt[2] for (steps, _, _), nxt in zip(shapes, shapes[1:], strict=False))
    late, late_reasons, _, _ = drive(True, late=6, prefills=True)
    assert (late, late_reasons) == drive(False, late=6)[:2]


def test_a_late_request_waits_for_the_windows_in_flight_then_joins():
    base, base_reasons, _, _ = drive(False, late=6)
    out, reasons, shapes, follow_ups = drive(True, late=6)
    assert follow_ups > 0 and out == base and reasons == base_reasons
    assert "r9" in out


def test_no_follow_up_for_penalized_rows_or_short_pools():
    _, _, shapes, follow_ups = drive(True, penalized=(0, 1, 2, 3, 4))
    assert follow_ups == 0  # penalties need the window's tokens on the host (history)
    small, small_reasons, _, _ = drive(True, num_blocks=14)  # too few blocks to plan ahead
    base, base_reasons, _, _ = drive(False, num_blocks=14)
    assert small == base and small_reasons == base_reasons


def test_follow_up_plans_from_the_window_in_flight():
    blocks = BlockManager(64, 16)
    sched = Scheduler(blocks, max_num_seqs=4, max_num_batched_tokens=64, eos_token_ids=[EOS],
                      context_length=512, decode_lookahead=4, decode_lookahead_max=16)
    sched.add(m.Tokenized("a", tuple(range(5, 15)), m.SamplingParams(max_tokens=13)))
    prefill = sched.schedule()
    sched.on_step_done(prefill, {"a": [11]})
    window = sched.schedule()
    assert window.num_steps == 4 and window.work[0].start_pos == 10
    assert sched.follow_up(prefill) is None  # not a window
    sched.follow_prefills = True  # (the prompt's step is back already; planned as if it were not)
    first = sched.follow_up(prefill)
    (w,) = first.work
    assert (first.num_steps, w.start_pos, w.num_generated, w.continues) == (4, 10, 1, True)
    sched.follow_prefills = False
    follow = sched.follow_up(window)
    (w,) = follow.work
    assert (follow.num_steps, w.start_pos, w.num_generated, w.continues) == (8, 14, 5, True)
    assert blocks.blocks_needed(14 + 8) <= len(w.block_table)
    # 13 tokens in all: after 1 + 4 + 8 generated, nothing is left for a third window
    assert sched.follow_up(follow) is None
    sched.add(m.Tokenized("b", (5, 6, 7), m.SamplingParams(max_tokens=4)))
    assert sched.follow_up(window) is None  # someone waits: the batch will change


@pytest.mark.anyio
async def test_the_engine_gives_the_same_tokens_with_overlapped_windows(tiny_llama):
    """Seeded sampling and greedy rows of several lengths, with and without overlap (and
    with the first windows planned while the prompts ran): the same tokens, and the
    overlapped runs planned windows while others ran."""
    requests = [{**seeded_request(i), "max_tokens": 14 + 3 * (i % 4)} for i in range(8)]
    for i, r in enumerate(requests):
        r["repetition_penalty"] = 1.0  # penalized rows never follow up (test above)
        if i % 3 == 0:
            r.update(logprobs=True, top_logprobs=3)
    results = {}
    for overlap in (False, True, "prefill"):
        async with engine(tiny_llama, decode_lookahead=2, decode_lookahead_max=8, overlap_windows=bool(overlap),
                          overlap_prefill=overlap == "prefill") as eng:
            got = [None] * len(requests)

            async def one(i, eng=eng, got=got):
                events = [e async for e in eng.generate(**requests[i]) if isinstance(e, m.TokenEvent)]
                got[i] = [(e.token_id, e.logprob, e.top_logprobs) for e in events]

            async with anyio.create_task_group() as tg:
                for i in range(len(requests)):
                    tg.start_soon(one, i)
            results[overlap] = (got, eng.stats()["schedule"]["follow_ups"])
    (plain, none), (overlapped, follow_ups), (first, more) = results[False], results[True], results["prefill"]
    assert none == 0 and follow_ups > 0 and more > 0
    assert overlapped == plain
    # the first windows going out with the prompts' steps change which rows share a
    # batch (a request arriving alone decodes a window before the next one joins): the
    # same tokens, the log-probabilities to float rounding of other batch shapes
    assert [[t for t, _, _ in row] for row in first] == [[t for t, _, _ in row] for row in plain]
    for row, want in zip(first, plain, strict=True):
        for (_, lp, top), (_, want_lp, want_top) in zip(row, want, strict=True):
            assert (lp is None) == (want_lp is None) and (lp is None or abs(lp - want_lp) < 1e-4)
            assert [t.token_id for t in top or ()] == [t.token_id for t in want_top or ()]
    assert [len(t) for t in plain] == [r["max_tokens"] for r in requests]
    assert all(lp is not None for t, r in zip(plain, requests, strict=True) if r.get("logprobs") for _, lp, _ in t)


@pytest.mark.anyio
async def test_the_model_thread_goes_on_while_the_event_loop_is_busy():
    """A finished call's result waits for the loop on a helper thread, not on the model
    thread: the next call starts even while the loop is busy (delivering tokens)."""
    import threading
    import time

    from unikern.stages.execute.thread import ModelThread

    thread = ModelThread()
    first_done, second_started = threading.Event(), threading.Event()
    try:
        async with anyio.create_task_group() as tg:
            tg.start_soon(thread.run, lambda: time.sleep(0.05) or first_done.set())
            await anyio.sleep(0.01)  # the task is awaiting the first call's result
            second = thread.submit(second_started.set)
            time.sleep(0.5)  # noqa: ASYNC251 (the point: the loop is busy, nothing of it runs meanwhile)
            assert first_done.is_set() and second_started.is_set()
        await thread.result(second)
    finally:
        await thread.aclose()


def test_a_window_after_rows_left_is_followed_up_too():
    blocks = BlockManager(64, 16)
    sched = Scheduler(blocks, max_num_seqs=4, max_num_batched_tokens=64, eos_token_ids=[EOS],
                      context_length=512, decode_lookahead=2, decode_lookahead_max=16)
    for rid in ("a", "b"):
        sched.add(m.Tokenized(rid, tuple(range(5, 15)), m.SamplingParams(max_tokens=100)))
    prefill = sched.schedule()
    sched.on_step_done(prefill, {"a": [11], "b": [12]})
    window = sched.schedule()
    sched.on_step_done(window, {"a": [11] * 2, "b": [12] * 2})
    sched.abort("b", "cancelled")
    alone = sched.schedule()  # a alone: the window went on growing
    assert [w.request_id for w in alone.work] == ["a"] and alone.num_steps == 4
    follow = sched.follow_up(alone)
    assert follow is not None and follow.num_steps == 8 and follow.work[0].continues


@pytest.mark.anyio
@pytest.mark.parametrize("family, follows", [("qwen3", True), ("gemma3", False), ("qwen3-next", False)])
async def test_families_with_overlapped_windows(family, follows):
    """Another attention family follows up too; sliding-window and recurrent models are
    left to plain windows (their books and states move between windows), with the same
    tokens either way."""
    from test_families import OVERRIDES, family_model

    import unikern

    path = family_model(family)
    prompts = [[5 + i, 6, 7 + 2 * i, 8] * (1 + i % 3) for i in range(6)]
    got = {}
    for overlap in (False, True):
        overrides = {**OVERRIDES, "schedule": {**OVERRIDES["schedule"], "overlap_windows": overlap}}
        async with unikern.Engine.from_pipeline("generate", model=path, overrides=overrides) as eng:
            out = [None] * len(prompts)

            async def one(i, eng=eng, out=out):
                out[i] = (await eng.complete(prompt_tokens=prompts[i], max_tokens=12 + 3 * i)).token_ids

            async with anyio.create_task_group() as tg:
                for i in range(len(prompts)):
                    tg.start_soon(one, i)
            got[overlap] = (out, eng.stats()["schedule"]["follow_ups"])
    assert got[True][0] == got[False][0]
    assert (got[True][1] > 0) == follows


async def _switch_intervals_seen(model: str, execute_params: dict) -> list[float]:
    """Python's switch interval as each of an engine's steps saw it (one short request)."""
    import sys

    from test_sampling import SMALL_KV

    import unikern
    from unikern.stages.execute.runner import ModelRunner

    seen = []
    execute = ModelRunner.execute

    def recording(self, step, seeds):
        seen.append(sys.getswitchinterval())
        return execute(self, step, seeds)

    overrides = {**SMALL_KV, "execute": execute_params}
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(ModelRunner, "execute", recording)
        async with unikern.Engine.from_pipeline("generate", model=model, overrides=overrides) as eng:
            events = [e async for e in eng.generate(prompt_tokens=[5, 6, 7], max_tokens=3)]
    assert isinstance(events[-1], m.DoneEvent)
    return seen


@pytest.mark.anyio
async def test_the_gil_switch_interval_holds_while_the_engine_runs(tiny_llama):
    """execute.gil_switch_ms sets Python's switch interval for the engine's run, the
    model thread's steps see it, and the one before comes back at stop."""
    import sys

    from unikern.stages.execute.stage import MLXExecuteParams

    before = sys.getswitchinterval()
    seen = await _switch_intervals_seen(tiny_llama, {"gil_switch_ms": 0.25})
    assert seen and all(s == pytest.approx(0.25e-3) for s in seen)
    assert sys.getswitchinterval() == before
    assert MLXExecuteParams(gil_switch_ms=0).validate() == [
        "gil_switch_ms: must be > 0 (ms), \"auto\" or unset for Python's own 5 ms, got 0"]


@pytest.mark.anyio
async def test_the_gil_switch_interval_is_left_alone_here_and_shortened_on_cuda(tiny_llama, monkeypatch):
    """gil_switch_ms `auto` (the default): Python's own interval off CUDA (a real model on
    the CPU backend ran slower with a short one), AUTO_GIL_SWITCH_MS where MLX runs on CUDA."""
    import sys

    import unikern.platform
    from unikern.stages.execute import stage

    before = sys.getswitchinterval()
    seen = await _switch_intervals_seen(tiny_llama, {})
    assert seen and all(s == before for s in seen)
    assert stage.gil_switch_ms("auto") is None
    monkeypatch.setattr(unikern.platform, "cuda_is_default", lambda: True)
    assert stage.gil_switch_ms("auto") == stage.AUTO_GIL_SWITCH_MS < 5
    assert stage.gil_switch_ms(0.25) == 0.25 and stage.gil_switch_ms(None) is None


@pytest.mark.anyio
async def test_auto_overlaps_where_mlx_runs_on_cuda(tiny_llama, monkeypatch):
    """`auto` (the default): on with MLX's CUDA backend, where it was measured, off here."""
    import unikern.platform

    async with engine(tiny_llama) as eng:
        assert eng.stats()["schedule"]["overlap_windows"] is False
    monkeypatch.setattr(unikern.platform, "cuda_is_default", lambda: True)
    from unikern.stages.schedule.stage import ScheduleStage

    assert ScheduleStage.overlap_on("auto") is True
    assert ScheduleStage.overlap_on(False) is False and ScheduleStage.overlap_on(True) is True


@pytest.mark.anyio
async def test_first_windows_after_prefix_hits_and_chunked_prompts_give_mlx_lms_tokens(tiny_llama):
    """overlap_prefill where a prompt's step starts past its cached prefix, and where a
    long prompt goes in chunks (only the last samples): mlx-lm's greedy tokens, and
    first windows did follow the prompts' steps."""
    shared = [(7 * j) % 900 + 5 for j in range(48)]
    prompts = [shared + [11, 12], shared + [13], [(5 * j) % 700 + 9 for j in range(150)]]
    async with unikern.Engine.from_pipeline("generate", model=tiny_llama, overrides={
            "kv": {**SMALL_KV["kv"], "block_size": 16},
            "schedule": {"overlap_windows": True, "overlap_prefill": True, "decode_lookahead": 4,
                         "max_prefill_chunk": 64}}) as eng:
        results = [await eng.complete(prompt_tokens=p, max_tokens=10) for p in prompts]  # one at a time
        stats = eng.stats()
    # per request its first window (after the prompt's last step) and the one after it;
    # the prefix hit's one uncached token is itself a window's first step: one fewer
    assert results[1].usage.cached_tokens == 48 and stats["schedule"]["follow_ups"] == 2 * len(prompts) - 1
    for prompt, result in zip(prompts, results, strict=True):
        ok, note = compare_greedy(result.token_ids, reference_greedy(tiny_llama, prompt, 10))
        assert ok, f"prompt of {len(prompt)} tokens: {note}"


def test_a_window_continues_from_a_prompts_step_whatever_order_it_sampled_in(tiny_llama):
    """ModelRunner: a prompts' step samples its rows longest prompt first; a window
    continuing from it (`continues`) takes each row's own token, giving the tokens the same
    window fed those tokens from the host gives."""
    from mlx_lm import load

    from unikern.stages.execute.model import ModelGeometry
    from unikern.stages.execute.runner import ModelRunner
    from unikern.stages.kv.pool import KVPool

    model, _ = load(tiny_llama)
    geo = ModelGeometry(model)
    params = m.SamplingParams(max_tokens=16)
    tables = {"a": (2, 3), "b": (4, 5, 6)}
    prompts = {"a": tuple(range(5, 15)), "b": tuple(range(40, 70))}  # b longer: sampled first
    results = []
    for continues in (False, True):
        pool = KVPool(num_layers=geo.num_layers, num_kv_heads=geo.num_kv_heads, head_dim=geo.head_dim,
                      dtype=geo.dtype, block_size=16, kernel_block_size=16, num_blocks=8, slab_blocks=8)
        runner = ModelRunner(model, pool)
        first = runner.run(m.Step(1, tuple(m.SeqWork(r, p, 0, tables[r], True, params) for r, p in prompts.items()),
                                  1), {})
        window = tuple(m.SeqWork(r, (0,) if continues else (first[r][0],), len(p), tables[r], True, params,
                                 num_generated=1, continues=continues) for r, p in prompts.items())
        results.append((first, runner.run(m.Step(2, window, 4), {})))
    assert results[0] == results[1]
