"""One vectorized pass over a step's sampled rows, whatever each row asked for: logit bias
and penalties, top-k / top-p / min-p, temperature, seeds and log-probabilities, with the
meaning mlx-lm gives them (`make_logits_processors`, `make_sampler`, `stream_generate`)."""

from __future__ import annotations

import math
from collections.abc import Sequence

import mlx.core as mx
import numpy as np

from unikern import messages as m

# mlx-lm's default window for each penalty (repetition/presence/frequency_context_size):
# the last 20 tokens of prompt + generated text
PENALTY_CONTEXT_TOKENS = 20

_MASK64 = (1 << 64) - 1


def _mix64(z: np.ndarray) -> np.ndarray:
    """splitmix64's finalizer, elementwise on uint64 (wrapping arithmetic)."""
    z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return z ^ (z >> np.uint64(31))


def uniforms(seeds: Sequence[int], token_indices: np.ndarray) -> np.ndarray:
    """[rows, steps] floats in (0, 1), each a function of (seed, token index) alone, so a
    seeded request draws the same tokens whatever batch it lands in."""
    seed = np.array([s & _MASK64 for s in seeds], dtype=np.uint64)[:, None]
    with np.errstate(over="ignore"):
        z = _mix64(seed + np.uint64(0x9E3779B97F4A7C15))
        z = _mix64(z + token_indices.astype(np.uint64) * np.uint64(0xD1B54A32D192ED69))
    return ((z >> np.uint64(11)).astype(np.float64) + 0.5) / float(1 << 53)


def needs_history(params: m.SamplingParams) -> bool:
    return params.repetition_penalty != 1.0 or params.presence_penalty != 0.0 or params.frequency_penalty != 0.0



def position_logprobs(logits: mx.array, targets: mx.array, top: int) -> tuple[mx.array, ...]:
    """logits [n, vocab] of n positions, targets [n]: each target's log-probability under
    its position's distribution (float32 log-softmax, as mlx-lm reports log-probabilities)
    and, for top > 0, the top ids and values of each position, best first."""
    x = logits.astype(mx.float32)
    logprobs = x - mx.logsumexp(x, axis=-1, keepdims=True)
    picked = mx.take_along_axis(logprobs, targets[:, None].astype(mx.int32), axis=-1)[:, 0]
    count = min(top, logprobs.shape[-1])
    if count == 0:
        return (picked,)
    ids = mx.argpartition(-logprobs, kth=count - 1, axis=-1)[:, :count]
    values = mx.take_along_axis(logprobs, ids, axis=-1)
    order = mx.argsort(-values, axis=-1)
    return picked, mx.take_along_axis(ids, order, axis=-1), mx.take_along_axis(values, order, axis=-1)

