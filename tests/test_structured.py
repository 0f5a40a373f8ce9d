"""Structured output (response_format) on a random-weight model: 16 concurrent requests
with their own JSON schemas all validate, a regex and a Lark grammar match, constrained
and free requests share steps (the free ones still equal mlx-lm), masks cross the
bridge without a copy, formats compile once off the event loop, bad ones are a
bad_request, and a grammar that completes ends its request with "stop"."""

from __future__ import annotations

import json
import re
import threading

import anyio
import pytest
from conftest import SMALL_KV, compare_greedy, reference_greedy

import unikern
from unikern.errors import RequestError
from unikern.platform import bridge_stats

pytestmark = pytest.mark.anyio

COLORS = ["red", "green", "blue"]


def schema(i: int) -> dict:
    """Nested objects, arrays, enums, required fields and bounded numbers, different per
    request. Numbers carry multipleOf: a random model never stops adding digits."""
    properties = {
        "id": {"type": "integer", "minimum": i, "maximum": 100 + i},
        "name": {"type": "string", "minLength": 1, "maxLength": 6},
        "score": {"type": "number", "minimum": -5, "maximum": 5, "multipleOf": 0.25},
        "color": {"enum": COLORS[: 1 + i % 3]},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 4}, "minItems": 1, "maxItems": 3},
        "inner": {
            "type": "object",
            "properties": {"ok": {"type": "boolean"}, "n": {"type": "integer", "minimum": 0, "maximum": 9}},
            "required": ["ok", "n"],
            "additionalProperties": False,
        },
    }
    required = ["id", "name", "color", "inner", "score" if i % 2 else "tags"]
    return {"type": "object", "properties": properties, "required": required, "additionalProperties": False}


def json_format(i: int) -> dict:
    return {"type": "json_schema", "json_schema": {"name": f"record{i}", "schema": schema(i), "strict": True}}


def engine(path: str):
    return unikern.Engine.from_pipeline("generate", model=path, overrides=SMALL_KV)


async def test_sixteen_schemas_a_regex_and_free_requests_in_shared_steps(tiny_llama):
    import jsonschema

    free_prompts = [[5, 6, 7, 8], [40, 41, 42]]
    async with engine(tiny_llama) as eng:
        await eng.complete(prompt_tokens=[5], max_tokens=1)  # the runner exists once a step ran
        runner = eng._router.stages["execute"].runner
        execute, step_kinds = runner.execute, []

        def spy(step, seeds):  # which kinds of rows each step samples
            step_kinds.append({w.grammar is not None for w in step.work if w.sample})
            return execute(step, seeds)

        runner.execute = spy
        views_before = bridge_stats()["zero_copy_views"]
        results: dict[str, unikern.Completion] = {}

        async def one(key, **request):
            results[key] = await eng.complete(**request)

        async with anyio.create_task_group() as tg:
            for i in range(16):  # half greedy, half sampled
                tg.start_soon(lambda i=i: one(i, prompt=f"record {i}:", max_tokens=160, response_format=json_format(i),
                                              temperature=0.0 if i % 2 else 0.8, seed=i))
            tg.start_soon(lambda: one("regex", prompt="phone:", max_tokens=32,
                                      response_format={"type": "regex", "pattern": r"\+1 [0-9]{3}-[0-9]{4}"}))
            for k, prompt in enumerate(free_prompts):
                tg.start_soon(lambda k=k, p=prompt: one(f"free{k}", prompt_tokens=p, max_tokens=24))
        stats = eng.stats()["bridge"]
    for i in range(16):
        jsonschema.validate(json.loads(results[i].text), schema(i))
        assert results[i].finish_reason == "stop"
    assert re.fullmatch(r"\+1 [0-9]{3}-[0-9]{4}", results["regex"].text)
    for k, prompt in enumerate(free_prompts):
        ok, note = compare_greedy(results[f"free{k}"].token_ids, reference_greedy(tiny_llama, prompt, 24))
        assert ok, note
    assert any(kinds == {True, False} for kinds in step_kinds)  # shared steps
    assert stats["copies"] == 0 and stats["zero_copy_views"] > views_before


async def test_formats_compile_once_off_the_event_loop_and_bad_ones_are_bad_requests(tiny_llama):
    loop_thread = threading.get_ident()
    async with engine(tiny_llama) as eng:
        compiler = eng._router.stages["tokenize"].grammars
        compile_threads = []
        compile = compiler.compile

        def watched(fmt):
            compile_threads.append(threading.get_ident())
            return compile(fmt)

        compiler.compile = watched
        for _ in range(3):
            result = await eng.complete(prompt="x", max_tokens=128, response_format=json_format(3))
            json.loads(result.text)
        assert compiler.compiled == 1 and len(compile_threads) == 1
        assert compile_threads[0] != loop_thread
        bad = [
            {"type": "json_schema", "json_schema": {"name": "b", "schema": {"type": "frobnicate"}}},
            {"type": "regex", "pattern": "a(b"},
            {"type": "grammar", "grammar": "start: (("},
            {"type": "json_schema", "json_schema": {"name": "b", "schema": "not an object"}},
        ]
        for fmt in bad:
            with pytest.raises(RequestError) as caught:
                await eng.complete(prompt="x", max_tokens=8, response_format=fmt)
            assert caught.value.code == "bad_request" and "response_format" in str(caught.value)
        after = await eng.complete(prompt="x", max_tokens=4)  # still serving
    assert eng.fault is None and len(after.token_ids) == 4


async def test_a_completed_grammar_ends_with_stop_and_eos_stays_exact(tiny_llama):
    """A grammar that can take nothing more ends the request at once ("stop", no EOS
    token); while it is incomplete EOS is masked, even when biased to win."""
    async with engine(tiny_llama) as eng:
        eos = sorted(eng._router.resources["tokenizer"].eos_token_ids)[0]
        digits = await eng.complete(prompt="n:", max_tokens=16, response_format={"type": "regex", "pattern": "[0-9]{3}"})
        forced = await eng.complete(prompt="w:", max_tokens=16, logit_bias={eos: 100.0},
                                    response_format={"type": "regex", "pattern": "[a-z]{5}"})
        free = await eng.complete(prompt="w:", max_tokens=16, logit_bias={eos: 100.0})
        # a random model never closes its strings: a bias on "}" closes the object instead
        close = eng._router.resources["tokenizer"].encode("}", add_special_tokens=False)
        obj = await eng.complete(prompt="o:", max_tokens=16, logit_bias={close[0]: 10.0},
                                 response_format={"type": "json_object"})
        lark = await eng.complete(prompt="a:", max_tokens=16, response_format={
            "type": "grammar", "grammar": 'start: "yes" | "no" | "maybe " NUM\nNUM: /[0-9]/'})
    assert digits.finish_reason == "stop" and re.fullmatch("[0-9]{3}", digits.text) and eos not in digits.token_ids
    # incomplete, EOS cannot win; complete, EOS (now allowed, +100) ends it exactly
    assert re.fullmatch("[a-z]{5}", forced.text) and forced.finish_reason == "stop"
    assert free.token_ids == [eos] and free.finish_reason == "stop"  # the bias alone ends it at once
    assert json.loads(obj.text) == {} and obj.finish_reason == "stop"
    assert re.fullmatch("yes|no|maybe [0-9]", lark.text) and lark.finish_reason == "stop"
