"""Continuous batching policy: FCFS admission, chunked prefill under a per-step token
budget mixed with decodes, preemption by recompute when blocks run out; decode windows
(several decode steps per step) in lookahead.py. Plain synchronous code: the schedule
stage only moves messages around it."""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable
from typing import TYPE_CHECKING

import msgspec

from unikern import messages as m
from unikern.stages.kv.blocks import BlockManager, OutOfBlocks, block_hash
from unikern.stages.schedule.groups import WindowGroup, allocate_windowed, never_fits
from unikern.stages.schedule.lookahead import DecodeWindows
from unikern.stages.schedule.partial import PartialHits, drop_copy_source
from unikern.stages.schedule.sequence import (
    Refusal,
    Sequence,
    StepOutcome,
    needs_history,
    prompt_targets,
)
from unikern.stages.schedule.states import StateTracker
from unikern.stages.schedule.windows import release_out_of_window, released_window, split_window

if TYPE_CHECKING:
    from unikern.stages.execute.model import ModelGeometry


class Scheduler(DecodeWindows):
    def __init__(
        self,
        blocks: BlockManager,
        *,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        eos_token_ids: Iterable[int],
        context_length: int,
        decode_lookahead: int = 1,
        max_prefill_chunk: int | None = None,
        decode_lookahead_max: int | None = None,
        max_waiting: int | None = None,
        geometry: ModelGeometry | None = None,
        state_checkpoints: int | None = None,
        window_blocks: BlockManager | None = None,
    ) -> None:
        """`window_blocks`: the books of a mixed model's windowed layers when they keep a
        table of their own (kv_manager's layer groups); `blocks` then serves the full ones."""
        self.blocks = blocks
        # models with recurrent layers (execute.model.ModelGeometry.has_state): state slots
        # and their checkpoints at block boundaries; None for attention-only models
        has_state = geometry is not None and geometry.has_state
        self.states = StateTracker(blocks, max_num_seqs, state_checkpoints) if has_state else None
        # every attention layer windowed: blocks past every window go back (schedule.windows);
        # their table entries then name the reserved zero block, so the pool needs one
        self.window = released_window(geometry) if blocks.reserved_blocks else None
        window = split_window(geometry)
        if window_blocks is not None and window is None:
            raise ValueError("window_blocks given, but the model does not mix full and windowed layers")
        self.window_group = WindowGroup(window_blocks, window) if window_blocks is not None else None
        # plain attention: a prompt also reuses the leading part of a cached block, copied
        # in the step that first feeds it (Step.copies); recurrent states and windowed
        # tables have no such copy, so they reuse whole blocks only (partial.py)
        plain = self.states is None and self.window is None and self.window_group is None
        self.partial = PartialHits(blocks) if plain and blocks.partial_unit else None
        # admission bound: requests queued beyond it are refused as overloaded (None: no bound)
        self.max_waiting = max_waiting
        self.num_refused_overloaded = 0
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.eos_token_ids = frozenset(eos_token_ids)
        self.context_length = context_length
        self.decode_lookahead = decode_lookahead
        # while the same rows keep decoding with nobody waiting, each lookahead step
        # doubles the next one's length up to this: fewer fill/drain bubbles and engine
        # round trips; a row joining starts again from decode_lookahead
        self.decode_lookahead_max = max(decode_lookahead, decode_lookahead_max or decode_lookahead)
        self._window = decode_lookahead
        self._window_rows: tuple[str, ...] = ()
        # one sequence's share of a step: long prompts go in chunks of this size while
        # several short ones still fill the step (attention cost grows with chunk x context)
        self.max_prefill_chunk = max_prefill_chunk or max_num_batched_tokens
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.by_id: dict[str, Sequence] = {}
        self.num_preemptions = 0
        self.num_follow_ups = 0  # windows planned while the one before ran (follow_up)
        # follow_up after a one-step step too (a prompt's last chunk, a single decode step):
        # the first window of rows whose prompts are in flight (schedule.overlap_prefill)
        self.follow_prefills = False
        self._step_ids = 0

    # ---- requests in and out -----------------------------------------------------------

    def add(self, request: m.Tokenized, pinned: Iterable[int] = ()) -> Refusal | None:
        """Queue a request, or say why not: it can never be served, or `max_waiting`
        requests wait already. `pinned` blocks (one reference each) are the caller's and
        are freed at admission."""
        if request.request_id in self.by_id:
            return Refusal("bad_request", f"request id {request.request_id!r} is already in flight")
        prompt_len = len(request.prompt_tokens)
        too_big = never_fits(self.blocks, self.window, self.window_group, prompt_len + 1, self.max_prefill_chunk)
        if too_big is not None:
            return Refusal("bad_request", too_big)
        if self.max_waiting is not None and len(self.waiting) >= self.max_waiting:
            # refused at once, so callers back off instead of queueing without end
            self.num_refused_overloaded += 1
            return Refusal(
                "overloaded",
                f"overloaded: {len(self.waiting)} requests are waiting already, the limit "
                f"(schedule.max_waiting) is {self.max_waiting}; retry later, or raise it "
                f"(e.g. --set schedule.max_waiting={2 * self.max_waiting})",
            )
        seq = Sequence(
            request.request_id,
            list(request.prompt_tokens),
            prompt_len,
            request.params,
            request.processors,
            grammar=request.grammar,
            pinned=list(pinned),
        )
        self.by_id[seq.request_id] = seq
        self.waiting.append(seq)
        return None

    def abort(self, request_id: str, reason: m.FinishReason) -> m.Finished | None:
        seq = self.by_id.get(request_id)
        if seq is None:
            return None
        return self._finish(seq, reason)

    def hold(self, request_id: str) -> None:
        """Keep a queued request out of admission until `release` (its blocks load)."""
        self.by_id[request_id].held = True

    def release(self, request_id: str, pinned: Iterable[int] = ()) -> bool:
        """Make a held request admissible, handing it `pinned` blocks (freed at its
        admission). False if the request is gone: the caller keeps the pins."""
        seq = self.by_id.get(request_id)
        if seq is None or not seq.held:
            return False
        seq.held = False
        seq.pinned.extend(pinned)
        return True

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    # ---- one step -------------------------------------------------------------------

    def schedule(self) -> m.Step | None:
        if self.states is not None:  # the previous step is back: its checkpoints count now
            self.states.flush(self.by_id)
        if self.window is not None:
            for seq in self.running:
                release_out_of_window(self.blocks, seq, self.window)
        if self.window_group is not None:
            for seq in self.running:
                self.window_group.release(seq)
        budget = self.max_num_batched_tokens
        work: list[m.SeqWork] = []
        scheduled: set[str] = set()
        # running sequences first (decodes and unfinished prefills), oldest first
        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            chunk = min(len(seq.tokens) - seq.num_computed, budget, self.max_prefill_chunk)
            if not self._ensure_blocks(seq, seq.num_computed + chunk, scheduled):
                break  # seq itself was preempted; everything younger already is
            work.append(self._work(seq, chunk))
            scheduled.add(seq.request_id)
            budget -= chunk
            i += 1
        # then admit waiting requests, first come first served
        while budget > 0 and len(self.running) < self.max_num_seqs:
            seq = next((s for s in self.waiting if not s.held), None)
            if seq is None or not self._admit(seq):
                break
            self.waiting.remove(seq)
            self.running.append(seq)
            chunk = min(len(seq.tokens) - seq.num_computed, budget, self.max_prefill_chunk)
            work.append(self._work(seq, chunk))
            scheduled.add(seq.request_id)
            budget -= chunk
        if not work:
            if not self.running and self._release_pins():
                return self.schedule()  # pins of waiting requests blocked the head: retry
            return None
        self._step_ids += 1
        num_steps = self._lookahead(work)  # may give rows more blocks: build the step after
        copies = self.partial.take_copies() if self.partial is not None else ()
        return m.Step(self._step_ids, tuple(work), num_steps, copies=copies)

    def _work(self, seq: Sequence, chunk: int) -> m.SeqWork:
        start = seq.num_computed
        fields = self.states.fields(seq, start, chunk) if self.states is not None else {}
        if self.window_group is not None:
            fields["window_table"] = tuple(seq.window_blocks)
        if seq.params.prompt_logprobs is not None:
            fields["prompt_targets"] = prompt_targets(seq, start, chunk)
        return m.SeqWork(
            request_id=seq.request_id,
            token_ids=tuple(seq.tokens[start : start + chunk]),
            start_pos=start,
            block_table=tuple(seq.blocks),
            # max_tokens 0 (prompt log-probabilities alone): the prompt's end samples nothing
            sample=start + chunk == len(seq.tokens) and seq.params.max_tokens > 0,
            params=seq.params,
            num_generated=seq.num_generated,
            processors=seq.processors,
            history=tuple(seq.tokens) if start + chunk == len(seq.tokens) and needs_history(seq) else (),
            grammar=seq.grammar,
            **fields,
        )

    def _admit(self, seq: Sequence) -> bool:
        # always compute at least the last token: its logits give the next one; a request
        # for the prompt's log-probabilities computes every position (the cache keeps no logits)
        max_cached = len(seq.tokens) - 1 if seq.params.prompt_logprobs is None else 0
        if self.states is not None:  # only as far as a state checkpoint reaches
            max_cached = self.states.limit_cached(seq.tokens, max_cached)
        try:
            if self.partial is not None:
                cached = self.partial.allocate(seq, max_cached)
            elif self.window is None and self.window_group is None:
                seq.blocks, cached = self.blocks.allocate_prompt(seq.tokens, max_cached)
            else:
                cached = allocate_windowed(
                    seq, self.blocks, self.window, self.window_group, self.states, max_cached, self.max_prefill_chunk
                )
        except OutOfBlocks:
            return False
        if self.states is not None:
            self.states.admit(seq, cached)
        seq.num_computed = cached
        seq.block_hashes = self.blocks.prefix_hashes(seq.tokens)[: cached // self.blocks.block_size]
        if seq.cached_tokens is None:
            seq.cached_tokens = cached
        self.blocks.free(seq.pinned)  # the sequence holds its own references now
        seq.pinned = []
        return True

    def _release_pins(self) -> bool:
        """Unpin every waiting sequence's blocks (they stay cached, but evictable)."""
        pinned = [seq for seq in self.waiting if seq.pinned]
        for seq in pinned:
            self.blocks.free(seq.pinned)
            seq.pinned = []
        return bool(pinned)

    def _ensure_blocks(self, seq: Sequence, num_tokens: int, scheduled: set[str]) -> bool:
        """Grow seq's blocks to hold num_tokens, preempting the youngest running
        sequences (never one already in this step) while blocks are short. False when
        seq itself had to be preempted."""
        needed = self.blocks.blocks_needed(num_tokens) - len(seq.blocks)
        group = self.window_group
        while needed > self.blocks.num_free or (group is not None and group.missing(seq, num_tokens) > group.books.num_free):
            victim = self.running[-1]
            if victim.request_id in scheduled:
                raise RuntimeError("scheduler invariant broken: preempting a scheduled sequence")
            self._preempt(victim)
            if victim is seq:
                return False
        for _ in range(max(needed, 0)):
            seq.blocks.append(self.blocks.allocate_one())
        if group is not None:
            group.grow(seq, num_tokens)
        return True

    def _preempt(self, seq: Sequence) -> None:
        self.running.remove(seq)
        drop_copy_source(self.blocks, seq)
        if self.states is not None:
            self.states.release(seq.request_id)
        self.blocks.free(seq.blocks)
        seq.blocks = []
        if self.window_group is not None:
            self.window_group.free(seq)
        seq.block_hashes = []
        seq.num_computed = 0
        seq.prompt_reports = []  # the recompute reports them again
        seq.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(seq)

    # ---- results ----------------------------------------------------------------------

    def on_step_done(
        self,
        step: m.Step,
        sampled: dict[str, list[int] | int],
        logprobs: dict[str, list[m.Logprobs]] | None = None,
        failed: dict[str, str] | None = None,
        stopped: Iterable[str] = (),
        prompt_logprobs: dict[str, list[m.PromptLogprob]] | None = None,
    ) -> StepOutcome:
        """Apply a step's results (StepDone's fields): tokens with their log-probabilities,
        requests that failed alone (finished with their error, blocks freed), requests
        whose grammar completed (finished with "stop") and prompt log-probabilities."""
        outcome = StepOutcome()
        for work in step.work:  # the step has run its rows' copies: their sources may go
            drop_copy_source(self.blocks, self.by_id.get(work.request_id))
        logprobs, failed, stopped = logprobs or {}, failed or {}, frozenset(stopped)
        for work in step.work:
            seq = self.by_id.get(work.request_id)
            if seq is None or seq.num_computed != work.start_pos or seq not in self.running:
                continue  # aborted or preempted while the step ran
            if work.prompt_targets and prompt_logprobs:
                seq.prompt_reports.extend(prompt_logprobs.get(work.request_id, ()))
            if not work.sample:
                seq.num_computed += len(work.token_ids)
                self._commit_full_blocks(seq)
                if seq.params.max_tokens == 0 and seq.num_computed == len(seq.tokens):
                    outcome.finished.append(self._finish(seq, "length"))  # the prompt was all it asked
                continue
            if work.request_id in failed:
                outcome.finished.append(self._finish(seq, "error", failed[work.request_id]))
                continue
            tokens, streamed = sampled[work.request_id], seq.streamed
            seq.streamed = 0
            if isinstance(tokens, int):
                tokens = [tokens]
            if not tokens:
                continue
            take, reason = self._window_end(seq, tokens, work.request_id in stopped)
            tokens = tokens[:take]
            # one fed token per lookahead step after the first; the blocks the window
            # filled are committed once, after its tokens (a block's hash reads only
            # tokens below num_computed, all appended by then)
            seq.num_computed += len(work.token_ids) + take - 1
            first = seq.num_generated == 0
            seq.tokens.extend(tokens)
            self._commit_full_blocks(seq)
            outs = self._token_outs(seq, tokens, logprobs.get(work.request_id), first, reason)
            outcome.tokens.extend(outs[streamed:])  # the first went out while the window ran
            if reason is not None:
                outcome.finished.append(self._finish(seq, reason))
        return outcome

    def on_window_tokens(self, step: m.Step, sampled: dict[str, list[int]]) -> list[m.TokenOut]:
        """A running window's tokens so far (WindowTokens): each row's TokenOuts not sent
        yet, short of a token the row would finish at, which goes with the StepDone (the
        only place a row finishes and the books move). A row's first token waits too: it
        carries the request's stop strings and context (_token_outs)."""
        outs = []
        for work in step.work:
            seq, tokens = self.by_id.get(work.request_id), sampled.get(work.request_id)
            if not tokens or seq is None or seq.num_computed != work.start_pos or seq.num_generated == 0 \
                    or seq not in self.running:
                continue
            take, reason = self._window_end(seq, tokens, False)
            shown = take - (reason is not None)
            outs.extend(m.TokenOut(seq.request_id, t) for t in tokens[seq.streamed:shown])
            seq.streamed = max(seq.streamed, shown)
        return outs

    def _window_end(self, seq: Sequence, tokens: list[int], grammar_complete: bool) -> tuple[int, m.FinishReason | None]:
        """How many of a row's sampled tokens stand, and why the row finishes at the last
        of them (None: it goes on): the first EOS, the grammar's completion at the last,
        or a length limit after that token's append: max_tokens, the context, or the
        room of an empty pool (a windowed model's always holds the next token)."""
        n0, gen0 = len(seq.tokens), seq.num_generated
        # the count of appended tokens at which a length limit ends the row (at least 1)
        limit = min(seq.params.max_tokens - gen0, self.context_length - n0)
        if self.window is None:
            limit = min(limit, self.blocks.num_blocks * self.blocks.block_size - n0 + 1)
        limit = max(limit, 1)
        eos = self.eos_token_ids
        for i, token in enumerate(tokens[:limit]):
            if token in eos:
                return i + 1, "stop"
        if grammar_complete and len(tokens) <= limit:
            return len(tokens), "stop"
        if len(tokens) >= limit:
            return limit, "length"
        return len(tokens), None

    @staticmethod
    def _token_outs(seq: Sequence, tokens: list[int], reports: list[m.Logprobs] | None, first: bool,
                    reason: m.FinishReason | None) -> list[m.TokenOut]:
        """A row's TokenOuts: its stop strings and the prompt's last tokens ride on its
        first token, `last` on the one it finishes at."""
        rid = seq.request_id
        if reports:
            top = bool(seq.params.top_logprobs)
            outs = [m.TokenOut(rid, t, logprob=r.logprob, top_logprobs=r.top if top else None)
                    for t, r in zip(tokens, reports, strict=False)]
        else:
            outs = [m.TokenOut(rid, t) for t in tokens]
        if first:
            prompt_end = seq.num_prompt_tokens
            context = tuple(seq.tokens[max(prompt_end - m.DETOKENIZE_CONTEXT, 0) : prompt_end])
            outs[0] = msgspec.structs.replace(outs[0], stop=seq.params.stop, context=context)
        if reason is not None:
            outs[-1] = msgspec.structs.replace(outs[-1], last=True)
        return outs

    def _commit_full_blocks(self, seq: Sequence) -> None:
        bs = self.blocks.block_size
        while (len(seq.block_hashes) + 1) * bs <= seq.num_computed:
            i = len(seq.block_hashes)
            parent = seq.block_hashes[-1] if seq.block_hashes else None
            tokens = seq.tokens[i * bs : (i + 1) * bs]
            h = block_hash(parent, tokens, self.blocks.namespace)
            seq.block_hashes.append(h)
            # with its tokens, the block's leading parts are indexed too (partial hits)
            self.blocks.commit_full_block(seq.blocks[i], h, parent, tokens if self.partial is not None else None)
            if self.window_group is not None:
                self.window_group.commit(seq, i, h)

    def _finish(self, seq: Sequence, reason: m.FinishReason, error: str | None = None) -> m.Finished:
        del self.by_id[seq.request_id]
        if seq in self.running:
            self.running.remove(seq)
            if self.partial is not None:
                self.partial.keep_last_block(seq)
            self.blocks.free(seq.blocks)
            if self.window_group is not None:
                self.window_group.free(seq)
            if self.states is not None:
                self.states.release(seq.request_id)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        self.blocks.free(seq.pinned)
        drop_copy_source(self.blocks, seq)
        seq.pinned = []
        seq.blocks = []
        return m.Finished(seq.request_id, reason, seq.usage, error,
                          prompt_logprobs=seq.prompt_logprobs if error is None else None)
