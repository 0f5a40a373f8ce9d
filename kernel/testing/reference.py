"""The correctness reference (DESIGN.md): mlx-lm's greedy `stream_generate`, with the
margin between its own top two logits at every step, and the comparison rule the tests
and tools/check/parity_check.py share: identical tokens, or a first difference at a step
where mlx-lm's top two are within NEAR_TIE (reported, not failed)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

NEAR_TIE = 1e-3


@dataclass
class Reference:
    tokens: list[int]
    margins: list[float]  # mlx-lm's own top-1 minus top-2 logit at each step


def greedy_reference(model: Any, tokenizer: Any, prompt_tokens: list[int], max_tokens: int) -> Reference:
    """What `mlx_lm.stream_generate` produces greedily, with its top-2 margin per step."""
    import mlx.core as mx
    from mlx_lm import stream_generate

    tokens, margins = [], []
    for response in stream_generate(model, tokenizer, mx.array(prompt_tokens), max_tokens=max_tokens):
        top2 = mx.topk(response.logprobs.astype(mx.float32), 2)
        margins.append(abs(float(top2[1] - top2[0])))
        tokens.append(response.token)
        if response.finish_reason is not None:
            break
    return Reference(tokens, margins)


def compare(ours: list[int], ref: Reference) -> dict[str, Any]:
    """{"result": "exact" | "near-tie" | "mismatch", ...where and by what margin}."""
    for i, (a, b) in enumerate(zip(ours, ref.tokens, strict=False)):
        if a != b:
            kind = "near-tie" if ref.margins[i] < NEAR_TIE else "mismatch"
            return {"result": kind, "step": i, "margin": ref.margins[i], "ours": a, "mlx_lm": b}
    if len(ours) != len(ref.tokens):
        return {"result": "mismatch", "step": min(len(ours), len(ref.tokens)), "why": "lengths differ",
                "ours_len": len(ours), "mlx_lm_len": len(ref.tokens)}
    return {"result": "exact", "min_margin": min(ref.margins) if ref.margins else None}
