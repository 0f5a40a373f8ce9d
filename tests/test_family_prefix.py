"""Prefix caching for sliding-window and hybrid recurrent models: 16 requests sharing a
600-token prefix are served from cache (attention blocks, and for recurrent layers the
state checkpoint at the last shared block boundary), with mlx-lm's greedy tokens; a
windowed model's prefix, and a hybrid model's with its state checkpoint, come back from the
disk tier after a restart."""

from __future__ import annotations

import anyio
import pytest

import unikern
from tests.conftest import compare_greedy, complete_all, reference_greedy
from tests.test_families import family_model

pytestmark = pytest.mark.anyio

PREFIX = [(11 * j) % 1000 + 7 for j in range(600)]
PROMPTS = [PREFIX + [20 + i, 30 + i] for i in range(16)]
MAX_TOKENS = 8
OVERRIDES = {
    "kv": {"kv_budget_bytes": 32 << 20, "block_size": 256},
    "schedule": {"max_num_batched_tokens": 512, "max_num_seqs": 8},  # slots get reused
}


@pytest.mark.parametrize("family", ["gemma3", "qwen3-next", "nemotron-h"])
async def test_shared_600_token_prefix_is_served_from_cache(family):
    path = family_model(family)
    async with unikern.Engine.from_pipeline("generate", model=path, overrides=OVERRIDES) as engine:
        results = await complete_all(engine, PROMPTS, MAX_TOKENS)
    cached = [r.usage.cached_tokens for r in results]
    assert sum(cached) >= 15 * 512, cached
    for prompt, result in zip(PROMPTS, results, strict=True):
        ok, note = compare_greedy(result.token_ids, reference_greedy(path, prompt, MAX_TOKENS))
        assert ok, f"{family}, cached {result.usage.cached_tokens}: {note}"


async def test_recurrent_prefix_hit_restores_the_last_checkpoint():
    """Checkpoints are taken where a prompt crosses a block boundary, not where decoding
    does. A prompt sharing two blocks restores the state after them and computes two
    tokens; one whose KV blocks hit three blocks through the first answer reuses two,
    the last ones whose end has a state checkpoint."""
    path = family_model("qwen3-next")
    first = PREFIX[:256] + [3]
    overrides = {"kv": {"kv_budget_bytes": 32 << 20, "block_size": 128}}
    async with unikern.Engine.from_pipeline("generate", model=path, overrides=overrides) as engine:
        a = await engine.complete(prompt_tokens=first, max_tokens=140)
        second = PREFIX[:256] + [9, 8]
        third = first + a.token_ids + [7]
        b = await engine.complete(prompt_tokens=second, max_tokens=8)
        c = await engine.complete(prompt_tokens=third, max_tokens=8)
    assert len(a.token_ids) == 140
    assert [r.usage.cached_tokens for r in (a, b, c)] == [0, 256, 256]
    for prompt, result in ((first, a), (second, b), (third, c)):
        ok, note = compare_greedy(result.token_ids, reference_greedy(path, prompt, len(result.token_ids)))
        assert ok, note


async def test_windowed_prefix_comes_back_from_disk_after_a_restart(tmp_path):
    path = family_model("gpt-oss")
    prompt = PREFIX + [42]
    overrides = {"kv": {"kv_budget_bytes": 32 << 20, "host_bytes": 0}, "disk": {"path": str(tmp_path / "kv")}}
    runs = []
    for _ in range(2):  # the second engine starts with only the disk tier warm
        async with unikern.Engine.from_pipeline("generate-offload", model=path, overrides=overrides) as engine:
            runs.append(await engine.complete(prompt_tokens=prompt, max_tokens=MAX_TOKENS))
    assert runs[0].usage.cached_tokens == 0 and runs[1].usage.cached_tokens == 512
    assert runs[1].token_ids == runs[0].token_ids
    ok, note = compare_greedy(runs[1].token_ids, reference_greedy(path, prompt, MAX_TOKENS))
    assert ok, note


