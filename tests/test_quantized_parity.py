"""Quantized families against mlx_lm.stream_generate on every row count: 4- and 8-bit
weights (mlx-lm's own quantization, scale groups of 64 and 32), float32 and bfloat16
activations, 1, 8 and 32 requests in flight. Prompts of 5 to 300 tokens in small steps
give prefill steps of many rows, steps of prefill and decode rows together and decode
steps of 8 and 32 rows: each row count takes its path through the quantized layers
(stages/execute/quantized.py), and every one must give mlx-lm's tokens."""

from __future__ import annotations

import pytest

import unikern
from tests.conftest import compare_greedy, complete_all, reference_greedy

pytestmark = pytest.mark.anyio

# llama blocks as tiny-llama's; bfloat16 ones narrower, since MLX's CPU quantized
# matmul runs bfloat16 rows an order of magnitude slower than float32 ones
FLOAT32 = dict(family="llama", hidden_size=128, num_layers=4, num_heads=4, num_kv_heads=2,
               intermediate_size=384, vocab_size=1024, dtype="float32", seed=1)
BFLOAT16 = dict(FLOAT32, hidden_size=64, num_layers=2, intermediate_size=192, dtype="bfloat16", seed=2)
# (dtype, bits, group size): each bit width, group size and dtype twice
MODELS = {"4bit-bf16-g64": (BFLOAT16, 4, 64), "4bit-f32-g32": (FLOAT32, 4, 32),
          "8bit-bf16-g32": (BFLOAT16, 8, 32), "8bit-f32-g64": (FLOAT32, 8, 64)}
MAX_TOKENS = 10
# requests in flight -> their prompts' lengths: the long ones go in steps of up to 128
# rows, beside the others' decode rows
LENGTHS = {1: [150, 5], 8: [5, 40, 9, 129, 17, 64, 12, 300],
           32: [5, 6, 9, 11, 14, 17, 20, 25] * 3 + [31, 40, 47, 64, 80, 100, 129, 160]}
OVERRIDES = {"kv": {"kv_budget_bytes": 32 << 20, "block_size": 32, "kernel_block_size": 16},
             "schedule": {"max_num_batched_tokens": 128, "max_prefill_chunk": 128, "decode_lookahead": 4}}


def prompts(in_flight: int, vocab: int) -> list[list[int]]:
    """Distinct prompts per level (no prefix of one level's prompts is another's)."""
    return [[(7 * i + 31 * in_flight + 13 * j) % (vocab - 10) + 5 for j in range(n)]
            for i, n in enumerate(LENGTHS[in_flight])]


@pytest.mark.parametrize("model", list(MODELS))
async def test_quantized_greedy_parity_at_1_8_and_32_in_flight(model):
    from unikern.testing.families import cached_quantized

    spec, bits, group_size = MODELS[model]
    path = str(cached_quantized(spec, bits, group_size))
    failures = []
    async with unikern.Engine.from_pipeline("generate", model=path, overrides=OVERRIDES) as engine:
        for in_flight in LENGTHS:
            batch = prompts(in_flight, spec["vocab_size"])
            results = []
            for start in range(0, len(batch), in_flight):  # one level's requests together
                results += await complete_all(engine, batch[start:start + in_flight], MAX_TOKENS)
            for prompt, result in zip(batch, results, strict=True):  # near-ties: counted (conftest)
                ok, note = compare_greedy(result.token_ids, reference_greedy(path, prompt, MAX_TOKENS))
                if not ok:
                    failures.append(f"{in_flight} in flight, prompt of {len(prompt)} tokens: {note}")
    assert not failures, f"{model}: {len(failures)} differ from mlx-lm: {failures}"
