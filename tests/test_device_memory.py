"""A step that fails for want of device memory: MLX's own message names no setting, so the
execute stage raises DeviceMemoryError with what MLX held and the settings that ask less."""

from __future__ import annotations

import anyio
import pytest

import unikern
from tests.conftest import SMALL_KV
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


def test_the_message_says_what_mlx_held_and_what_to_change() -> None:
    text = str(device_memory_error(RuntimeError(CUDA_OOM), pool_bytes=3 << 30))
    assert CUDA_OOM in text and "KV pool committed 3.00 GiB" in text
    for part in ("active ", "cached ", "peak ", "limit ", "kv.memory_fraction", "schedule.max_num_seqs",
                 "mx.set_memory_limit"):
        assert part in text


@pytest.mark.anyio
async def test_an_engine_out_of_device_memory_fails_with_device_memory_error(tiny_llama: str) -> None:
    engine = unikern.Engine.from_pipeline("generate", model=tiny_llama, overrides=SMALL_KV)
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