@pytest.mark.parametrize("family", ["qwen3-next", "nemotron-h", "mamba2"])
async def test_recurrent_prefix_comes_back_from_disk_after_a_restart(family, tmp_path):
    """The first engine stores the prefix's KV blocks and the state checkpoints at their
    ends; a fresh engine on the same disk directory loads both (nothing is in memory) and
    16 requests sharing the 600-token prefix each prefill only their own tail."""
    path = family_model(family)
    overrides = {**OVERRIDES, "kv": {"kv_budget_bytes": 32 << 20, "host_bytes": 0}, "disk": {"path": str(tmp_path / "kv")}}
    async with unikern.Engine.from_pipeline("generate-offload", model=path, overrides=overrides) as engine:
        first = await engine.complete(prompt_tokens=PROMPTS[0], max_tokens=MAX_TOKENS)
        with anyio.move_on_after(10):  # stores run alongside; a shutdown drops the unstarted
            while engine.stats()["offload"]["states_stored"] < 2:  # noqa: ASYNC110 (polling stats)
                await anyio.sleep(0.01)
    assert engine.stats()["offload"]["states_stored"] == 2  # after blocks 1 and 2
    async with unikern.Engine.from_pipeline("generate-offload", model=path, overrides=overrides) as engine:
        results = await complete_all(engine, PROMPTS, MAX_TOKENS)
        stats = engine.stats()
    assert first.usage.cached_tokens == 0
    assert [r.usage.cached_tokens for r in results] == [512] * 16
    assert results[0].token_ids == first.token_ids
    assert stats["offload"]["states_loaded"] == 1 and stats["kv"]["states"]["loaded"] == 1
    for prompt, result in zip(PROMPTS, results, strict=True):
        ok, note = compare_greedy(result.token_ids, reference_greedy(path, prompt, MAX_TOKENS))
        assert ok, f"{family}: {note}"


async def test_a_checkpoint_evicted_from_memory_comes_back_from_disk(tmp_path):
    """Two checkpoint slots: a second prefix pushes the first one's checkpoints out of
    memory, while its KV blocks stay in the pool; a prompt sharing the first prefix then
    loads the checkpoint from disk and prefills only its own tail."""
    path = family_model("nemotron-h")
    other = [(7 * j) % 1000 + 5 for j in range(600)]
    overrides = {"kv": {"kv_budget_bytes": 32 << 20, "host_bytes": 0, "state_checkpoints": 2},
                 "disk": {"path": str(tmp_path / "kv")}}
    async with unikern.Engine.from_pipeline("generate-offload", model=path, overrides=overrides) as engine:
        for i, prompt in enumerate((PROMPTS[0], other + [1])):
            await engine.complete(prompt_tokens=prompt, max_tokens=2)
            with anyio.move_on_after(10):  # stored before the next prompt needs the slots
                while engine.stats()["offload"]["states_stored"] < 2 * (i + 1):  # noqa: ASYNC110 (polling stats)
                    await anyio.sleep(0.01)
        result = await engine.complete(prompt_tokens=PROMPTS[1], max_tokens=MAX_TOKENS)
        stats = engine.stats()
    assert stats["kv"]["states"]["evicted"] >= 2 and stats["offload"]["states_loaded"] == 1
    assert result.usage.cached_tokens == 512
    ok, note = compare_greedy(result.token_ids, reference_greedy(path, PROMPTS[1], MAX_TOKENS))
    assert ok, note


async def test_a_corrupt_checkpoint_file_is_a_miss_and_the_prompt_is_recomputed(tmp_path):
    path = family_model("nemotron-h")
    overrides = {"kv": {"kv_budget_bytes": 32 << 20, "host_bytes": 0}, "disk": {"path": str(tmp_path / "kv")}}
    async with unikern.Engine.from_pipeline("generate-offload", model=path, overrides=overrides) as engine:
        first = await engine.complete(prompt_tokens=PROMPTS[0], max_tokens=MAX_TOKENS)
        with anyio.move_on_after(10):
            while engine.stats()["offload"]["states_stored"] < 2:  # noqa: ASYNC110 (polling stats)
                await anyio.sleep(0.01)
    files = sorted((tmp_path / "kv").glob("*/*.ukkv"))
    assert len(files) == 4  # two blocks, two checkpoints
    for f in files:  # flip one body byte of every file: only checked reads can tell
        data = bytearray(f.read_bytes())
        data[-1] ^= 0x40
        f.write_bytes(bytes(data))
    async with unikern.Engine.from_pipeline("generate-offload", model=path, overrides=overrides) as engine:
        again = await engine.complete(prompt_tokens=PROMPTS[0], max_tokens=MAX_TOKENS)
        stats = engine.stats()
    assert again.usage.cached_tokens == 0 and again.token_ids == first.token_ids
    assert stats["offload"]["state_load_failures"] == 1 and stats["tiers"]["disk"]["corrupt_files"] >= 2
