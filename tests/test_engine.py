"""The library API: asyncio and trio, concurrency, cancellation, sampling, stop strings."""

from __future__ import annotations

import contextlib

import anyio
import pytest

import unikern
from tests.conftest import SMALL_KV

pytestmark = pytest.mark.anyio

BOTH = pytest.mark.parametrize("anyio_backend", ["asyncio", "trio"])


def engine(path, **overrides):
    return unikern.Engine.from_pipeline("generate", model=path, overrides={**SMALL_KV, **overrides})


@BOTH
async def test_many_concurrent_generate_calls(tiny_llama):
    async with engine(tiny_llama) as eng:
        results = {}

        async def one(i):
            results[i] = await eng.complete(prompt_tokens=[5 + i, 6, 7, 8 + i], max_tokens=6 + i % 3)

        async with anyio.create_task_group() as tg:
            for i in range(16):
                tg.start_soon(one, i)
        assert all(r.finish_reason == "length" for r in results.values())
        assert [len(results[i].token_ids) for i in range(16)] == [6 + i % 3 for i in range(16)]
        assert eng.stats()["kv"]["blocks_used"] == 0


@BOTH
async def test_cancelling_the_callers_scope_frees_blocks(tiny_llama):
    async with engine(tiny_llama) as eng:
        seen = 0
        with anyio.move_on_after(30) as timeout:
            async with anyio.create_task_group() as tg:

                async def consume():
                    nonlocal seen
                    async with contextlib.aclosing(eng.generate(prompt_tokens=list(range(5, 40)), max_tokens=1000)) as events:
                        async for _ in events:
                            seen += 1
                            if seen == 3:
                                tg.cancel_scope.cancel()

                for _ in range(4):
                    tg.start_soon(consume)
        assert not timeout.cancelled_caught
        assert seen >= 3
        with anyio.fail_after(5):
            while eng.stats()["kv"]["blocks_used"] or eng.in_flight():  # noqa: ASYNC110 (polling stats, as a client would)
                await anyio.sleep(0.01)


async def test_cancel_by_id_reports_cancelled(tiny_llama):
    async with engine(tiny_llama) as eng:
        events = []
        async with contextlib.aclosing(eng.generate(prompt="hello", max_tokens=500, request_id="long")) as stream:
            async for event in stream:
                events.append(event)
                if len(events) == 2:
                    assert eng.cancel("long")
        # the stream was closed by cancel(); the request ends as cancelled inside the engine
        with anyio.fail_after(5):
            while eng.in_flight():  # noqa: ASYNC110 (polling, as a client would)
                await anyio.sleep(0.01)
        assert eng.stats()["kv"]["blocks_used"] == 0
        assert not eng.cancel("long")


async def test_duplicate_request_id_is_refused(tiny_llama):
    async with engine(tiny_llama) as eng:
        first = eng.generate(prompt="a", max_tokens=50, request_id="same")
        await first.__anext__()
        with pytest.raises(unikern.RequestError, match="already in flight"):
            await eng.generate(prompt="b", request_id="same").__anext__()
        await first.aclose()


async def test_seeded_sampling_is_reproducible_and_batch_independent(tiny_llama):
    async with engine(tiny_llama) as eng:
        alone = await eng.complete(prompt="x = ", max_tokens=12, temperature=1.0, seed=42)
        results = {}

        async def one(i):
            results[i] = await eng.complete(prompt="x = ", max_tokens=12, temperature=1.0, seed=42 if i == 0 else i)

        async with anyio.create_task_group() as tg:
            for i in range(6):
                tg.start_soon(one, i)
        other = await eng.complete(prompt="x = ", max_tokens=12, temperature=1.0, seed=7)
        greedy = await eng.complete(prompt="x = ", max_tokens=12)
    assert results[0].token_ids == alone.token_ids
    assert other.token_ids != alone.token_ids
    assert alone.token_ids != greedy.token_ids


async def test_top_p_tiny_is_greedy(tiny_llama):
    async with engine(tiny_llama) as eng:
        greedy = await eng.complete(prompt="import os", max_tokens=10)
        nucleus = await eng.complete(prompt="import os", max_tokens=10, temperature=1.5, top_p=1e-6, seed=3)
    assert nucleus.token_ids == greedy.token_ids


