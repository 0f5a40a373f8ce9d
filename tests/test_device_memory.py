"""A step that fails for want of device memory: MLX's own message names no setting, so the
execute stage raises DeviceMemoryError with what MLX held and the settings that ask less."""

from __future__ import annotations

import anyio
import pytest

import unikern
from tests.conftest import SMALL_KV
from tests.test_families import family_model
from unikern import messages as m
from unikern.errors import DeviceMemoryError, StageError
from unikern.stages.execute.memory import device_memory_error, is_out_of_memory

CUDA_OOM = "cudaMallocAsync(&data, size, stream) failed: out of memory"
METAL_OOM = "[metal::malloc] Attempting to allocate 21474836480 bytes which is greater than the maximum allowed"


@pytest.mark.parametrize("text", [CUDA_OOM, METAL_OOM, "[metal] Insufficient Memory (00000008:kIOGPUCommandBufferCallbackErrorOutOfMemory)"])
def test_allocators_out_of_memory_is_recognized(text: str) -> None:
    assert is_out_of_memory(RuntimeError(text))


@pytest.mark.parametrize("exc", [RuntimeError("[matmul] Last dimension of first input with shape (2,3) must match"),
                                 ValueError("out of memory")])
def test_other_errors_are_not(exc: BaseException) -> None:
    assert not is_out_of_memory(exc)


class Pool:
    def __init__(self, resident_bytes: int) -> None:
        self.resident_bytes = resident_bytes


def test_the_message_says_what_mlx_held_and_what_to_change() -> None:
    # a mixed model's windowed layers keep a pool of their own: both count
    text = str(device_memory_error(RuntimeError(CUDA_OOM), (Pool(3 << 30), Pool(1 << 29))))
    assert CUDA_OOM in text and "KV pool committed 3.50 GiB" in text
    assert "KV pool" not in str(device_memory_error(RuntimeError(CUDA_OOM), (None,)))
    for part in ("active ", "cached ", "peak ", "limit ", "kv.memory_fraction", "schedule.max_num_seqs",
                 "mx.set_memory_limit"):
        assert part in text


@pytest.mark.anyio
@pytest.mark.parametrize("family", ["llama", "gpt-oss"])  # gpt-oss: a second pool for its windowed layers
async def test_an_engine_out_of_device_memory_fails_with_device_memory_error(family: str, monkeypatch) -> None:
    from unikern.stages.execute import runner as runner_module

    counted = []
    real = runner_module.device_memory_error
    monkeypatch.setattr(runner_module, "device_memory_error",
                        lambda exc, pools: counted.extend(p for p in pools if p is not None) or real(exc, pools))
    engine = unikern.Engine.from_pipeline("generate", model=family_model(family), overrides=SMALL_KV)
    events = []
    with pytest.raises(StageError) as raised:
        async with engine:
            await engine.complete(prompt_tokens=[5], max_tokens=1)  # the runner exists once a step ran
            runner = engine._router.stages["execute"].runner

            def fail(step, seeds):
                raise RuntimeError(CUDA_OOM)

            runner._run_once = runner._run_lookahead = fail
            with anyio.fail_after(60):
                async for event in engine.generate(prompt_tokens=[5, 6, 7], max_tokens=8):
                    events.append(event)
    assert isinstance(events[-1], m.ErrorEvent) and events[-1].code == "stage_failed"
    assert "ran out of memory" in events[-1].message and "kv.memory_fraction" in events[-1].message
    assert isinstance(raised.value.cause, DeviceMemoryError)
    assert counted == [runner.pool] + ([runner.window_pool] if family == "gpt-oss" else [])
    assert (runner.window_pool is not None) == (family == "gpt-oss")
