"""Recurrent layers on the execute side: the cache adapter through which mlx-lm's own
layer code (Mamba, gated delta nets) reads and writes a request's state slot, and the
step preparation that restores slots before a forward and saves block checkpoints."""

from __future__ import annotations

from collections.abc import Callable

import mlx.core as mx
import msgspec

from unikern import messages as m
from unikern.stages.kv.state_pool import StatePool


class StateLayerCache:
    """What one recurrent layer sees as its `ArraysCache` during one forward: its state
    arrays gathered at the batch's slots, written back there in place. Rows are never
    padded (the runner batches equal lengths), so mlx-lm's padding fields stay None."""

    left_padding = None
    lengths = None

    def __init__(self, pool: StatePool, layer: int, slots: mx.array) -> None:
        self.pool = pool
        self.layer = layer
        self.slots = slots

    def __getitem__(self, i: int) -> mx.array:
        return self.pool.arrays[self.layer][i][self.slots]

    def __setitem__(self, i: int, value: mx.array) -> None:
        target = self.pool.arrays[self.layer][i]
        target[self.slots] = value.astype(target.dtype)

    def advance(self, num_tokens: int) -> None:
        pass  # positions live in the scheduler's books

    def make_mask(self, num_tokens: int) -> None:
        return None  # no padded steps to mask

    @property
    def state(self):  # the state pool is the state
        return ()


def prepare_states(pool: StatePool, step: m.Step, run_unsampled: Callable[[m.Step], None]) -> tuple[m.Step, list]:
    """Before a step: restore (or zero) the slots rows start from, then run every piece
    of a prefill chunk that ends at a checkpoint before its last one, saving the state
    there. Returns the step left to run (each row's last piece) and the (slot, checkpoint)
    copies to make after it."""
    highest = max((max(w.state_slot, *(s for _, s in w.state_saves), 0) for w in step.work), default=0)
    pool.ensure_capacity(highest + 1)
    pool.copy([(w.state_from, w.state_slot) for w in step.work if w.state_from >= 0])
    rounds: list[list[tuple[m.SeqWork, int]]] = []
    final: list[m.SeqWork] = []
    after: list[tuple[int, int]] = []
    for w in step.work:
        start, end = w.start_pos, w.start_pos + len(w.token_ids)
        for r, (pos, slot) in enumerate(sorted(w.state_saves)):
            if pos == end:  # the chunk's own end: saved after the step
                after.append((w.state_slot, slot))
                break
            piece = w.token_ids[start - w.start_pos : pos - w.start_pos]
            if len(rounds) <= r:
                rounds.append([])
            rounds[r].append((_piece(w, piece, start, sample=False), slot))
            start = pos
        final.append(_piece(w, w.token_ids[start - w.start_pos :], start, sample=w.sample))
    for pieces in rounds:  # round r: the r-th piece of every row that has one
        run_unsampled(m.Step(step.step_id, tuple(p for p, _ in pieces), 1))
        pool.copy([(p.state_slot, slot) for p, slot in pieces])
    return msgspec.structs.replace(step, work=tuple(final)), after


def _piece(w: m.SeqWork, tokens: tuple[int, ...], start: int, sample: bool) -> m.SeqWork:
    at = start - w.start_pos  # the prompt targets of the piece's own positions
    return msgspec.structs.replace(w, token_ids=tokens, start_pos=start, sample=sample, state_from=-1, state_saves=(),
                                   prompt_targets=w.prompt_targets[at : at + len(tokens)])
