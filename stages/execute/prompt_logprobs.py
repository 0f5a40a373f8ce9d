"""Prompt log-probabilities (SamplingParams.prompt_logprobs) in the prefill step: the
logits of every fed position, not only the last, log-softmaxed on the device; only each
target token's value and the top ids and values go to the host."""

from __future__ import annotations

import math
from typing import Any

import mlx.core as mx
import msgspec

from unikern import messages as m
from unikern.stages.execute.layouts import BatchLayout
from unikern.stages.execute.paged_cache import TOKEN_DTYPE, flat_positions, rows_at
from unikern.stages.execute.sampling import position_logprobs

# (request id, target ids, alternatives wanted, the device arrays: picked[, ids, values])
Pending = tuple[str, tuple[int, ...], int, tuple[mx.array, ...]]


def prompt_forward(runner: Any, group: list[m.SeqWork], rows: list, window_rows: list | None
                   ) -> tuple[mx.array, list[Pending]]:
    """The group's forward (ModelRunner._logits' op-by-op path) with the logits of every
    position of the rows that ask: (logits [B, vocab] at each row's last token, what each
    asking row reports, evaluated). The head runs over an asking row's target positions
    only; the other rows' over their last position, as without prompt log-probabilities."""
    layout = BatchLayout.build(runner.pool, rows)
    window_layout = BatchLayout.build(runner.window_pool, window_rows) if window_rows else None
    caches = runner._caches(layout, [w.state_slot for w in group], window_layout)
    T = layout.num_tokens
    inputs = mx.array([list(w.token_ids) + [0] * (T - len(w.token_ids)) for w in group], dtype=TOKEN_DTYPE)
    last = flat_positions(layout.last_index, T)
    if runner.head is not None:
        hidden = runner.model.model(inputs, cache=caches)

        def head(i: int, n: int) -> mx.array:
            return runner.head(hidden[i, :n])

        logits = runner.head(rows_at(hidden, last))
    else:
        full = runner.model(inputs, cache=caches)

        def head(i: int, n: int) -> mx.array:
            return full[i, :n]

        logits = rows_at(full, last)
    pending = []
    for i, w in enumerate(group):
        if w.prompt_targets:
            n = len(w.prompt_targets)
            top = w.params.prompt_logprobs or 0
            arrays = position_logprobs(head(i, n), mx.array(w.prompt_targets), top)
            # one row's [n, vocab] float32 at a time (512 x 152k is 311 MB), not the group's
            mx.eval(*arrays)
            pending.append((w.request_id, w.prompt_targets, top, arrays))
    return logits, pending


def pending_arrays(pending: list[Pending]) -> list[mx.array]:
    return [a for *_, arrays in pending for a in arrays]


def prompt_reports(pending: list[Pending]) -> dict[str, list[m.PromptLogprob]]:
    """Host side, once the arrays are evaluated: each asking row's reports, in position
    order; alternatives that are impossible (-inf) are left out."""
    reports: dict[str, list[m.PromptLogprob]] = {}
    for rid, targets, top, arrays in pending:
        picked = arrays[0].tolist()
        ids = arrays[1].tolist() if top else [[]] * len(targets)
        values = arrays[2].tolist() if top else [[]] * len(targets)
        reports.setdefault(rid, []).extend(
            m.PromptLogprob(token, lp, tuple(m.TopLogprob(int(t), v) for t, v in zip(ti, tv, strict=True)
                                             if v > -math.inf))
            for token, lp, ti, tv in zip(targets, picked, ids, values, strict=True)
        )
    return reports


def with_prompt_reports(done: m.StepDone, reports: dict[str, list[m.PromptLogprob]],
                        before: list[m.StepDone] = ()) -> m.StepDone:
    """`done` carrying `reports`, after those of steps run before it for the same rows (a
    recurrent model's prefill pieces up to its state checkpoints), in order."""
    merged: dict[str, list[m.PromptLogprob]] = {}
    for part in (*(b.prompt_logprobs for b in before), done.prompt_logprobs, reports):
        for rid, items in part.items():
            merged.setdefault(rid, []).extend(items)
    if not merged:
        return done
    kept = {rid: items for rid, items in merged.items() if rid not in done.failed}
    return msgspec.structs.replace(done, prompt_logprobs=kept)
