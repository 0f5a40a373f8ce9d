"""Shared fixtures: small models built on the spot and the mlx-lm greedy reference.

hypothesis is imported here, at collection, because its pytest plugin otherwise imports
it at session end, where CPython 3.11.7's AST checker has failed with "AST constructor
recursion depth mismatch"."""

from __future__ import annotations

import os
from dataclasses import dataclass

import hypothesis  # noqa: F401  (imported early: see below)
import pytest

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

# Keep test pools small: a few MiB of KV, whatever the machine's RAM.
SMALL_KV = {"kv": {"kv_budget_bytes": 64 << 20}}

NEAR_TIE = 1e-3


@pytest.fixture(scope="session")
def model_dir():
    from unikern.modelgen import cached_model

    def build(preset_or_spec):
        return str(cached_model(preset_or_spec))

    return build


@pytest.fixture(scope="session")
def tiny_llama(model_dir) -> str:
    return model_dir("tiny-llama")


@dataclass
class Reference:
    tokens: list[int]
    margins: list[float]  # mlx-lm's own top-1 minus top-2 logit at each step


_REFERENCE_MODELS: dict[str, tuple] = {}


def reference_greedy(path: str, prompt_tokens: list[int], max_tokens: int) -> Reference:
    """What `mlx_lm.stream_generate` produces greedily, with its top-2 margin per step."""
    import mlx.core as mx
    from mlx_lm import load, stream_generate

    if path not in _REFERENCE_MODELS:
        _REFERENCE_MODELS[path] = load(path)
    model, tokenizer = _REFERENCE_MODELS[path]
    tokens, margins = [], []
    for response in stream_generate(model, tokenizer, mx.array(prompt_tokens), max_tokens=max_tokens):
        top2 = mx.topk(response.logprobs.astype(mx.float32), 2)
        margins.append(abs(float(top2[1] - top2[0])))
        tokens.append(response.token)
        if response.finish_reason is not None:
            break
    return Reference(tokens, margins)


def compare_greedy(ours: list[int], ref: Reference) -> tuple[bool, str]:
    """Token-for-token equality; a first difference at a near-tie step of mlx-lm's own
    logits is allowed and reported (DESIGN.md, correctness reference)."""
    for i, (a, b) in enumerate(zip(ours, ref.tokens, strict=False)):
        if a != b:
            if ref.margins[i] < NEAR_TIE:
                return True, f"near-tie at step {i} (margin {ref.margins[i]:.2e}): {a} vs {b}"
            return False, f"step {i}: ours {a}, mlx-lm {b} (margin {ref.margins[i]:.3f})"
    if len(ours) != len(ref.tokens):
        return False, f"lengths differ: ours {len(ours)}, mlx-lm {len(ref.tokens)}"
    return True, ""


@pytest.fixture
def anyio_backend():
    """asyncio by default; tests that must hold under trio too parametrize this."""
    return "asyncio"


async def complete_all(engine, prompts: list[list[int]], max_tokens: int) -> list:
    """Send every prompt at once; results in prompt order."""
    import anyio

    results = [None] * len(prompts)

    async def one(i):
        results[i] = await engine.complete(prompt_tokens=prompts[i], max_tokens=max_tokens)

    async with anyio.create_task_group() as tg:
        for i in range(len(prompts)):
            tg.start_soon(one, i)
    return results
