"""Decode lookahead: several decode steps per scheduled step give the same tokens."""

from __future__ import annotations

import hashlib

from hypothesis import given, settings
from hypothesis import strategies as st

from unikern import messages as m
from unikern.stages.kv.blocks import BlockManager
from unikern.stages.schedule.policy import Scheduler
from unikern.stages.schedule.sequence import Sequence

EOS = 999


def next_token(request_id: str, context: list[int]) -> int:
    digest = hashlib.blake2b(f"{request_id}:{context}".encode(), digest_size=4).digest()
    token = int.from_bytes(digest, "little") % 500 + 10
    return EOS if token % 97 == 0 else token


def window_tokens(request_id: str, context: list[int], steps: int) -> list[int]:
    """What a row samples over `steps` decode steps after `context` (next_token's)."""
    ctx, toks = list(context), []
    for _ in range(steps):
        toks.append(next_token(request_id, ctx))
        ctx.append(toks[-1])
    return toks


def run(lookahead: int, num_blocks: int = 64, block_size: int = 16, lookahead_max: int | None = None,
        steps_seen: list[int] | None = None):
    blocks = BlockManager(num_blocks, block_size)
    sched = Scheduler(blocks, max_num_seqs=8, max_num_batched_tokens=64, eos_token_ids=[EOS],
                      context_length=512, decode_lookahead=lookahead, decode_lookahead_max=lookahead_max)
    contexts: dict[str, list[int]] = {}
    for i in range(6):
        prompt = tuple(range(5 + i, 25 + 3 * i))
        sched.add(m.Tokenized(f"r{i}", prompt, m.SamplingParams(max_tokens=20 + i)))
        contexts[f"r{i}"] = list(prompt)
    out: dict[str, list[int]] = {k: [] for k in contexts}
    reasons = {}
    multi_steps = 0
    for _ in range(500):
        step = sched.schedule()
        if step is None:
            break
        multi_steps += step.num_steps > 1
        if steps_seen is not None:
            steps_seen.append(step.num_steps)
        sampled = {}
        for w in step.work:
            seq = sched.by_id[w.request_id]
            # every position the run will write must already have a block
            assert blocks.blocks_needed(w.start_pos + len(w.token_ids) + step.num_steps - 1) <= len(w.block_table)
            if w.sample:
                sampled[w.request_id] = window_tokens(w.request_id, seq.tokens, step.num_steps)
        outcome = sched.on_step_done(step, sampled)
        for t in outcome.tokens:
            out[t.request_id].append(t.token_id)
        for f in outcome.finished:
            reasons[f.request_id] = (f.reason, f.usage.completion_tokens)
    assert not sched.has_work() and blocks.num_used == 0
    return out, reasons, multi_steps


def test_lookahead_gives_the_same_tokens_and_stops_exactly():
    base, base_reasons, base_multi = run(1)
    ahead, ahead_reasons, multi = run(4)
    assert base_multi == 0 and multi > 0
    assert ahead == base
    assert ahead_reasons == base_reasons
    for rid, (reason, count) in ahead_reasons.items():
        assert count == len(ahead[rid])
        assert reason == "stop" or count == 20 + int(rid[1:])


def test_lookahead_never_preempts_for_its_blocks():
    # a pool so small that lookahead cannot reserve ahead: it falls back to single steps
    out, reasons, _ = run(4, num_blocks=12, block_size=8)
    base, base_reasons, _ = run(1, num_blocks=12, block_size=8)
    assert out == base and reasons == base_reasons


def test_lookahead_grows_while_the_batch_stays_the_same():
    steps: list[int] = []
    out, reasons, _ = run(2, num_blocks=256, lookahead_max=16, steps_seen=steps)
    base, base_reasons, _ = run(1, num_blocks=256)
    assert out == base and reasons == base_reasons
    assert max(steps) > 2  # grew past where it started while no row joined or left
    fixed: list[int] = []
    run(2, num_blocks=256, steps_seen=fixed)
    assert max(fixed) == 2  # without a maximum it stays where it started


def test_lookahead_window_restarts_when_the_batch_changes():
    blocks = BlockManager(256, 16)
    sched = Scheduler(blocks, max_num_seqs=8, max_num_batched_tokens=64, eos_token_ids=[EOS],
                      context_length=512, decode_lookahead=2, decode_lookahead_max=32)

    def step_once():
        step = sched.schedule()
        sched.on_step_done(step, {w.request_id: [11] * step.num_steps for w in step.work if w.sample})
        return step.num_steps

    sched.add(m.Tokenized("a", tuple(range(5, 15)), m.SamplingParams(max_tokens=200)))
    assert [step_once() for _ in range(5)] == [1, 2, 4, 8, 16]
    sched.add(m.Tokenized("b", tuple(range(5, 15)), m.SamplingParams(max_tokens=200)))
    assert step_once() == 1  # b's prefill (a waits for nobody, but the step is mixed)
    assert [step_once() for _ in range(3)] == [2, 4, 8]
    sched.abort("a", "cancelled")  # a row leaving lets nobody join sooner: the window goes on growing
    assert step_once() == 16


