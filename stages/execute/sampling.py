"""Per-request sampling over a batch of logits: greedy, temperature, top-p, seeds."""

from __future__ import annotations

import mlx.core as mx

from unikern import messages as m


def request_key(seed: int, step: int) -> mx.array:
    """A PRNG key that depends only on the request's seed and its token index, so a
    seeded request samples the same tokens whatever batch it lands in."""
    return mx.random.key((seed * 0x9E3779B1 + step * 0x85EBCA77 + 1) % (2**63))


def sample_rows(logits: mx.array, rows: list[tuple[m.SamplingParams, int, int]]) -> mx.array:
    """logits [N, V]; rows: (params, effective seed, token index) per row -> [N] ids."""
    greedy = mx.argmax(logits, axis=-1)
    if all(p.temperature == 0.0 for p, _, _ in rows):
        return greedy
    picks = []
    for i, (params, seed, step) in enumerate(rows):
        if params.temperature == 0.0:
            picks.append(greedy[i])
            continue
        row = logits[i].astype(mx.float32) / params.temperature
        if params.top_p < 1.0:
            row = _top_p(row, params.top_p)
        picks.append(mx.random.categorical(row, key=request_key(seed, step)))
    return mx.stack(picks)


def _top_p(logits: mx.array, top_p: float) -> mx.array:
    """Keep the smallest set of tokens whose probability mass reaches top_p."""
    probs = mx.softmax(logits, axis=-1)
    order = mx.argsort(-probs)
    sorted_probs = probs[order]
    cumulative = mx.cumsum(sorted_probs)
    # a token stays if the mass before it is still below top_p (the top token always stays)
    keep_sorted = (cumulative - sorted_probs) < top_p
    keep = mx.zeros_like(keep_sorted)
    keep[order] = keep_sorted
    return mx.where(keep, logits, -mx.inf)
