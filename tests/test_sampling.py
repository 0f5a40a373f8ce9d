"""The vectorized sampler against mlx-lm's own sampler and logits processors on the same
logits: exact where nothing is random (greedy, top_k=1, logit_bias, penalties), by a
chi-square test over many draws where it is; and seeded requests that draw the same
tokens alone and in a batch, through the engine."""

from __future__ import annotations

import anyio
import mlx.core as mx
import numpy as np
import pytest
from conftest import SMALL_KV

import unikern
from unikern import messages as m
from unikern.stages.execute.sampling import PENALTY_CONTEXT_TOKENS, SamplingBatch

VOCAB = 64


@pytest.fixture(autouse=True)
def uncompiled_mlx_lm():
    """mlx-lm's sampling functions are mx.compile'd, which on MLX's CPU backend runs the
    C++ compiler at first use (seconds per shape); uncompiled they compute the same."""
    mx.disable_compile()
    yield
    mx.enable_compile()


def make_logits(rows: int, seed: int = 0, scale: float = 3.0) -> mx.array:
    rng = np.random.default_rng(seed)
    return mx.array((rng.standard_normal((rows, VOCAB)) * scale).astype(np.float32))


def work(rid: str, params: m.SamplingParams, history: tuple[int, ...] = (7,), num_generated: int = 0) -> m.SeqWork:
    return m.SeqWork(rid, (history[-1],), 0, (), True, params, num_generated=num_generated, history=history)


def mlx_lm_logprobs(row: mx.array) -> mx.array:
    return row - mx.logsumexp(row, axis=-1, keepdims=True)


def test_greedy_and_top_k_1_are_mlx_lm_argmax_exactly():
    from mlx_lm.sample_utils import make_sampler

    logits = make_logits(12, seed=1)
    params = [m.SamplingParams() if i % 2 else m.SamplingParams(temperature=1.5, top_k=1) for i in range(12)]
    batch = SamplingBatch([work(f"r{i}", p) for i, p in enumerate(params)], {f"r{i}": i for i in range(12)})
    ours = batch.sample(logits).tolist()
    for i, p in enumerate(params):
        sampler = make_sampler(temp=p.temperature, top_k=p.top_k)
        assert ours[i] == sampler(mlx_lm_logprobs(logits[i : i + 1])).item()


PENALTY_ROWS = [
    dict(logit_bias=((3, 5.0), (9, -100.0), (40, 2.5))),
    dict(repetition_penalty=1.7),
    dict(presence_penalty=1.25),
    dict(frequency_penalty=0.75),
    dict(repetition_penalty=0.8, presence_penalty=-0.5, frequency_penalty=1.5, logit_bias=((5, 1.0),)),
    dict(),  # a plain row in the same batch stays untouched
]
# short, exactly the window, and longer with repeats: the window is the last 20 tokens
HISTORIES = [(3, 3, 9), tuple(range(20)), (5, 5, 5, 1, 2) * 7 + (40, 40), (1, 2, 3, 4, 5, 6),
             tuple(range(30, 0, -1)) + (2, 2, 2), (8,)]


def mlx_lm_processed(row: mx.array, history: tuple[int, ...], settings: dict) -> mx.array:
    from mlx_lm.sample_utils import make_logits_processors

    bias = dict(settings.get("logit_bias", ())) or None
    processors = make_logits_processors(
        bias, settings.get("repetition_penalty"), PENALTY_CONTEXT_TOKENS,
        settings.get("presence_penalty"), PENALTY_CONTEXT_TOKENS,
        settings.get("frequency_penalty"), PENALTY_CONTEXT_TOKENS,
    )
    tokens = mx.array(history)
    for processor in processors:
        row = processor(tokens, row)
    return row


def test_logit_bias_and_penalties_match_mlx_lm_exactly():
    logits = make_logits(len(PENALTY_ROWS), seed=2)
    works = [work(f"r{i}", m.SamplingParams(**s), HISTORIES[i]) for i, s in enumerate(PENALTY_ROWS)]
    processed = SamplingBatch(works, {}).process(logits)
    for i, settings in enumerate(PENALTY_ROWS):
        theirs = mlx_lm_processed(logits[i : i + 1], HISTORIES[i], settings)
        assert mx.array_equal(processed[i : i + 1], theirs).item(), settings
        if settings:  # the setting did something
            assert not mx.array_equal(processed[i], logits[i]).item(), settings
    assert mx.array_equal(processed[-1], logits[-1]).item()


