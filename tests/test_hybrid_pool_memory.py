"""A hybrid model whose recurrent layers come after its last attention layer commits only
what a request writes, however large the pool: a forward that samples nothing (a
prefill piece ending at a state checkpoint) leaves the attention's read of the pool
pending in the state slots' graph, and the next write into a pool array with a read
pending is not done in place: MLX copied the whole array, committing the whole budget
(1 GiB resident and ~10x slower for a 600-token request on a 1 GiB pool)."""

from __future__ import annotations

import pytest

import unikern
from tests.conftest import compare_greedy, reference_greedy
from unikern.platform import current_platform
from unikern.platform.bridge import mlx_buffer

pytestmark = [
    pytest.mark.anyio,
    pytest.mark.skipif(current_platform().backend != "cpu", reason="madvise and mincore reach MLX's CPU buffers only"),
]

MiB, GiB = 1 << 20, 1 << 30
PROMPT = [(7 * j) % 1000 + 5 for j in range(600)]  # three 256-token blocks: two checkpoints
MAX_TOKENS = 16

# (preset, ModelArgs fields): a recurrent layer after the last attention layer
MODELS = {
    "nemotron-h": ("tiny-nemotron-h", {}),  # M * M -
    "qwen3-next": ("tiny-qwen3-next", {"num_hidden_layers": 3, "full_attention_interval": 2}),  # linear, full, linear
}
PIPELINES = {
    "generate": {"kv": {"kv_budget_bytes": GiB}},
    # the host tier's bytes are pool blocks too: the pool spans budget + host bytes
    "generate-offload": {"kv": {"kv_budget_bytes": 32 * MiB, "host_bytes": GiB}},
}


@pytest.mark.parametrize("pipeline", list(PIPELINES))
@pytest.mark.parametrize("family", list(MODELS))
async def test_large_pool_commits_only_what_a_hybrid_request_wrote(family, pipeline, tmp_path):
    from unikern.testing.families import cached_family_model

    preset, fields = MODELS[family]
    path = str(cached_family_model(preset, **fields))
    overrides = dict(PIPELINES[pipeline])
    if pipeline == "generate-offload":
        overrides["disk"] = {"path": str(tmp_path / "kv")}
    async with unikern.Engine.from_pipeline(pipeline, model=path, overrides=overrides) as engine:
        pool = engine._router.stages["kv"].kv.pool
        assert pool.num_blocks * pool.bytes_per_block >= GiB  # the whole pool is reserved, uncommitted
        assert engine.stats()["memory"]["kv_resident_bytes"] == 0
        addresses = [mlx_buffer(a)[0] for a in pool.keys + pool.values]
        result = await engine.complete(prompt_tokens=PROMPT, max_tokens=MAX_TOKENS)
        resident = engine.stats()["memory"]["kv_resident_bytes"]
        written_blocks = -(-(len(PROMPT) + MAX_TOKENS) // pool.block_size)
        moved = [mlx_buffer(a)[0] for a in pool.keys + pool.values] != addresses
    assert resident <= written_blocks * pool.bytes_per_block, f"{resident / MiB:.1f} MiB resident"
    assert resident < 64 * MiB
    assert not moved, "MLX copied a pool array instead of writing it in place"
    ok, note = compare_greedy(result.token_ids, reference_greedy(path, PROMPT, MAX_TOKENS))
    assert ok, note
