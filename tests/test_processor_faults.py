"""One request's fault stays its own (issue 16): a logits processor that raises, returns
anything but a float tensor of its row's shape (a slice of the row, a smaller tensor,
integers, a list), NaN everywhere, or leaves no possible token, and a grammar
matcher that fails, end that request with an `error` event (code processor_failed,
naming what was wrong) while the requests sharing its steps go on with the tokens they
give alone (mlx-lm's), and the engine keeps serving."""

from __future__ import annotations

import functools
import json

import anyio
import pytest
import torch
from conftest import SMALL_KV, compare_greedy, reference_greedy
from test_structured import json_format, schema

import unikern
from unikern.errors import RequestError
from unikern.stages.execute.structured import GrammarCompiler

pytestmark = pytest.mark.anyio

PLAIN_PROMPTS = [[5, 6, 7, 8], [40, 41, 42], [9, 9, 10], [100, 3, 3]]


def after(calls: int, fail):
    """A processor that behaves for `calls` steps, then fails: by then the request
    decodes in steps it shares with the others."""
    seen = []

    def processor(token_ids, logits):
        seen.append(len(token_ids))
        if len(seen) > calls:
            return fail(logits)
        return logits

    return processor


def raise_value_error(logits):
    raise ValueError("the user's bug")


def wrong_shape(logits):
    return torch.zeros(logits.shape[0] - 1)


def mask_everything(logits):
    return logits.fill_(-float("inf"))


FAULTY = {
    "raises": (raise_value_error, "ValueError: the user's bug"),
    "wrong_shape": (wrong_shape, "returned shape (1023,)"),
    "slice_of_the_row": (lambda logits: logits[:3], "returned shape (3,)"),  # shares the row's memory
    "integers": (lambda logits: logits.to(torch.int64), "returned dtype torch.int64"),
    "list": (lambda logits: logits.tolist(), "returned list"),
    "nan_only": (lambda logits: torch.full_like(logits, float("nan")), "NaN"),
    "no_token_left": (mask_everything, "no token is possible"),
}


async def complete_into(eng, outcomes: dict[str, object], key: str, **request) -> None:
    """Run one request; its Completion or its RequestError lands in outcomes[key]."""
    try:
        outcomes[key] = await eng.complete(**request)
    except RequestError as exc:
        outcomes[key] = exc


async def test_a_failing_processor_fails_its_request_only(tiny_llama):
    async with unikern.Engine.from_pipeline("generate", model=tiny_llama, overrides=SMALL_KV) as eng:
        outcomes: dict[str, object] = {}
        one = functools.partial(complete_into, eng, outcomes)

        async with anyio.create_task_group() as tg:
            for name, (fail, _) in FAULTY.items():
                tg.start_soon(lambda n=name, f=fail: one(n, prompt_tokens=[7, 8, 9], max_tokens=16,
                                                         logits_processors=[after(3, f)]))
            for k, prompt in enumerate(PLAIN_PROMPTS):
                tg.start_soon(lambda k=k, p=prompt: one(k, prompt_tokens=p, max_tokens=16))
        alone = [await eng.complete(prompt_tokens=p, max_tokens=16) for p in PLAIN_PROMPTS]
    for name, (_, words) in FAULTY.items():
        error = outcomes[name]
        assert isinstance(error, RequestError) and error.code == "processor_failed", (name, error)
        assert words in str(error), (name, str(error))
    for k, prompt in enumerate(PLAIN_PROMPTS):
        ok, note = compare_greedy(outcomes[k].token_ids, reference_greedy(tiny_llama, prompt, 16))
        assert ok, note
        assert outcomes[k].finish_reason == "length" and outcomes[k].token_ids == alone[k].token_ids
    assert eng.fault is None


async def test_a_processor_that_returns_its_row_or_new_values_goes_on(tiny_llama):
    def ban_first(token_ids, logits):  # masked in place: the row itself comes back
        logits[0] = -float("inf")
        return logits

    def halve(token_ids, logits):  # new values, another dtype: copied into the row
        return (logits / 2).to(torch.float16)

    def ban_second(token_ids, logits):  # masked in place, nothing returned: kept as it is
        logits[1] = -float("inf")

    async with unikern.Engine.from_pipeline("generate", model=tiny_llama, overrides=SMALL_KV) as eng:
        plain = await eng.complete(prompt_tokens=PLAIN_PROMPTS[0], max_tokens=8)
        kept = await eng.complete(prompt_tokens=PLAIN_PROMPTS[0], max_tokens=8, logits_processors=[ban_first, halve, ban_second])
    assert kept.finish_reason == "length" and len(kept.token_ids) == 8 and not {0, 1} & set(kept.token_ids)
    assert plain.token_ids and eng.fault is None


class ExplodingMatcher:
    """A grammar matcher that fails on its third token (as a matcher bug would)."""

    def __init__(self, matcher) -> None:
        self._matcher = matcher
        self._consumed = 0

    def consume_token(self, token: int) -> bool:
        self._consumed += 1
        if self._consumed == 3:
            raise RuntimeError("matcher exploded")
        return self._matcher.consume_token(token)

    def __getattr__(self, name):
        return getattr(self._matcher, name)


async def test_a_failing_grammar_matcher_fails_its_request_only(tiny_llama, monkeypatch):
    import jsonschema

    compile = GrammarCompiler.compile

    def compile_with_a_bomb(self, fmt):
        matcher = compile(self, fmt)
        return ExplodingMatcher(matcher) if fmt["type"] == "regex" else matcher

    monkeypatch.setattr(GrammarCompiler, "compile", compile_with_a_bomb)
    monkeypatch.setattr(GrammarCompiler, "matcher", lambda self, fmt: None)  # always compile
    async with unikern.Engine.from_pipeline("generate", model=tiny_llama, overrides=SMALL_KV) as eng:
        outcomes: dict[str, object] = {}
        one = functools.partial(complete_into, eng, outcomes)

        async with anyio.create_task_group() as tg:
            tg.start_soon(lambda: one("bomb", prompt="n:", max_tokens=16,
                                      response_format={"type": "regex", "pattern": "[0-9]{8}"}))
            for i in range(2):
                tg.start_soon(lambda i=i: one(f"json{i}", prompt=f"r{i}", max_tokens=128,
                                              response_format=json_format(i)))
            for k, prompt in enumerate(PLAIN_PROMPTS[:2]):
                tg.start_soon(lambda k=k, p=prompt: one(k, prompt_tokens=p, max_tokens=16))
        again = await eng.complete(prompt="n:", max_tokens=8, response_format=json_format(5))
    error = outcomes["bomb"]
    assert isinstance(error, RequestError) and error.code == "processor_failed"
    assert "RuntimeError: matcher exploded" in str(error)
    for i in range(2):
        jsonschema.validate(json.loads(outcomes[f"json{i}"].text), schema(i))
    for k, prompt in enumerate(PLAIN_PROMPTS[:2]):
        ok, note = compare_greedy(outcomes[k].token_ids, reference_greedy(tiny_llama, prompt, 16))
        assert ok, note
    assert eng.fault is None and again.token_ids