def test_penalty_windows_follow_the_tokens_on_the_device():
    """In a lookahead window the penalties see each new token, as mlx-lm's do."""
    settings = dict(repetition_penalty=1.5, presence_penalty=0.5, frequency_penalty=0.4)
    rows = [work("a", m.SamplingParams(**settings), (3, 1, 4, 1, 5)), work("b", m.SamplingParams(), (2,)),
            work("c", m.SamplingParams(**settings), tuple(range(25)))]
    batch = SamplingBatch(rows, {}, num_steps=4)
    histories = {w.request_id: list(w.history) for w in rows}
    for step in range(4):
        logits = make_logits(3, seed=10 + step, scale=0.5)  # small spread: penalties decide
        processed = batch.process(logits)
        tokens = batch.sample(processed, step)
        batch.advance(tokens)
        for i, w in enumerate(rows):
            row_settings = settings if w.request_id != "b" else {}
            theirs = mlx_lm_processed(logits[i : i + 1], tuple(histories[w.request_id]), row_settings)
            assert mx.array_equal(processed[i : i + 1], theirs).item(), (step, w.request_id)
            histories[w.request_id].append(tokens[i].item())


DISTRIBUTIONS = [
    dict(temperature=0.6),
    dict(temperature=1.3, top_p=0.8),
    dict(temperature=1.0, top_k=5),
    dict(temperature=1.0, min_p=0.1),
    dict(temperature=0.8, top_p=0.9, min_p=0.02, top_k=12),
]
DRAWS = 6000


def mlx_lm_support_and_probs(row: mx.array, settings: dict) -> np.ndarray:
    """The distribution mlx-lm's sampler draws from: its filters in its order, then
    softmax at temperature."""
    from mlx_lm.sample_utils import apply_min_p, apply_top_k, apply_top_p

    logprobs = mlx_lm_logprobs(row)
    if 0 < settings.get("top_p", 1.0) < 1.0:
        logprobs = apply_top_p(logprobs, settings["top_p"])
    if settings.get("min_p", 0.0):
        logprobs = apply_min_p(logprobs, settings["min_p"])
    if settings.get("top_k", 0):
        logprobs = apply_top_k(logprobs, settings["top_k"])
    probs = np.array(mx.softmax(logprobs * (1.0 / settings["temperature"]), axis=-1)[0]).astype(np.float64)
    return probs / probs.sum()


def goodness_of_fit(observed: np.ndarray, probs: np.ndarray) -> float:
    """Chi-square p-value of counts against probabilities (same support)."""
    from scipy.stats import chisquare

    expected = probs / probs.sum() * observed.sum()
    return chisquare(observed.astype(np.float64), expected).pvalue


def test_random_sampling_matches_mlx_lm_in_distribution():
    """Every setting in one batch (rows with different settings in one step); for each,
    DRAWS rows of distinct seeds against mlx-lm's sampler on the same logits: the same
    support, and counts that a chi-square test cannot tell apart from mlx-lm's
    distribution, nor from mlx-lm's own draws."""
    from mlx_lm.sample_utils import make_sampler
    from scipy.stats import chi2_contingency

    base = make_logits(1, seed=3, scale=1.5)
    settings_of_row = [DISTRIBUTIONS[i % len(DISTRIBUTIONS)] for i in range(DRAWS * len(DISTRIBUTIONS))]
    works = [work(f"r{i}", m.SamplingParams(**s)) for i, s in enumerate(settings_of_row)]
    batch = SamplingBatch(works, {f"r{i}": 1000 + i for i in range(len(works))})
    ours = np.array(batch.sample(mx.repeat(base, len(works), axis=0)))
    mx.random.seed(0)
    for k, settings in enumerate(DISTRIBUTIONS):
        drawn = np.bincount(ours[k :: len(DISTRIBUTIONS)], minlength=VOCAB)
        probs = mlx_lm_support_and_probs(base, settings)
        sampler = make_sampler(temp=settings["temperature"], top_p=settings.get("top_p", 0.0),
                               min_p=settings.get("min_p", 0.0), top_k=settings.get("top_k", 0))
        theirs = np.bincount(np.array(sampler(mlx_lm_logprobs(mx.repeat(base, DRAWS, axis=0)))), minlength=VOCAB)
        support = probs > 0
        assert not drawn[~support].any(), f"{settings}: drew tokens mlx-lm's filters remove"
        assert not theirs[~support].any()
        # merge the rarest tokens into one bin so every expected count is >= 5
        order = np.argsort(probs)[::-1][: support.sum()]
        keep = order[DRAWS * probs[order] >= 5]
        rest = np.setdiff1d(order, keep)
        observed = np.append(drawn[keep], drawn[rest].sum())
        expected = np.append(probs[keep], probs[rest].sum()) * DRAWS
        if expected[-1] == 0:
            observed, expected = observed[:-1], expected[:-1]
        assert goodness_of_fit(observed, expected) > 1e-4, settings
        table = np.stack([drawn[keep], theirs[keep]])
        assert chi2_contingency(table).pvalue > 1e-4, settings


