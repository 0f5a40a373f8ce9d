"""Log-probabilities through the engine against mlx-lm's `stream_generate` (its
`logprobs`: log-softmax of the logits after the logits processors, before temperature),
within 1e-4 on a float32 model, with and without lookahead windows and penalties."""

from __future__ import annotations

import math

import anyio
import numpy as np
import pytest
from conftest import SMALL_KV
from test_sampling import mlx_lm_reference

import unikern
from unikern import messages as m

TOLERANCE = 1e-4


async def stream(eng, **request) -> list[m.TokenEvent]:
    events = []
    async for event in eng.generate(**request):
        if isinstance(event, m.TokenEvent):
            events.append(event)
        else:
            assert isinstance(event, m.DoneEvent), event
    return events


def check_against(events: list[m.TokenEvent], reference: list[np.ndarray], top: int) -> None:
    for step, (event, theirs) in enumerate(zip(events, reference, strict=False)):
        assert abs(event.logprob - theirs[event.token_id]) < TOLERANCE, (step, event.logprob, theirs[event.token_id])
        values = [t.logprob for t in event.top_logprobs]
        assert len(values) == top and values == sorted(values, reverse=True)
        best = np.sort(theirs)[::-1][:top]
        assert np.allclose(values, best, atol=TOLERANCE), step
        for t in event.top_logprobs:  # ids agree where the values are not near-tied
            assert abs(t.logprob - theirs[t.token_id]) < TOLERANCE
        # the chosen token is listed whenever it ranks among the top ones
        if event.logprob >= values[-1] + TOLERANCE:
            assert event.token_id in [t.token_id for t in event.top_logprobs]


@pytest.mark.anyio
@pytest.mark.parametrize("lookahead", [1, 8])
async def test_logprobs_equal_mlx_lm_stream_generate(tiny_llama, lookahead):
    """Three requests at once (one penalized, one not asking): each one's reports match
    mlx-lm's own logprobs for the same prompt and processors."""
    overrides = {**SMALL_KV, "schedule": {"decode_lookahead": lookahead}}
    prompts = [[5, 6, 7, 8, 9], [40, 41, 42], [7, 7, 100]]
    settings = [{}, dict(repetition_penalty=1.3, frequency_penalty=0.2), {}]
    async with unikern.Engine.from_pipeline("generate", model=tiny_llama, overrides=overrides) as eng:
        results = [None] * 3

        async def one(i):
            asks = dict(logprobs=True, top_logprobs=5) if i < 2 else {}
            results[i] = await stream(eng, prompt_tokens=prompts[i], max_tokens=16, **asks, **settings[i])

        async with anyio.create_task_group() as tg:
            for i in range(3):
                tg.start_soon(one, i)
    for i in range(2):
        ref, logprobs = mlx_lm_reference(tiny_llama, prompts[i], 16, settings[i])
        ours = [e.token_id for e in results[i]]
        agree = next((k for k, (a, b) in enumerate(zip(ours, ref.tokens, strict=False)) if a != b), len(ours))
        assert agree == len(ours) or ref.margins[agree] < 1e-3, (i, agree)
        check_against(results[i][:agree], logprobs, top=5)
    assert all(e.logprob is None and e.top_logprobs is None for e in results[2])


@pytest.mark.anyio
async def test_sampled_tokens_report_their_own_logprob(tiny_llama):
    """At temperature the chosen token is often not the best: its logprob is its own, and
    it appears in the top list exactly when it ranks there; logprobs without
    top_logprobs gives no list."""
    async with unikern.Engine.from_pipeline("generate", model=tiny_llama, overrides=SMALL_KV) as eng:
        events = await stream(eng, prompt_tokens=[5, 6, 7], max_tokens=24, temperature=2.0, seed=3,
                              logprobs=True, top_logprobs=3)
        bare = await stream(eng, prompt_tokens=[5, 6, 7], max_tokens=4, logprobs=True)
    ranked_low = 0
    for event in events:
        listed = {t.token_id: t.logprob for t in event.top_logprobs}
        if event.token_id in listed:
            assert math.isclose(listed[event.token_id], event.logprob, abs_tol=1e-6)
        else:
            ranked_low += 1
            assert event.logprob < min(listed.values())
    assert ranked_low > 0  # the temperature made some choices outside the top 3
    assert all(e.logprob is not None and e.logprob <= 0 and e.top_logprobs is None for e in bare)
