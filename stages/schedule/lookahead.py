"""Decode windows: a step whose rows are all plain decodes runs several decode steps
back to back (`decode_lookahead`, doubling up to `decode_lookahead_max` while the same
rows keep decoding and nobody waits), and the window after one can be planned while it
runs (`follow_up`, schedule.overlap_windows). A window never preempts: it takes only
blocks that are free. Part of `Scheduler` (policy.py), whose books these methods read.
Plain synchronous code."""

from __future__ import annotations

from collections import deque

from unikern import messages as m
from unikern.stages.kv.blocks import BlockManager
from unikern.stages.schedule.groups import WindowGroup
from unikern.stages.schedule.sequence import Sequence, needs_history
from unikern.stages.schedule.states import StateTracker

# a window may run past the end of rows that reach max_tokens inside it (their extra tokens
# are dropped, as after an EOS) while those wasted row-steps stay under 1/WASTE_SHARE of it:
# a round trip to the host saved for a little compute
WASTE_SHARE = 8


def window_steps(window: int, remaining: list[int], room: list[int]) -> int:
    """A decode window's length for rows with `remaining` tokens to go and `room` left in
    the context: at most `window` and every row's room (no row writes past its context),
    and as long as the longest row needs unless the rows it outlives would waste more
    than 1/WASTE_SHARE of the window's row-steps; then the longest such length that does
    not (at least the shortest row's)."""
    cap = min(window, min(room))
    # the shortest row's length wastes nothing, so one always qualifies
    return next(steps for steps in sorted({min(r, cap) for r in remaining}, reverse=True)
                if WASTE_SHARE * sum(max(0, steps - r) for r in remaining) <= len(remaining) * steps)


class DecodeWindows:
    """The decode windows of `Scheduler`, which mixes them in: the attributes below are
    the scheduler's (set in its __init__), as is `_work` (a sequence's next SeqWork)."""

    blocks: BlockManager
    window_group: WindowGroup | None
    window: int | None
    states: StateTracker | None
    waiting: deque[Sequence]
    running: list[Sequence]
    by_id: dict[str, Sequence]
    context_length: int
    decode_lookahead: int
    decode_lookahead_max: int
    follow_prefills: bool
    num_follow_ups: int
    _window: int
    _window_rows: tuple[str, ...]
    _step_ids: int

    def _lookahead(self, work: list[m.SeqWork]) -> int:
        """How many decode steps to run back to back: more than one only when every row
        is a plain decode, nobody waits to join, and each row still has that many
        tokens to go and blocks already free for them (lookahead never preempts)."""
        if self.decode_lookahead <= 1 or self.waiting:
            self._window_rows = ()
            return 1
        # processors and grammars run on the host between steps, so their rows go one
        # step at a time (penalties and log-probabilities stay on the device: windows)
        if any(len(w.token_ids) != 1 or not w.sample or w.processors or w.grammar is not None for w in work):
            self._window_rows = ()
            return 1
        rows = tuple(w.request_id for w in work)
        # rows that only left (finished) keep the window growing: a shorter one would not
        # let anybody join sooner (nobody waits, or this step would not be a window)
        if rows == self._window_rows or (self._window_rows and set(rows) <= set(self._window_rows)):
            self._window = min(2 * self._window, self.decode_lookahead_max)
        else:
            self._window = self.decode_lookahead
        self._window_rows = rows
        seqs = [self.by_id[w.request_id] for w in work]
        steps = window_steps(self._window, [s.params.max_tokens - s.num_generated for s in seqs],
                             [self.context_length - len(s.tokens) for s in seqs])
        if steps <= 1 or not self._reserve_window([(seq, seq.num_computed + steps) for seq in seqs]):
            return 1
        # the rows must name the blocks just added
        work[:] = [self._work(seq, 1) for seq in seqs]
        return steps

    def _reserve_window(self, ends: list[tuple[Sequence, int]]) -> bool:
        """Give each sequence blocks (and windowed-layer blocks) for its tokens up to its
        `end`, if all of them are free; False, and nothing taken, if not (a window never
        preempts)."""
        group = self.window_group
        extra = sum(self.blocks.blocks_needed(end) - len(seq.blocks) for seq, end in ends)
        if extra > self.blocks.num_free:
            return False
        if group is not None and sum(group.missing(seq, end) for seq, end in ends) > group.books.num_free:
            return False
        for seq, end in ends:
            for _ in range(self.blocks.blocks_needed(end) - len(seq.blocks)):
                seq.blocks.append(self.blocks.allocate_one())
            if group is not None:
                group.grow(seq, end)
        return True

    def follow_up(self, prev: m.Step) -> m.Step | None:
        """The window after `prev` (still in flight) for the same rows, planned before
        prev's tokens are back (`schedule.overlap_windows`): each row as if prev's
        num_steps tokens were all generated and none ended it. Its rows feed the token
        prev sampled last, which stays on the device (`SeqWork.continues`). None when
        the batch may change: someone waits, prev was not a window of plain decodes (with
        `follow_prefills`: nor a one-step step whose every row samples, a prompt's last
        chunk or a decode step, each row running), a row ends by length within prev, or
        blocks are short. Rows that end early (EOS, abort) are dropped when prev's results
        arrive: the follow-up's tokens for them are ignored (on_step_done), and what it
        writes lands past their last token."""
        first = prev.num_steps == 1  # the rows' first window (follow_prefills)
        if (first and not self.follow_prefills) or self.waiting or self.states is not None \
                or self.window is not None or self.window_group is not None:
            return None
        seqs = []
        for w in prev.work:
            seq = self.by_id.get(w.request_id)
            if seq is None or seq not in self.running or (len(w.token_ids) != 1 and not first) or not w.sample \
                    or w.processors or w.grammar is not None or needs_history(seq):
                return None
            seqs.append(seq)
        rows = tuple(w.request_id for w in prev.work)
        if first:
            if len(seqs) != len(self.running):
                return None  # a running row outside prev (a prompt's earlier chunk) is not in it
        elif rows != self._window_rows:
            return None
        # after prev: each row's tokens to go, and room in the context (prev's last token
        # goes to position start_pos + its fed tokens + num_steps - 1)
        remaining = [seq.params.max_tokens - (w.num_generated + prev.num_steps) for w, seq in zip(prev.work, seqs, strict=True)]
        starts = [w.start_pos + len(w.token_ids) + prev.num_steps - 1 for w in prev.work]
        room = [self.context_length - start - 1 for start in starts]
        if min(remaining) < 1:
            return None  # a row ends by length within prev: the batch changes
        window = self.decode_lookahead if first else min(2 * self._window, self.decode_lookahead_max)
        steps = window_steps(window, remaining, room)
        if steps < 2:
            return None
        if not self._reserve_window([(seq, start + steps) for seq, start in zip(seqs, starts, strict=True)]):
            return None
        self._window = window
        self._window_rows = rows
        work = [
            m.SeqWork(request_id=seq.request_id, token_ids=(0,), start_pos=start, block_table=tuple(seq.blocks),
                      sample=True, params=seq.params, num_generated=w.num_generated + prev.num_steps, continues=True)
            for w, seq, start in zip(prev.work, seqs, starts, strict=True)
        ]
        self._step_ids += 1
        self.num_follow_ups += 1
        return m.Step(self._step_ids, tuple(work), steps)
