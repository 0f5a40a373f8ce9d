"""Second correctness reference: transformers' float32 logits on the same checkpoint,
against mlx-lm's and against unikern's own paged, batched forward (ModelRunner, CPU
kernels, chunked prefill, a prefix-cache hit), within 1e-4 of the largest |logit|."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import mlx.core as mx
import mlx_lm
import numpy as np
import pytest
import torch
import transformers
from mlx_lm.models.cache import make_prompt_cache

from unikern.testing import modelgen

PROMPT = ("def fib(n):\n    if n < 2:\n        return n\n"
          "    return fib(n - 1) + fib(n - 2)  # héllo 世界")
FLOAT32_SPECS = {
    "llama": modelgen.PRESETS["tiny-llama"],
    "qwen2": {**modelgen.PRESETS["tiny-qwen2"], "dtype": "float32"},
    "qwen3": modelgen.PRESETS["tiny-qwen3"],
}
FLOAT32_TOLERANCE = 1e-4  # of the largest |logit|
BFLOAT16_TOLERANCE = 0.05  # bf16 rounds every activation; accumulation orders differ


def hf_logits(model_dir: Path, ids: list[int], dtype: torch.dtype = torch.float32) -> np.ndarray:
    model = transformers.AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=dtype)
    model.eval()
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits[0]
    return logits.float().numpy()


def mlx_logits(model, ids: list[int]) -> np.ndarray:
    return np.array(model(mx.array([ids]))[0].astype(mx.float32))


def relative_error(actual: np.ndarray, expected: np.ndarray) -> float:
    assert actual.shape == expected.shape
    return float(np.abs(actual - expected).max() / np.abs(expected).max())


@pytest.fixture(scope="module", params=sorted(FLOAT32_SPECS))
def float32_case(request):
    """(model dir, prompt ids, transformers' logits) for one family in float32."""
    model_dir = modelgen.cached_model(FLOAT32_SPECS[request.param])
    _, tokenizer = mlx_lm.load(str(model_dir))
    ids = tokenizer.encode(PROMPT)
    assert len(ids) > 20
    return model_dir, ids, hf_logits(model_dir, ids)


def test_float32_logits_match_transformers(float32_case) -> None:
    model_dir, ids, expected = float32_case
    model, _ = mlx_lm.load(str(model_dir))
    assert relative_error(mlx_logits(model, ids), expected) < FLOAT32_TOLERANCE


def test_incremental_decode_with_kv_cache_matches_transformers(float32_case) -> None:
    model_dir, ids, expected = float32_case
    model, _ = mlx_lm.load(str(model_dir))
    cache = make_prompt_cache(model)
    prefill = 7
    rows = [model(mx.array([ids[:prefill]]), cache=cache)[0]]
    for token in ids[prefill:]:
        rows.append(model(mx.array([[token]]), cache=cache)[0])
    actual = np.array(mx.concatenate(rows, axis=0).astype(mx.float32))
    assert relative_error(actual, expected) < FLOAT32_TOLERANCE


def test_comparison_catches_changed_weights(float32_case) -> None:
    model_dir, ids, expected = float32_case
    model, _ = mlx_lm.load(str(model_dir))
    down_proj = model.layers[-1].mlp.down_proj
    down_proj.weight = down_proj.weight * 1.01
    assert relative_error(mlx_logits(model, ids), expected) > 10 * FLOAT32_TOLERANCE


def test_comparison_catches_wrong_rope_theta(float32_case, tmp_path: Path) -> None:
    model_dir, ids, expected = float32_case
    copy = Path(shutil.copytree(model_dir, tmp_path / "model"))
    config = json.loads((copy / "config.json").read_text())
    config["rope_theta"] = config["rope_theta"] * 2
    config["rope_parameters"]["rope_theta"] = config["rope_theta"]
    (copy / "config.json").write_text(json.dumps(config))
    model, _ = mlx_lm.load(str(copy))
    assert relative_error(mlx_logits(model, ids), expected) > 10 * FLOAT32_TOLERANCE


@pytest.fixture(scope="module")
def bfloat16_case():
    model_dir = modelgen.cached_model("tiny-qwen2")
    assert json.loads((model_dir / "config.json").read_text())["dtype"] == "bfloat16"
    model, tokenizer = mlx_lm.load(str(model_dir))
    return model_dir, model, tokenizer.encode(PROMPT)


def test_bfloat16_weights_load_exactly(bfloat16_case) -> None:
    # Upcast both sides: equal bf16 weights must then give float32-equal logits.
    model_dir, model, ids = bfloat16_case
    model.set_dtype(mx.float32)
    try:
        actual = mlx_logits(model, ids)
    finally:
        model.set_dtype(mx.bfloat16)
    assert relative_error(actual, hf_logits(model_dir, ids, torch.float32)) < FLOAT32_TOLERANCE


def test_bfloat16_compute_is_close_to_transformers(bfloat16_case) -> None:
    model_dir, model, ids = bfloat16_case
    actual = mlx_logits(model, ids)
    expected = hf_logits(model_dir, ids, torch.bfloat16)
    assert relative_error(actual, expected) < BFLOAT16_TOLERANCE
    # Loose in value, but the model's prediction must mostly agree.
    assert (actual.argmax(-1) == expected.argmax(-1)).mean() > 0.8


# ---- unikern's own paged, batched forward against transformers -----------------------

BLOCK, KERNEL_BLOCK = 32, 16  # a logical block is two kernel blocks: block tables expand
TAIL = 8  # positions of each row decoded one token at a time after its prefill


class LogitsRecorder:
    """A logits processor that keeps a copy of its row (a zero-copy torch view of the
    logits the runner samples from), keyed by the position it predicts from."""

    def __init__(self) -> None:
        self.rows: dict[int, np.ndarray] = {}

    def __call__(self, token_ids: list[int], row: torch.Tensor) -> None:
        self.rows[len(token_ids) - 1] = row.numpy().copy()


def paged_runner(model_dir: Path):
    from unikern.stages.execute.model import ModelGeometry
    from unikern.stages.execute.runner import ModelRunner
    from unikern.stages.kv.pool import KVPool

    model, _ = mlx_lm.load(str(model_dir))
    geo = ModelGeometry(model)
    pool = KVPool(num_layers=geo.num_layers, num_kv_heads=geo.num_kv_heads, head_dim=geo.head_dim,
                  dtype=geo.dtype, block_size=BLOCK, kernel_block_size=KERNEL_BLOCK, num_blocks=32,
                  slab_blocks=32)
    # the runner hands each processor a zero-copy view of its row (the shared bridge)
    return ModelRunner(model, pool, cpu_kernels=True)


def paged_logits(model_dir: Path, rows: dict[str, list[int]], shared: dict[str, tuple[str, int]]) -> dict:
    """Each row's logits at its last TAIL + 1 positions, from ModelRunner steps: one
    batched step of prefills (row "long" in two chunks, the first without a sample),
    then prefills mixed with decodes, then batched decodes fed each row's own next token
    (teacher forcing). `shared` maps a row to (row, tokens) whose blocks it starts with:
    a prefix-cache hit, its prefill starting after them."""
    from unikern import messages as m
    from unikern.stages.kv.service import RESERVED_BLOCKS

    runner = paged_runner(model_dir)
    assert runner.kernels["enabled"], runner.kernels  # the CPU kernels are on this path
    params = m.SamplingParams(max_tokens=64)
    tables, next_block = {}, RESERVED_BLOCKS  # the zero block and the padding scratch
    for rid, tokens in rows.items():
        own = -(-len(tokens) // BLOCK)
        prefix: tuple[int, ...] = ()
        if rid in shared:
            donor, num_tokens = shared[rid]
            prefix = tables[donor][: num_tokens // BLOCK]
        tables[rid] = prefix + tuple(range(next_block, next_block + own - len(prefix)))
        next_block += own - len(prefix)
    recorders = {rid: LogitsRecorder() for rid in rows}
    done = {rid: shared[rid][1] if rid in shared else 0 for rid in rows}  # positions in the pool

    def work(rid: str, stop: int, sample: bool = True) -> m.SeqWork:
        tokens = rows[rid]
        start, done[rid] = done[rid], stop
        return m.SeqWork(rid, tuple(tokens[start:stop]), start, tables[rid], sample, params,
                         processors=(recorders[rid],), history=tuple(tokens[:stop]) if sample else ())

    first = [work(r, len(t) - TAIL) for r, t in rows.items() if r not in shared and r != "long"]
    first.append(work("long", 24, sample=False))
    steps = [first, [work(r, len(rows[r]) - TAIL) for r in [*shared, "long"]]]
    steps[1] += [work(w.request_id, done[w.request_id] + 1) for w in first if w.sample]
    for i, step in enumerate(steps):
        runner.run(m.Step(i, tuple(step)), {})
    while pending := [r for r in rows if done[r] < len(rows[r])]:
        runner.run(m.Step(len(steps), tuple(work(r, done[r] + 1) for r in pending)), {})
    return {rid: rec.rows for rid, rec in recorders.items()}


def test_paged_batched_forward_with_cpu_kernels_matches_transformers(float32_case) -> None:
    """unikern's ModelRunner (paged pool, block-size translation, CPU kernels, batched
    rows of different lengths, chunked prefill, a prefix-cache hit) gives transformers'
    logits within FLOAT32_TOLERANCE of each row's largest |logit|, at every position it
    samples from."""
    model_dir, ids, _ = float32_case
    rows = {
        "a": ids,
        "b": ids[::-1][:21],
        "hit": ids[:BLOCK] + ids[-15:],  # starts with a's first block, already in the pool
        "long": ids + ids[:20],
    }
    assert len(ids) > BLOCK + TAIL
    ours = paged_logits(model_dir, rows, shared={"hit": ("a", BLOCK)})
    for rid, tokens in rows.items():
        expected = hf_logits(model_dir, tokens)
        positions = sorted(ours[rid])
        assert positions == list(range(len(tokens) - TAIL - 1, len(tokens))), (rid, positions)
        actual = np.stack([ours[rid][p] for p in positions])
        error = relative_error(actual, expected[positions])
        assert error < FLOAT32_TOLERANCE, f"row {rid!r}: relative error {error:.2e}"


def test_paged_comparison_catches_a_wrong_prefix_block(float32_case) -> None:
    model_dir, ids, _ = float32_case
    rows = {"a": ids, "b": ids[::-1][:21], "hit": ids[:BLOCK] + ids[-15:], "long": ids + ids[:20]}
    ours = paged_logits(model_dir, rows, shared={"hit": ("b", BLOCK)})  # b's block, not a's
    expected = hf_logits(model_dir, rows["hit"])
    positions = sorted(ours["hit"])
    actual = np.stack([ours["hit"][p] for p in positions])
    assert relative_error(actual, expected[positions]) > 10 * FLOAT32_TOLERANCE
