"""Second correctness reference: mlx-lm logits agree with Hugging Face transformers.

Both libraries load the same checkpoint dir. If this passes, any engine output that
matches mlx-lm also matches an independent implementation of each model family.
"""

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
