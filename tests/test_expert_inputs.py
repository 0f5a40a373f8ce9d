"""Experts' sorted inputs reach `mx.gather_mm` with the row pitch MLX's CUDA backend reads
(stages/execute/experts.py). `cuda_gather_mm` computes a sorted one-row-matrix call as MLX
0.32.4's CUDA grouped GEMM does: an expert group's i-th row read i x `strides(-2)` elements
past the group's first. On the CPU it gives the very wrong token the engine gave on an H100
(1017 for 760, tools/results/h200/layers-gpt-oss-h100-cf77de2.txt) when the experts are
not routed."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.models.switch_layers import SwitchGLU

from tests.conftest import compare_greedy, reference_greedy
from tests.test_families import family_model
from tests.test_family_prefix import PREFIX
from unikern.platform.fusion import set_fusion
from unikern.stages.execute import experts

REPO = Path(__file__).resolve().parents[1]
PROMPT = PREFIX + [42]  # the engine's second chunk of it (89 tokens) sorts its 178 pairs
CUDA_SETTINGS = {"compile_decode": "always", "fuse_elementwise": "never", "cpu_kernels": False}


def cuda_gather_mm(real=mx.gather_mm):
    """`mx.gather_mm` whose sorted one-row-matrix calls read `a` as MLX's CUDA backend
    does (mlx/backend/cuda/matmul.cpp gather_mm_rhs: lda = a.strides(-2) for a row-contiguous
    `a`); other calls are MLX's. Evaluates `a` to see its strides: not inside a trace."""

    def gather_mm(a, b, lhs_indices=None, rhs_indices=None, *, sorted_indices=False, **kwargs):
        if sorted_indices and lhs_indices is None and a.shape[-2] == 1:
            mx.eval(a, rhs_indices)
            width, pitch = a.shape[-1], memoryview(a).strides[-2] // a.itemsize
            flat = np.array(a).reshape(-1)  # the rows as laid out (a singleton axis adds no gap)
            experts_of = np.array(rhs_indices).reshape(-1)
            first = np.searchsorted(experts_of, experts_of, side="left")  # each pair's group start
            starts = first * width + (np.arange(experts_of.size) - first) * pitch
            a = mx.array(np.stack([flat[s:s + width] for s in starts]).reshape(a.shape))
        return real(a, b, lhs_indices, rhs_indices, sorted_indices=sorted_indices, **kwargs)

    return gather_mm


@pytest.fixture
def no_fusion():
    set_fusion(False)  # as the engine sets it on CUDA (execute.fuse_elementwise)
    yield
    set_fusion(True)


def switch_glu(seed: int = 0) -> tuple[SwitchGLU, mx.array, mx.array]:
    """A SwitchGLU of 4 experts whose activation is a fresh shapeless trace (traced under
    the fusion setting of its first call, as mlx-lm's are), 89 tokens and their top-2."""
    mx.random.seed(seed)
    mlp = SwitchGLU(32, 48, 4, activation=mx.compile(lambda x, gate: (x + 1.0) * gate, shapeless=True))
    x = mx.random.normal((1, 89, 32))
    indices = mx.argpartition(mx.random.normal((1, 89, 4)), kth=-2, axis=-1)[..., -2:]
    return mlp, x, indices


def test_an_unfused_activation_leaves_the_down_projection_a_zero_pitch_that_cuda_misreads(no_fusion, monkeypatch):
    mlp, x, indices = switch_glu()
    want = mlp(x, indices)
    seen = []
    monkeypatch.setattr(mx, "gather_mm", lambda a, *args, real=mx.gather_mm, **kw: seen.append(a) or real(a, *args, **kw))
    mx.eval(mlp(x, indices))
    assert [memoryview(a).strides[-2] for a in seen] == [32 * 4, 32 * 4, 0]  # up, gate; down: pitch 0
    monkeypatch.setattr(mx, "gather_mm", cuda_gather_mm())
    assert mx.abs(mlp(x, indices) - want).max().item() > 0.1  # what the H100 computed
    assert experts.route_experts(mlp) == 3
    assert mx.array_equal(mlp(x, indices), want)


def test_routing_swaps_mlx_lm_switch_linears_only_and_keeps_their_weights():
    mlp, x, indices = switch_glu(1)
    weights = [mlp[name]["weight"] for name in ("gate_proj", "up_proj", "down_proj")]
    want = mlp(x, indices)
    assert experts.route_experts(mlp) == 3 and experts.route_experts(mlp) == 0
    assert all(type(mlp[name]) is experts.PitchedSwitchLinear for name in ("gate_proj", "up_proj", "down_proj"))
    assert [mlp[name]["weight"] for name in ("gate_proj", "up_proj", "down_proj")] == weights
    assert mx.array_equal(mlp(x, indices), want)  # CPU: the same sums, the same tokens
    decode = mlp(x[:, :1], indices[:, :1])  # 2 pairs: not sorted, passed through
    assert decode.shape == (1, 1, 2, 32)


def engine_tokens(route: bool) -> list[int]:
    """gpt-oss's windowed prompt through the engine with CUDA's settings and CUDA's reading
    of sorted rows, in a process of its own (mlx-lm's activation is traced once a process:
    here under the engine's fusion setting, as on a GPU)."""
    child = subprocess.run([sys.executable, "-m", "tests.test_expert_inputs", "route" if route else "plain"],
                           cwd=REPO, capture_output=True, text=True, timeout=300)
    assert child.returncode == 0, child.stderr[-3000:]
    return json.loads(child.stdout.strip().splitlines()[-1])


def test_gpt_oss_prefill_with_cuda_reading_of_sorted_rows_matches_mlx_lm():
    path = family_model("gpt-oss")
    want = reference_greedy(path, PROMPT, 4)
    ok, note = compare_greedy(engine_tokens(route=True), want)
    assert ok, note
    wrong = engine_tokens(route=False)
    assert wrong[0] == 1017 and want.tokens[0] == 760  # the H100's token, without the routing


def _child(route: bool) -> None:
    import anyio

    import unikern

    mx.gather_mm = cuda_gather_mm()
    if not route:  # load_model takes it from experts when it runs
        experts.route_experts = lambda model: 0

    async def main() -> list[int]:
        overrides = {"kv": {"kv_budget_bytes": 32 << 20}, "execute": CUDA_SETTINGS}
        async with unikern.Engine.from_pipeline("generate", model=family_model("gpt-oss"), overrides=overrides) as engine:
            return (await engine.complete(prompt_tokens=PROMPT, max_tokens=4)).token_ids

    print(json.dumps(anyio.run(main)))


if __name__ == "__main__":
    _child(sys.argv[1] == "route")