def test_a_window_runs_past_rows_that_end_inside_it_while_little_is_wasted():
    from unikern.stages.schedule.lookahead import window_steps

    # one row a token ahead of 63 others (it was prefilled alone): one window for all,
    # not a window and then a one-step tail
    assert window_steps(32, [10] * 63 + [9], [1000] * 64) == 10
    assert window_steps(16, [16] * 7 + [2], [1000] * 8) == 16  # 14 of 128 row-steps wasted
    assert window_steps(32, [10, 1], [1000, 1000]) == 1  # 9 of 20 would be wasted
    assert window_steps(32, [12] * 7 + [3], [1000] * 8) == 12  # 9 of 96
    assert window_steps(32, [12, 12, 12, 3], [1000] * 4) == 3  # 9 of 48 would be wasted
    assert window_steps(32, [12, 12, 3, 3], [1000] * 4) == 3  # 18 of 48: the shortest row's
    assert window_steps(32, [40] * 4, [1000] * 4) == 32  # the window's cap
    assert window_steps(32, [40] * 4, [1000, 1000, 5, 1000]) == 5  # nobody writes past its context


def test_rows_ending_inside_a_window_stop_exactly_at_max_tokens():
    blocks = BlockManager(256, 16)
    sched = Scheduler(blocks, max_num_seqs=8, max_num_batched_tokens=64, eos_token_ids=[EOS],
                      context_length=512, decode_lookahead=8, decode_lookahead_max=8)
    for i in range(8):
        sched.add(m.Tokenized(f"r{i}", (5, 6, 7), m.SamplingParams(max_tokens=9 if i else 8)))
    step = sched.schedule()
    sched.on_step_done(step, {w.request_id: [11] for w in step.work})
    window = sched.schedule()
    assert window.num_steps == 8  # r0 needs 7 more, the others 8: one window for all
    outcome = sched.on_step_done(window, {w.request_id: [11] * 8 for w in window.work})
    assert {f.request_id: (f.reason, f.usage.completion_tokens) for f in outcome.finished} == {
        f"r{i}": ("length", 8 if i == 0 else 9) for i in range(8)
    }
    assert not sched.has_work() and blocks.num_used == 0


def _one_token_at_a_time(n0, gen0, max_tokens, context_length, pool_tokens, eos, tokens, grammar_complete):
    """The rule a window's tokens follow, applied token by token: the row ends at the
    first EOS (or at its last token when its grammar completed), else at the first token
    after which max_tokens, the context or an empty pool's room is reached."""
    for i, token in enumerate(tokens):
        count = i + 1
        if token in eos or (grammar_complete and i == len(tokens) - 1):
            return count, "stop"
        if gen0 + count >= max_tokens or n0 + count >= context_length or n0 + count > pool_tokens:
            return count, "length"
    return len(tokens), None


@given(prompt_len=st.integers(1, 40), generated=st.integers(0, 30), max_tokens=st.integers(1, 60),
       context_length=st.integers(8, 90), num_blocks=st.integers(1, 12),
       window=st.lists(st.sampled_from([5, 6, 7, EOS]), min_size=1, max_size=33), grammar_complete=st.booleans())
@settings(max_examples=400, deadline=None)
def test_a_windows_end_is_the_one_token_at_a_time_rule(prompt_len, generated, max_tokens, context_length,
                                                     num_blocks, window, grammar_complete):
    """Scheduler.on_step_done takes a lookahead window's tokens row by row: which stand and
    why the row ends must be what the per-token rule gives."""
    blocks = BlockManager(num_blocks, 4)
    sched = Scheduler(blocks, max_num_seqs=8, max_num_batched_tokens=64, eos_token_ids=[EOS],
                      context_length=context_length)
    seq = Sequence("r", list(range(prompt_len + generated)), prompt_len, m.SamplingParams(max_tokens=max_tokens))
    got = sched._window_end(seq, window, grammar_complete)
    assert got == _one_token_at_a_time(prompt_len + generated, generated, max_tokens, context_length,
                                       num_blocks * 4, {EOS}, window, grammar_complete)
