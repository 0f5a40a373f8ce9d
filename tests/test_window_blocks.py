"""A model whose every layer is windowed holds only the blocks its window reaches: one
4,000-token request keeps ceil(window / block) + 1 blocks while it decodes (stats.kv),
the released blocks stay in the prefix cache, and the tokens are mlx-lm's."""

from __future__ import annotations

import pytest

import unikern
from tests.conftest import compare_greedy, generate_sampled, reference_greedy
from unikern.stages.kv.blocks import BlockManager
from unikern.stages.schedule.windows import ZERO_BLOCK, release_out_of_window

pytestmark = pytest.mark.anyio

WINDOW, BLOCK, CHUNK, LOOKAHEAD_MAX = 200, 64, 512, 8
PROMPT = [(7 * j) % 1000 + 5 for j in range(3800)]
MAX_TOKENS = 200  # 4,000 tokens in all
OVERRIDES = {
    "kv": {"kv_budget_bytes": 32 << 20, "block_size": BLOCK, "kernel_block_size": 16},
    "schedule": {"max_prefill_chunk": CHUNK, "decode_lookahead": 4, "decode_lookahead_max": LOOKAHEAD_MAX},
}
# while decoding, the blocks under [n - WINDOW + 1, n + lookahead - 1]; a window that is not
# a whole number of blocks leaves room for the lookahead's own blocks (206 -> 4 blocks)
DECODE_BOUND = -(-WINDOW // BLOCK) + 1
assert -(-(WINDOW + LOOKAHEAD_MAX - 2) // BLOCK) + 1 == DECODE_BOUND
# while a chunk prefills: the window before its first query plus the chunk itself
PREFILL_BOUND = -(-(WINDOW - 1 + CHUNK) // BLOCK) + 1


def windowed_model() -> str:
    from unikern.testing.families import cached_family_model

    return str(cached_family_model("tiny-step3p5-swa", sliding_window=WINDOW))


async def test_a_4000_token_request_holds_only_its_window():
    path = windowed_model()
    async with unikern.Engine.from_pipeline("generate", model=path, overrides=OVERRIDES) as engine:
        tokens, prefill_used, decode_used = await generate_sampled(
            engine, PROMPT, MAX_TOKENS, lambda: engine.stats()["kv"]["blocks_used"]
        )
        kv = engine.stats()["kv"]
        # the released blocks went back as cached blocks: a prompt sharing 3,000 tokens hits
        # them, holds only its window once admitted, and still gets mlx-lm's tokens
        shared = PROMPT[:3000] + [9, 8, 7]
        again = await engine.complete(prompt_tokens=shared, max_tokens=16)
        assert engine.stats()["kv"]["blocks_used"] == 0
    assert len(tokens) == MAX_TOKENS, "an early EOS: the request is no longer 4,000 tokens"
    assert max(decode_used) <= DECODE_BOUND, decode_used
    assert max(prefill_used) <= PREFILL_BOUND, prefill_used
    assert kv["blocks_used"] == 0 and kv["blocks_cached"] >= len(PROMPT) // BLOCK
    assert again.usage.cached_tokens == 3000 // BLOCK * BLOCK
    for prompt, ours in ((PROMPT, tokens), (shared, again.token_ids)):
        ok, note = compare_greedy(ours, reference_greedy(path, prompt, len(ours)))
        assert ok, note


class _Seq:
    def __init__(self, blocks: list[int], num_computed: int) -> None:
        self.blocks, self.num_computed = blocks, num_computed


def test_blocks_leave_only_once_every_query_is_past_them():
    """Block b goes back once num_computed - window + 1 >= its end: the step's first query
    (a chunk's, or a lookahead window's first) no longer sees it; freed once."""
    books = BlockManager(num_blocks=16, block_size=4, reserved_blocks=2)
    seq = _Seq([books.allocate_one() for _ in range(5)], num_computed=0)
    held = list(seq.blocks)
    for n, released in ((6, 0), (7, 0), (8, 1), (11, 1), (12, 2), (16, 3)):
        seq.num_computed = n
        release_out_of_window(books, seq, window=5)
        assert seq.blocks[:released] == [ZERO_BLOCK] * released and seq.blocks[released:] == held[released:]
        assert books.num_used == 5 - released
    books.free(seq.blocks)  # the released entries name the zero block: skipped, not freed twice
    assert books.num_used == 0


def test_admission_keeps_only_the_first_chunks_blocks():
    books = BlockManager(num_blocks=16, block_size=4, reserved_blocks=2)
    seq = _Seq([books.allocate_one() for _ in range(10)], num_computed=0)
    release_out_of_window(books, seq, window=5, until=7)
    assert len(seq.blocks) == 2 and books.num_used == 2


async def test_a_prompt_longer_than_the_whole_pool_runs_when_its_window_fits():
    """A windowed table holds at most its window and a prefill chunk at once, so a
    3,800-token prompt (60 blocks) runs in a pool of 16 blocks, with mlx-lm's tokens;
    one whose window and chunk do not fit is refused, saying so."""
    path = windowed_model()
    per_block = 2 * 2 * BLOCK * 2 * 16 * 4  # K and V, 2 layers, 2 kv heads, head dim 16, float32
    assert PREFILL_BOUND <= 16 < -(-len(PROMPT) // BLOCK)
    overrides = {**OVERRIDES, "kv": {**OVERRIDES["kv"], "kv_budget_bytes": 16 * per_block}}
    async with unikern.Engine.from_pipeline("generate", model=path, overrides=overrides) as engine:
        assert engine.stats()["kv"]["blocks_total"] == 16
        result = await engine.complete(prompt_tokens=PROMPT, max_tokens=16)
    ok, note = compare_greedy(result.token_ids, reference_greedy(path, PROMPT, 16))
    assert ok, note
    small = {**overrides, "kv": {**overrides["kv"], "kv_budget_bytes": 8 * per_block}}
    async with unikern.Engine.from_pipeline("generate", model=path, overrides=small) as engine:
        with pytest.raises(unikern.errors.RequestError, match=r"200-token window and a 512-token prefill chunk"):
            await engine.complete(prompt_tokens=PROMPT, max_tokens=16)