def test_temperature_changes_the_distribution():
    """The chi-square test above can tell temperatures apart: a guard for the test."""
    base = make_logits(1, seed=3, scale=1.5)
    works = [work(f"r{i}", m.SamplingParams(temperature=1.0)) for i in range(DRAWS)]
    drawn = np.bincount(np.array(SamplingBatch(works, {f"r{i}": i for i in range(DRAWS)})
                                 .sample(mx.repeat(base, DRAWS, axis=0))), minlength=VOCAB)
    probs = mlx_lm_support_and_probs(base, dict(temperature=0.6))
    keep = DRAWS * probs >= 5
    assert goodness_of_fit(drawn[keep], probs[keep]) < 1e-6


def test_a_seeded_row_draws_the_same_tokens_wherever_it_sits():
    base = make_logits(1, seed=4, scale=1.0)
    params = m.SamplingParams(temperature=1.0, seed=42)
    alone = SamplingBatch([work("x", params, num_generated=3)], {"x": 42}, num_steps=4)
    others = [work(f"o{i}", m.SamplingParams(temperature=0.5 + i / 10, top_k=i)) for i in range(15)]
    crowd = SamplingBatch([*others[:9], work("x", params, num_generated=3), *others[9:]],
                          {"x": 42, **{f"o{i}": i for i in range(15)}}, num_steps=4)
    seen = [[b.sample(mx.repeat(base, b.num_rows, axis=0), s).tolist() for s in range(4)]
            for b in (alone, crowd)]
    assert [s[0] for s in seen[0]] == [s[9] for s in seen[1]]
    assert len(set(s[0] for s in seen[0])) > 1  # the token index moves the draw on


# ---- through the engine --------------------------------------------------------------


def engine(path: str, **schedule):
    return unikern.Engine.from_pipeline("generate", model=path, overrides={**SMALL_KV, "schedule": schedule})


def seeded_request(i: int) -> dict:
    """16 requests with their own seeds and settings (two of them greedy)."""
    return dict(
        prompt_tokens=[5, 6 + i, 7, 8], max_tokens=12, seed=100 + i,
        temperature=0.0 if i % 8 == 0 else 0.5 + (i % 4) / 4, top_p=(0.9, 1.0)[i % 2],
        top_k=(0, 40)[i % 3 == 0], min_p=(0.0, 0.02)[i % 5 == 0], repetition_penalty=(1.0, 1.2)[i % 4 == 1],
    )


@pytest.mark.anyio
async def test_seeded_requests_are_identical_alone_and_in_a_batch_of_16(tiny_llama):
    async with engine(tiny_llama) as eng:
        alone = [(await eng.complete(**seeded_request(i))).token_ids for i in range(16)]
        together = [None] * 16

        async def one(i):
            together[i] = (await eng.complete(**seeded_request(i))).token_ids

        async with anyio.create_task_group() as tg:
            for i in range(16):
                tg.start_soon(one, i)
        other_seed = await eng.complete(**{**seeded_request(1), "seed": 999})
    assert together == alone
    assert other_seed.token_ids != alone[1]


