"""The continuous-batching policy, driven by a fake execute over a fake paged KV pool.

The fake execute writes each step's tokens into slots named by the block table, reads
the whole context back through the table, and samples a token that is a pure function
of the request id and that context. So a wrong block table, a stale or overwritten
block, a bad start position or a lost token changes the output, and a request that was
preempted and recomputed must produce exactly the tokens it produces without
preemption."""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from dataclasses import dataclass, field

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from unikern import messages as m
from unikern.stages.kv.blocks import BlockManager
from unikern.stages.schedule.policy import Scheduler

EOS = 0
VOCAB = 64  # EOS comes up about once in 64 samples


def fake_token(request_id: str, context: tuple[int, ...]) -> int:
    digest = hashlib.blake2b(repr((request_id, context)).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") % VOCAB


def never_eos(request_id: str, context: tuple[int, ...]) -> int:
    return 1 + fake_token(request_id, context) % (VOCAB - 1)


@dataclass
class Run:
    """A scheduler, a fake KV pool and everything observed while driving them."""

    sched: Scheduler
    sample_fn: Callable[[str, tuple[int, ...]], int] = fake_token
    slots: dict[tuple[int, int], int] = field(default_factory=dict)  # (block, offset) -> token
    tokens: dict[str, list[int]] = field(default_factory=dict)  # prompt + streamed tokens
    prompt_len: dict[str, int] = field(default_factory=dict)
    outs: dict[str, list[m.TokenOut]] = field(default_factory=dict)
    finished: dict[str, m.Finished] = field(default_factory=dict)
    steps: list[m.Step] = field(default_factory=list)
    first_start: dict[str, int] = field(default_factory=dict)  # start_pos when first scheduled
    num_steps: int = 0

    @property
    def bs(self) -> int:
        return self.sched.blocks.block_size

    def add(self, request_id: str, prompt: list[int], max_tokens: int = 8, **params) -> str | None:
        refusal = self.sched.add(
            m.Tokenized(request_id, tuple(prompt), m.SamplingParams(max_tokens=max_tokens, **params))
        )
        if refusal is None:
            self.tokens[request_id] = list(prompt)
            self.prompt_len[request_id] = len(prompt)
            self.outs[request_id] = []
        return None if refusal is None else refusal.message

    def abort(self, request_id: str) -> m.Finished | None:
        blocks_before = self.sched.blocks.num_used
        done = self.sched.abort(request_id, "cancelled")
        if done is not None:
            assert done.reason == "cancelled"
            assert self.sched.blocks.num_used <= blocks_before
            self._record_finished(done)
        return done

    # ---- one step ---------------------------------------------------------------------

    def schedule(self) -> m.Step | None:
        step = self.sched.schedule()
        if step is not None:
            self.check_step(step)
            self.steps.append(step)
        return step

    def check_step(self, step: m.Step) -> None:
        sched, blocks = self.sched, self.sched.blocks
        ids = [w.request_id for w in step.work]
        assert len(ids) == len(set(ids)), f"a sequence scheduled twice in one step: {ids}"
        assert len(ids) <= sched.max_num_seqs
        assert 0 < sum(len(w.token_ids) for w in step.work) <= sched.max_num_batched_tokens
        private: dict[int, str] = {}
        for w in step.work:
            record = self.tokens[w.request_id]
            end = w.start_pos + len(w.token_ids)
            assert w.token_ids, w
            assert end <= len(record) and w.token_ids == tuple(record[w.start_pos : end]), w
            assert w.sample == (end == len(record)), w
            assert w.num_generated == len(record) - self.prompt_len[w.request_id]
            assert len(w.block_table) == len(set(w.block_table))
            assert len(w.block_table) * self.bs >= end
            assert all(blocks.ref_counts[b] >= 1 for b in w.block_table)
            # every position before start_pos holds the right token: computed or reused
            assert self.read(w.block_table, w.start_pos) == tuple(record[: w.start_pos]), w
            self.first_start.setdefault(w.request_id, w.start_pos)
            # the blocks written this step belong to this sequence alone
            for pos in range(w.start_pos, end):
                b = w.block_table[pos // self.bs]
                assert blocks.ref_counts[b] == 1, f"{w.request_id} writes shared block {b}"
                assert private.setdefault(b, w.request_id) == w.request_id

    def read(self, block_table: tuple[int, ...], num_tokens: int) -> tuple[int, ...]:
        return tuple(self.slots.get((block_table[p // self.bs], p % self.bs)) for p in range(num_tokens))

    def execute(self, step: m.Step) -> dict[str, int]:
        sampled = {}
        for w in step.work:
            for i, token in enumerate(w.token_ids):
                p = w.start_pos + i
                self.slots[(w.block_table[p // self.bs], p % self.bs)] = token
            if w.sample:
                context = self.read(w.block_table, w.start_pos + len(w.token_ids))
                sampled[w.request_id] = self.sample_fn(w.request_id, context)
        return sampled

    def done(self, step: m.Step, sampled: dict[str, int]) -> None:
        outcome = self.sched.on_step_done(step, sampled)
        for out in outcome.tokens:
            assert out.token_id == sampled[out.request_id]
            self.tokens[out.request_id].append(out.token_id)
            self.outs[out.request_id].append(out)
        for fin in outcome.finished:
            self._record_finished(fin)
        ended = {f.request_id for f in outcome.finished}
        assert {o.request_id for o in outcome.tokens if o.last} == ended

    def _record_finished(self, fin: m.Finished) -> None:
        assert fin.request_id not in self.finished, f"{fin.request_id} finished twice"
        self.finished[fin.request_id] = fin
        assert fin.usage.prompt_tokens == self.prompt_len[fin.request_id]
        assert fin.usage.completion_tokens == len(self.outs[fin.request_id])

    def step(self) -> m.Step | None:
        step = self.schedule()
        if step is not None:
            self.done(step, self.execute(step))
        self.num_steps += 1
        return step

    def drain(self, max_steps: int = 2000) -> None:
        while self.sched.has_work():
            assert self.num_steps < max_steps, "no progress: livelock or deadlock"
            assert self.step() is not None, "work left but nothing schedulable"
        self.check_idle()

    def check_idle(self) -> None:
        sched = self.sched
        assert not sched.waiting and not sched.running and not sched.by_id
        assert sched.blocks.num_used == 0
        assert set(self.finished) == set(self.tokens)

    def generated(self, request_id: str) -> list[int]:
        return self.tokens[request_id][self.prompt_len[request_id] :]


def make_run(
    num_blocks: int = 64,
    block_size: int = 4,
    *,
    max_num_seqs: int = 8,
    max_num_batched_tokens: int = 64,
    context_length: int = 4096,
    sample_fn=fake_token,
    eos=(EOS,),
) -> Run:
    blocks = BlockManager(num_blocks, block_size, namespace=b"test")
    sched = Scheduler(
        blocks,
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=max_num_batched_tokens,
        eos_token_ids=eos,
        context_length=context_length,
    )
    return Run(sched, sample_fn)


def prompt(seed: int, length: int) -> list[int]:
    return [1 + (seed * 31 + i * 7) % (VOCAB - 1) for i in range(length)]


# ---- admission and budget -------------------------------------------------------------


def test_admission_is_first_come_first_served():
    run = make_run(max_num_seqs=2, max_num_batched_tokens=64, sample_fn=never_eos)
    for i, rid in enumerate("abcde"):
        run.add(rid, prompt(i, 5), max_tokens=3)
    first = run.step()
    assert [w.request_id for w in first.work] == ["a", "b"]
    run.drain()
    admitted = list(dict.fromkeys(w.request_id for s in run.steps for w in s.work))
    assert admitted == list("abcde")
    assert list(run.finished) == list("abcde")


def test_a_request_that_does_not_fit_is_not_overtaken():
    # 8 blocks of 4: "big" waits for "holder"'s blocks; "small" would fit now but queues behind
    run = make_run(num_blocks=8, sample_fn=never_eos)
    run.add("holder", prompt(0, 16), max_tokens=2)
    run.step()
    run.add("big", prompt(1, 20))
    run.add("small", prompt(2, 3))
    step = run.step()
    assert [w.request_id for w in step.work] == ["holder"]
    run.drain()
    order = list(dict.fromkeys(w.request_id for s in run.steps for w in s.work))
    assert order == ["holder", "big", "small"]


def test_long_prompt_is_chunked_and_sampled_only_at_the_end():
    run = make_run(max_num_batched_tokens=8, sample_fn=never_eos)
    run.add("long", prompt(0, 20), max_tokens=2)
    chunks = []
    while not run.outs["long"]:
        step = run.step()
        (w,) = step.work
        chunks.append((w.start_pos, len(w.token_ids), w.sample))
    assert chunks == [(0, 8, False), (8, 8, False), (16, 4, True)]
    run.drain()
    assert run.finished["long"].usage == m.Usage(20, 2, 0)


def test_decodes_and_prefill_chunks_share_a_step():
    run = make_run(max_num_batched_tokens=8, sample_fn=never_eos)
    run.add("a", prompt(0, 5), max_tokens=10)
    run.add("b", prompt(1, 5), max_tokens=10)
    first = run.step()
    assert [(w.request_id, len(w.token_ids), w.sample) for w in first.work] == [("a", 5, True), ("b", 3, False)]
    run.add("c", prompt(2, 30), max_tokens=2)
    second = run.step()
    shape = [(w.request_id, w.start_pos, len(w.token_ids), w.sample) for w in second.work]
    # a decodes, b finishes its prefill, c starts on what is left of the budget
    assert shape == [("a", 5, 1, True), ("b", 3, 2, True), ("c", 0, 5, False)]
    third = run.step()
    shape = [(w.request_id, len(w.token_ids), w.sample) for w in third.work]
    assert shape == [("a", 1, True), ("b", 1, True), ("c", 6, False)]
    run.drain()


# ---- finishing ------------------------------------------------------------------------


def test_max_tokens_finishes_with_length():
    run = make_run(sample_fn=never_eos)
    run.add("r", prompt(0, 6), max_tokens=4)
    run.drain()
    assert run.finished["r"].reason == "length"
    assert run.finished["r"].usage == m.Usage(6, 4, 0)
    outs = run.outs["r"]
    assert [o.last for o in outs] == [False, False, False, True]


def test_eos_finishes_with_stop_and_counts_the_eos_token():
    def eos_third(request_id, context):
        return EOS if len(context) == 8 else 5

    run = make_run(sample_fn=eos_third)
    run.add("r", prompt(0, 6), max_tokens=50, stop=("\n",))
    run.drain()
    assert run.generated("r") == [5, 5, EOS]
    assert run.finished["r"].reason == "stop"
    assert run.finished["r"].usage == m.Usage(6, 3, 0)
    outs = run.outs["r"]
    assert [o.last for o in outs] == [False, False, True]
    assert [o.stop for o in outs] == [("\n",), (), ()]  # stop strings ride on the first token


def test_context_length_and_pool_size_finish_with_length():
    run = make_run(context_length=10, sample_fn=never_eos)
    run.add("ctx", prompt(0, 7), max_tokens=50)
    run.drain()
    assert run.finished["ctx"].reason == "length"
    assert len(run.tokens["ctx"]) == 10

    # 4 blocks of 4 hold 16 tokens: the 17th could never be computed
    run = make_run(num_blocks=4, sample_fn=never_eos)
    run.add("pool", prompt(0, 10), max_tokens=50)
    run.drain(max_steps=50)
    assert run.finished["pool"].reason == "length"
    assert run.finished["pool"].usage.completion_tokens == 7


def test_abort_frees_blocks_at_once_and_drops_in_flight_results():
    run = make_run(sample_fn=never_eos)
    run.add("a", prompt(0, 9), max_tokens=20)
    run.add("b", prompt(1, 9), max_tokens=20)
    run.step()
    used_by_both = run.sched.blocks.num_used
    step = run.schedule()  # in flight when the abort arrives
    done = run.abort("a")
    assert done == m.Finished("a", "cancelled", m.Usage(9, 1, 0))
    assert run.sched.blocks.num_used == used_by_both - 3
    run.done(step, run.execute(step))
    assert len(run.outs["a"]) == 1  # the in-flight token is dropped
    assert run.abort("a") is None
    assert all(w.request_id != "a" for w in run.step().work)
    run.drain()
    assert run.finished["b"].reason == "length"


def test_a_reused_request_id_ignores_the_old_requests_in_flight_step():
    run = make_run(sample_fn=never_eos)
    run.add("a", prompt(0, 6), max_tokens=3)
    step = run.schedule()  # a's prefill from position 0 is in flight
    run.abort("a")
    del run.finished["a"]
    run.add("a", prompt(5, 9), max_tokens=3)  # the caller reuses the id at once
    run.done(step, run.execute(step))
    assert run.outs["a"] == []
    run.drain()
    assert run.finished["a"].usage == m.Usage(9, 3, 0)
    assert run.first_start["a"] == 0


def test_abort_of_a_waiting_request():
    run = make_run(max_num_seqs=1, sample_fn=never_eos)
    run.add("a", prompt(0, 4))
    run.add("b", prompt(1, 4))
    run.step()
    assert run.abort("b") == m.Finished("b", "cancelled", m.Usage(4, 0, 0))
    run.drain()
    assert all(w.request_id == "a" for s in run.steps for w in s.work)


# ---- refusing what can never run --------------------------------------------------------


def test_prompt_larger_than_the_pool_is_refused():
    run = make_run(num_blocks=4, block_size=4)
    error = run.add("huge", prompt(0, 40))
    assert error is not None and "KV pool" in error and "16" in error
    assert not run.sched.has_work() and run.sched.blocks.num_used == 0
    assert run.add("ok", prompt(0, 12)) is None
    assert run.add("ok", prompt(0, 3)) is not None  # the id is in flight
    run.drain()


# ---- preemption ---------------------------------------------------------------------------


def test_the_youngest_is_preempted_and_requeued_ahead_of_later_arrivals():
    # 6 blocks of 4: a and b (8-token prompts) fill them by 12 tokens each; c waits
    run = make_run(num_blocks=6, max_num_seqs=2, sample_fn=never_eos)
    run.add("a", prompt(0, 8), max_tokens=8)
    run.add("b", prompt(1, 8), max_tokens=8)
    run.add("c", prompt(2, 8), max_tokens=2)
    while run.sched.num_preemptions == 0:
        step = run.step()
    assert [w.request_id for w in step.work] == ["a"]  # a grew, b (younger) made room
    assert [seq.request_id for seq in run.sched.waiting] == ["b", "c"]
    run.drain(max_steps=100)
    resumed = next(s for s in run.steps if any(w.request_id == "c" for w in s.work))
    assert [w.request_id for w in resumed.work][0] == "b"
    # b's own committed blocks were still cached: only its tail was recomputed
    b_restart = next(w for w in resumed.work if w.request_id == "b")
    assert b_restart.start_pos == 8 and b_restart.sample
    assert run.finished["b"].usage.cached_tokens == 0  # reported at first admission only


def sixteen_requests(run: Run) -> None:
    for i in range(16):
        assert run.add(f"r{i:02d}", prompt(i, 5 + (i * 5) % 9), max_tokens=4 + i % 7) is None


def test_tiny_pool_completes_everything_with_the_same_tokens():
    roomy = make_run(num_blocks=256)
    sixteen_requests(roomy)
    roomy.drain()
    assert roomy.sched.num_preemptions == 0

    # 8 blocks of 4 tokens: about two sequences at a time
    tiny = make_run(num_blocks=8, max_num_seqs=8, max_num_batched_tokens=16)
    sixteen_requests(tiny)
    tiny.drain(max_steps=1500)
    assert tiny.sched.num_preemptions > 0
    for rid in roomy.tokens:
        assert tiny.generated(rid) == roomy.generated(rid), rid
        assert tiny.finished[rid].reason == roomy.finished[rid].reason
        assert tiny.finished[rid].usage.completion_tokens == roomy.finished[rid].usage.completion_tokens
    assert tiny.sched.blocks.num_used == 0


# ---- prefix cache -------------------------------------------------------------------------


def test_shared_prefix_is_served_from_the_cache_once_committed():
    run = make_run(block_size=4, sample_fn=never_eos)
    system = prompt(7, 10)  # two full blocks and change
    run.add("first", system + [1, 2], max_tokens=3)
    run.add("same_step", system + [3], max_tokens=3)
    run.step()  # both admitted before anything was committed
    run.add("later", system + [4, 5, 6], max_tokens=3)
    run.drain()
    assert run.finished["first"].usage.cached_tokens == 0
    assert run.finished["same_step"].usage.cached_tokens == 0
    assert run.finished["later"].usage.cached_tokens == 8
    assert run.first_start["later"] == 8


# ---- random workloads -------------------------------------------------------------------

PREFIXES = [prompt(100, 24), prompt(200, 24)]


@st.composite
def workloads(draw):
    block_size = draw(st.sampled_from([1, 2, 4, 8]))
    # mostly pools too small for every request at once, so preemption happens
    capacity_tokens = draw(st.one_of(st.integers(8, 40), st.integers(8, 120)))
    num_blocks = max(2, capacity_tokens // block_size)
    max_num_seqs = draw(st.integers(1, 6))
    budget = draw(st.integers(max_num_seqs, 40))
    context_length = draw(st.sampled_from([12, 30, 4096]))
    requests = []
    for i in range(draw(st.integers(1, 10))):
        shared = draw(st.sampled_from([None, 0, 1]))
        head = [] if shared is None else PREFIXES[shared][: draw(st.integers(1, 24))]
        tail = draw(st.lists(st.integers(1, VOCAB - 1), max_size=12))
        tokens = (head + tail) or [1]
        requests.append(
            dict(
                rid=f"r{i}",
                tokens=tokens,
                max_tokens=draw(st.integers(1, 10)),
                arrive=draw(st.integers(0, 12)),
                abort=draw(st.one_of(st.none(), st.integers(0, 30))),
            )
        )
    return block_size, num_blocks, max_num_seqs, budget, context_length, requests


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(workloads())
def test_random_workloads_keep_every_invariant(workload):
    block_size, num_blocks, max_num_seqs, budget, context_length, requests = workload
    run = make_run(
        num_blocks, block_size, max_num_seqs=max_num_seqs,
        max_num_batched_tokens=budget, context_length=context_length,
    )
    blocks = run.sched.blocks
    capacity = num_blocks * block_size
    expected_cached: dict[str, int] = {}
    accepted = set()
    for t in range(1000):
        for r in requests:
            if r["arrive"] == t:
                error = run.add(r["rid"], r["tokens"], max_tokens=r["max_tokens"])
                assert (error is None) == (len(r["tokens"]) + 1 <= capacity)
                if error is None:
                    accepted.add(r["rid"])
            if r["abort"] == t and r["rid"] in accepted and r["rid"] not in run.finished:
                run.abort(r["rid"])
        if t > 12 and not run.sched.has_work():
            break
        # what a first admission would find in the cache before this step
        lookups = {}
        for seq in run.sched.waiting:
            if seq.request_id not in run.first_start:
                hashes = blocks.prefix_hashes(seq.tokens)
                hit = blocks.lookup_prefix(hashes)[: (len(seq.tokens) - 1) // block_size]
                lookups[seq.request_id] = len(hit) * block_size
        evictions = blocks.evictions
        new = set(run.first_start)
        step = run.schedule()
        new = set(run.first_start) - new
        if blocks.evictions == evictions:  # the cache did not change under the admissions
            for rid in new:
                expected_cached[rid] = lookups[rid]
                assert run.first_start[rid] == lookups[rid]
        if step is None:
            assert not run.sched.has_work()
            continue
        run.done(step, run.execute(step))
        assert blocks.num_used <= num_blocks
    else:
        pytest.fail("requests still running after 1000 steps")
    run.check_idle()
    assert set(run.finished) == accepted
    for rid, fin in run.finished.items():
        if fin.reason != "cancelled":
            assert run.outs[rid] and run.outs[rid][-1].last
        assert fin.usage.cached_tokens == expected_cached.get(rid, fin.usage.cached_tokens)
        if rid in run.first_start:
            assert fin.usage.cached_tokens == run.first_start[rid]