async def test_stop_string_ends_request_and_is_not_emitted(tiny_llama):
    async with engine(tiny_llama) as eng:
        free = await eng.complete(prompt="def f(x):", max_tokens=30)
        assert len(free.text) > 6
        stop = free.text[3:6]
        stopped = await eng.complete(prompt="def f(x):", max_tokens=30, stop=[stop])
    assert stopped.finish_reason == "stop"
    assert stop not in stopped.text
    assert free.text.startswith(stopped.text)
    assert stopped.text == free.text[: free.text.index(stop)]
    assert stopped.usage.completion_tokens == len(stopped.token_ids) < len(free.token_ids)


async def test_chat_messages_use_the_template(tiny_llama):
    from mlx_lm.utils import load_tokenizer

    tok = load_tokenizer(tiny_llama)
    chat = [{"role": "user", "content": "hi there"}]
    expected = tok.apply_chat_template(chat, add_generation_prompt=True, tokenize=True)
    async with engine(tiny_llama) as eng:
        via_chat = await eng.complete(messages=chat, max_tokens=5)
        via_tokens = await eng.complete(prompt_tokens=list(expected), max_tokens=5)
    assert via_chat.usage.prompt_tokens == len(expected)
    assert via_chat.token_ids == via_tokens.token_ids


async def test_bad_requests_raise_request_error(tiny_llama):
    async with engine(tiny_llama) as eng:
        for kwargs, match in [
            (dict(), "exactly one"),
            (dict(prompt="a", prompt_tokens=[1]), "exactly one"),
            (dict(prompt="a", max_tokens=0), "max_tokens"),
            (dict(prompt="a", temperature=-1), "temperature"),
            (dict(prompt="a", top_p=0), "top_p"),
        ]:
            with pytest.raises(unikern.RequestError, match=match):
                await eng.complete(**kwargs)
        with pytest.raises(unikern.RequestError, match="outside the vocabulary"):
            await eng.complete(prompt_tokens=[1, 10**6])
        with pytest.raises(unikern.RequestError, match="prompt has 3000 tokens"):
            await eng.complete(prompt_tokens=[5] * 3000)
        ok = await eng.complete(prompt="still fine", max_tokens=2)
        assert len(ok.token_ids) == 2


async def test_eos_finishes_with_stop(model_dir):
    """A model whose favourite token is EOS stops at once with finish_reason stop."""
    path = model_dir("tiny-llama")
    from mlx_lm.utils import load_tokenizer

    tok = load_tokenizer(path)
    async with engine(path) as eng:
        free = await eng.complete(prompt="a", max_tokens=8)
        eos_after = free.token_ids[2]

    # make the third generated token an EOS id via the scheduler's EOS set
    async with engine(path) as eng:
        eng._router.stages["schedule"].scheduler.eos_token_ids = frozenset({eos_after, *tok.eos_token_ids})
        stopped = await eng.complete(prompt="a", max_tokens=8)
    assert stopped.finish_reason == "stop"
    assert stopped.token_ids == free.token_ids[: free.token_ids.index(eos_after) + 1]


async def test_torch_logits_processor_applies_to_its_request_only(tiny_llama):
    """A PyTorch processor banning tokens is honoured for one request in a batch and not
    the others, through a zero-copy view (no copy counted)."""
    from unikern.platform import bridge_stats

    async with engine(tiny_llama) as eng:
        free = await eng.complete(prompt="def f(x):", max_tokens=8)
        banned = sorted(set(free.token_ids))
        seen_histories = []

        def ban(token_ids, logits):
            seen_histories.append(list(token_ids))
            logits[banned] = -float("inf")
            return logits

        results = {}

        async def one(i):
            results[i] = await eng.complete(
                prompt="def f(x):", max_tokens=8, logits_processors=[ban] if i == 0 else None
            )

        async with anyio.create_task_group() as tg:
            for i in range(4):
                tg.start_soon(one, i)
        stats = eng.stats()["bridge"]
    assert not set(results[0].token_ids) & set(banned)
    assert all(results[i].token_ids == free.token_ids for i in (1, 2, 3))
    assert len(seen_histories) == 8
    assert seen_histories[1][-1] == results[0].token_ids[0]  # the history grows with output
    assert stats["copies"] == 0 and stats["zero_copy_views"] >= 8
    assert bridge_stats() == stats