class SamplingBatch:
    """A step's sampled rows as per-row parameter arrays, built once on the host. Rows that
    leave a feature at its neutral value cost nothing beyond the batched ops that any row
    needs; a step where every row is greedy and plain is one argmax."""

    def __init__(self, works: Sequence[m.SeqWork], seeds: dict[str, int], num_steps: int = 1) -> None:
        params = [w.params for w in works]
        self.num_rows = len(works)
        self._build_processors(works, params)
        self._build_sampler(works, params, seeds, num_steps)
        asked = [i for i, p in enumerate(params) if p.logprobs]
        self.logprob_rows = asked
        self.top_counts = [params[i].top_logprobs for i in asked]
        self._lp_index = None if len(asked) in (0, self.num_rows) else mx.array(asked)

    def _build_processors(self, works: Sequence[m.SeqWork], params: list[m.SamplingParams]) -> None:
        pairs = [(i, t, b) for i, p in enumerate(params) for t, b in p.logit_bias]
        self._bias = None
        if pairs:
            rows, ids, biases = zip(*pairs, strict=True)
            self._bias = (mx.array(rows), mx.array(ids), mx.array(biases, dtype=mx.float32))
        # mlx-lm applies no processor before there is a token to look at
        penalized = [i for i, p in enumerate(params) if needs_history(p) and works[i].history]
        self._penalty = None
        if not penalized:
            return
        width = PENALTY_CONTEXT_TOKENS
        history = np.zeros((len(penalized), width), dtype=np.int32)
        counted = np.zeros((len(penalized), width), dtype=np.float32)
        for j, i in enumerate(penalized):
            recent = works[i].history[-width:]
            # left padding repeats the oldest token kept: gathers and writes of a repeated
            # index are idempotent, and `counted` keeps it out of the frequency count
            history[j, :] = recent[0]
            history[j, width - len(recent) :] = recent
            counted[j, width - len(recent) :] = 1.0
        pick = [params[i] for i in penalized]
        self._penalty = {
            "index": None if len(penalized) == self.num_rows else mx.array(penalized),
            "repetition": _column([p.repetition_penalty for p in pick], neutral=1.0),
            "presence": _column([p.presence_penalty for p in pick], neutral=0.0),
            "frequency": _column([p.frequency_penalty for p in pick], neutral=0.0),
        }
        self._history = mx.array(history)
        self._counted = mx.array(counted)

    def _build_sampler(self, works, params, seeds: dict[str, int], num_steps: int) -> None:
        drawn = [i for i, p in enumerate(params) if p.temperature > 0]
        self._draw = None
        if not drawn:
            return
        pick = [params[i] for i in drawn]
        start = np.array([works[i].num_generated for i in drawn], dtype=np.int64)[:, None]
        u = uniforms([seeds.get(works[i].request_id, 0) for i in drawn], start + np.arange(num_steps))
        top_p = [p.top_p if 0.0 < p.top_p < 1.0 else None for p in pick]
        min_p = [math.log(p.min_p) if p.min_p > 0.0 else None for p in pick]
        top_k = [p.top_k if p.top_k > 0 else None for p in pick]
        self._draw = {
            "index": None if len(drawn) == self.num_rows else mx.array(drawn),
            "inv_temp": mx.array([[1.0 / p.temperature] for p in pick], dtype=mx.float32),
            "u": mx.array(u.astype(np.float32)),
            "top_p": _column(top_p, neutral=None),
            "log_min_p": _column(min_p, neutral=None),
            # sorted ascending, the k-th largest sits at V - k: keep the k as given
            "top_k": None if all(k is None for k in top_k) else np.array([k or 0 for k in top_k]),
        }

    # ---- on the device -------------------------------------------------------------

    def process(self, logits: mx.array) -> mx.array:
        """logit_bias, then repetition, presence and frequency penalties (mlx-lm's order)."""
        if self._bias is not None:
            rows, ids, biases = self._bias
            n, vocab = logits.shape
            logits = logits.reshape(-1).at[rows * vocab + ids].add(biases.astype(logits.dtype)).reshape(n, vocab)
        if self._penalty is None:
            return logits
        pen = self._penalty
        x = logits if pen["index"] is None else logits[pen["index"]]
        hist = self._history
        if pen["repetition"] is not None:
            factor = pen["repetition"].astype(x.dtype)
            seen = mx.take_along_axis(x, hist, axis=-1)
            x = mx.put_along_axis(x, hist, mx.where(seen < 0, seen * factor, seen / factor), axis=-1)
        if pen["presence"] is not None:
            seen = mx.take_along_axis(x, hist, axis=-1)
            x = mx.put_along_axis(x, hist, seen - pen["presence"].astype(x.dtype), axis=-1)
        if pen["frequency"] is not None:
            rows, vocab = x.shape
            flat = (mx.arange(rows)[:, None] * vocab + hist).reshape(-1)
            step = (-pen["frequency"] * self._counted).astype(x.dtype).reshape(-1)
            x = x.reshape(-1).at[flat].add(step).reshape(rows, vocab)
        return x if pen["index"] is None else set_rows(logits, pen["index"], x)

    def advance(self, tokens: mx.array) -> None:
        """Append a lookahead step's tokens to the penalty windows, on the device."""
        if self._penalty is None:
            return
        new = tokens if self._penalty["index"] is None else tokens[self._penalty["index"]]
        self._history = mx.concatenate([self._history[:, 1:], new.astype(mx.int32)[:, None]], axis=1)
        ones = mx.ones((new.shape[0], 1), dtype=mx.float32)
        self._counted = mx.concatenate([self._counted[:, 1:], ones], axis=1)

    def sample(self, logits: mx.array, step: int = 0) -> mx.array:
        """[N] token ids (uint32): argmax for greedy rows; for the others top-p, min-p and
        top-k on the log-probabilities, then an inverse-CDF draw at temperature."""
        greedy = mx.argmax(logits, axis=-1)
        draw = self._draw
        if draw is None:
            return greedy
        x = logits if draw["index"] is None else logits[draw["index"]]
        x = x.astype(mx.float32)
        if any(draw[f] is not None for f in ("top_p", "top_k", "log_min_p")):
            x = self._filter(x - mx.logsumexp(x, axis=-1, keepdims=True))  # mlx-lm filters log-probs
        # the softmax's own normalization makes the draw the same with or without it
        cdf = mx.cumsum(mx.softmax(x * draw["inv_temp"], axis=-1), axis=-1)
        target = draw["u"][:, step : step + 1] * cdf[:, -1:]
        picks = mx.minimum((cdf < target).sum(axis=-1), x.shape[-1] - 1).astype(mx.uint32)
        return picks if draw["index"] is None else set_rows(greedy, draw["index"], picks)

    def _filter(self, logprobs: mx.array) -> mx.array:
        """Each of mlx-lm's filters keeps the tokens at or above a per-row threshold, and
        each keeps a top set of the same order, so applying them in turn (as mlx-lm does)
        is keeping what clears the highest of the three thresholds."""
        draw = self._draw
        vocab = logprobs.shape[-1]
        floor = mx.array(-math.inf, dtype=mx.float32)
        thresholds = []
        ascending = None
        if draw["top_p"] is not None:  # mlx-lm's apply_top_p, one top_p per row
            ascending = mx.sort(logprobs, axis=-1)
            top_p = mx.where(mx.isnan(draw["top_p"]), 1.0, draw["top_p"])
            probs = mx.exp(ascending)
            mass_above = mx.cumsum(probs, axis=-1, reverse=True, inclusive=False)
            total = mass_above[:, :1] + probs[:, :1]
            dropped = (mass_above >= top_p * total).sum(axis=-1, keepdims=True)
            cut = take_row(ascending, mx.minimum(dropped, vocab - 1))
            thresholds.append(mx.where(mx.isnan(draw["top_p"]), floor, cut))
        if draw["top_k"] is not None:
            k = np.where(draw["top_k"] < vocab, draw["top_k"], 0)  # k >= vocab keeps every token
            if ascending is None:
                # the k-th largest is among the largest max(k): a partial selection (topk)
                # instead of a full sort (on MLX's CPU backend 32 x 2048: 0.5 vs 3.7 ms)
                ascending = mx.sort(mx.topk(logprobs, max(int(k.max()), 1), axis=-1), axis=-1)
            width = ascending.shape[-1]
            position = mx.array(np.where(k > 0, width - k, 0)[:, None])
            thresholds.append(mx.where(mx.array(k[:, None] > 0), take_row(ascending, position), floor))
        if draw["log_min_p"] is not None:
            top = mx.max(logprobs, axis=-1, keepdims=True)
            thresholds.append(mx.where(mx.isnan(draw["log_min_p"]), floor, top + draw["log_min_p"]))
        threshold = thresholds[0]
        for t in thresholds[1:]:
            threshold = mx.maximum(threshold, t)
        return mx.where(logprobs < threshold, -math.inf, logprobs)

    def logprobs(self, logits: mx.array, tokens: mx.array) -> tuple[mx.array, ...] | None:
        """For the rows that asked: the chosen token's log-probability under the processed
        logits (before temperature and filters, as mlx-lm reports it) and the top ids and
        values, sorted, as many as the most demanding row wants."""
        if not self.logprob_rows:
            return None
        index = self._lp_index
        x = logits if index is None else logits[index]
        chosen = tokens if index is None else tokens[index]
        return position_logprobs(x, chosen, max(self.top_counts))

    def logprob_reports(self, steps: list[list]) -> list[list[m.Logprobs]]:
        """Host side: per asking row, one report per step from the evaluated `logprobs`
        results (as lists); alternatives that are impossible (-inf) are left out."""
        reports: list[list[m.Logprobs]] = [[] for _ in self.logprob_rows]
        for result in steps:
            picked = result[0]
            for j, want in enumerate(self.top_counts):
                top = ()
                if want:
                    pairs = zip(result[1][j][:want], result[2][j][:want], strict=True)
                    top = tuple(m.TopLogprob(int(t), float(v)) for t, v in pairs if v > -math.inf)
                reports[j].append(m.Logprobs(float(picked[j]), top))
        return reports