def mlx_lm_reference(path: str, prompt: list[int], max_tokens: int, settings: dict):
    """mlx-lm's greedy stream_generate with its logits processors for `settings`."""
    from conftest import _REFERENCE_MODELS
    from mlx_lm import load, stream_generate
    from mlx_lm.sample_utils import make_logits_processors

    from unikern.testing.reference import Reference

    if path not in _REFERENCE_MODELS:
        _REFERENCE_MODELS[path] = load(path)
    model, tokenizer = _REFERENCE_MODELS[path]
    processors = make_logits_processors(
        dict(settings.get("logit_bias", {})) or None, settings.get("repetition_penalty"), PENALTY_CONTEXT_TOKENS,
        settings.get("presence_penalty"), PENALTY_CONTEXT_TOKENS, settings.get("frequency_penalty"),
        PENALTY_CONTEXT_TOKENS,
    )
    tokens, margins, logprobs = [], [], []
    for r in stream_generate(model, tokenizer, mx.array(prompt), max_tokens=max_tokens, logits_processors=processors):
        top2 = mx.topk(r.logprobs.astype(mx.float32), 2)
        margins.append(abs(float(top2[1] - top2[0])))
        tokens.append(r.token)
        logprobs.append(np.array(r.logprobs.astype(mx.float32)))
        if r.finish_reason is not None:
            break
    return Reference(tokens, margins), logprobs


@pytest.mark.anyio
@pytest.mark.parametrize("lookahead", [1, 8])
async def test_penalized_greedy_requests_equal_mlx_lm_with_its_processors(tiny_llama, lookahead):
    """Penalties and bias through the engine, with lookahead windows (history on the
    device) and without, against mlx-lm's stream_generate with make_logits_processors."""
    from conftest import compare_greedy

    settings = [
        dict(repetition_penalty=1.3),
        dict(presence_penalty=0.8, frequency_penalty=0.6),
        dict(repetition_penalty=1.2, frequency_penalty=0.3, logit_bias={3: -100, 785: 2.0}),
    ]
    prompts = [[5, 6, 7, 8, 9], [40, 41, 42], [100, 3, 3, 3]]
    async with engine(tiny_llama, decode_lookahead=lookahead) as eng:
        results = [None] * 3

        async def one(i):
            results[i] = await eng.complete(prompt_tokens=prompts[i], max_tokens=24, **settings[i])

        async with anyio.create_task_group() as tg:
            for i in range(3):
                tg.start_soon(one, i)
        plain = await eng.complete(prompt_tokens=prompts[0], max_tokens=24)
    for i in range(3):
        ref, _ = mlx_lm_reference(tiny_llama, prompts[i], 24, settings[i])
        ok, note = compare_greedy(results[i].token_ids, ref)
        assert ok, (settings[i], note)
    assert plain.token_ids != results[0].token_ids  # the penalty changed the output


def test_the_top_p_and_top_k_cuts_take_no_gather():
    # on CUDA MLX compiles each gather kernel at run time (take_along_axis: 6.4 s on a
    # fresh H200); the filters pick each row's cut by take_row's masked max, the same values
    import re
    import tempfile

    from unikern.stages.execute.sampling import take_row

    rng = np.random.default_rng(3)
    a = np.sort(rng.standard_normal((5, VOCAB)).astype(np.float32), axis=-1)
    a[:, :7] = -np.inf
    index = mx.array(rng.integers(0, VOCAB, size=(5, 1)).astype(np.int32))
    index = mx.concatenate([index[:4], mx.array([[2]], dtype=mx.int32)])  # a row cut at -inf
    want = mx.take_along_axis(mx.array(a), index, axis=-1)
    assert mx.array_equal(take_row(mx.array(a), index), want).item()
    params = [m.SamplingParams(temperature=0.8, top_p=0.9), m.SamplingParams(temperature=1.0, top_k=5),
              m.SamplingParams(temperature=0.7, top_p=0.5, top_k=9)]
    batch = SamplingBatch([work(f"r{i}", p) for i, p in enumerate(params)], {f"r{i}": i for i in range(3)})
    tokens = batch.sample(make_logits(3, seed=4))
    with tempfile.NamedTemporaryFile("r", suffix=".dot") as f:
        mx.export_to_dot(f.name, tokens)
        labels = re.findall(r'label ="([^"]+)"', f.read())
    assert "Sort" in labels and not [label for label in labels if label.startswith("Gather")], labels