def take_row(a: mx.array, index: mx.array) -> mx.array:
    """a [N, W] (float) at one position per row, index [N, 1]: the same values as
    take_along_axis, by a masked max over the row. MLX runs these ops from kernels it was
    built with; on CUDA its take_along_axis is a gather it compiles at run time (6.4 s on a
    fresh H200: tools/results/h200/startup-1b-read-ahead.json), which the warm-up's top-p
    draw would otherwise wait on."""
    hit = mx.arange(a.shape[-1], dtype=index.dtype)[None] == index
    return mx.where(hit, a, -math.inf).max(axis=-1, keepdims=True)


def set_rows(a: mx.array, index: mx.array, rows: mx.array) -> mx.array:
    """`a` with `a[index] = rows`, as a new array (the caller's `a` stays as it was)."""
    where = mx.broadcast_to(index.reshape(-1, *([1] * (a.ndim - 1))), rows.shape)
    return mx.put_along_axis(a, where, rows, axis=0)


def _column(values: list, neutral) -> mx.array | None:
    """A [rows, 1] float32 column, or None when every row is neutral (the op is skipped);
    a neutral None becomes NaN, which the caller turns into "off" for that row."""
    if all(v == neutral for v in values) if neutral is not None else all(v is None for v in values):
        return None
    column = [math.nan if v is None else v for v in values]
    return mx.array(column, dtype=mx.float32)[:, None]


def row_is_usable(logits: mx.array, rows: list[int]) -> mx.array:
    """[len(rows)] bool: some token is still possible and nothing is NaN (a processor or a
    grammar may have masked a row entirely, or written garbage into it)."""
    x = logits[mx.array(rows)]
    return (mx.max(x, axis=-1) > -math.inf) & ~mx.any(mx.isnan(x), axis=-1)
