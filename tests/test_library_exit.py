"""A program that uses the library and returns exits 0, with no `os._exit` anywhere.

The abort this guards against ("terminate called without an active exception", exit
134) came from MLX's thread-local state on the model thread: its destructor takes the
GIL when the OS thread exits, which `Thread.join` does not wait for; if the interpreter
is finalizing by then, the process aborts. The engine now waits for the OS thread."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

import unikern

SCRIPT = textwrap.dedent(
    """
    import anyio, sys, unikern

    async def main():
        overrides = {"kv": {"kv_budget_bytes": 16 << 20}}
        async with unikern.Engine.from_pipeline("generate", model=sys.argv[1], overrides=overrides) as engine:
            result = await engine.complete(prompt_tokens=[1, 2, 3, 4, 5], max_tokens=8)
            print(len(result.token_ids))

    anyio.run(main)
    """
)


def os_thread_alive(native_id: int) -> bool:
    return os.path.isdir(f"/proc/self/task/{native_id}")


@pytest.mark.anyio
async def test_the_model_threads_os_thread_is_gone_when_the_engine_returns(tiny_llama: str) -> None:
    async with unikern.Engine.from_pipeline("generate", model=tiny_llama, overrides={"kv": {"kv_budget_bytes": 16 << 20}}) as engine:
        await engine.complete(prompt_tokens=[1, 2, 3], max_tokens=2)
        execute = next(s for s in engine._router.stages.values() if hasattr(s, "loaded"))
        native_id = execute.loaded.thread._native_id
        assert native_id is not None and os_thread_alive(native_id)
    # not only joined by Python: the OS thread, with its C++ thread-local destructors, ended
    assert not os_thread_alive(native_id)


def test_a_library_program_exits_0_every_time(tiny_llama: str) -> None:
    for _ in range(2):
        done = subprocess.run([sys.executable, "-c", SCRIPT, tiny_llama], capture_output=True, text=True, timeout=120)
        assert done.returncode == 0, done.stderr[-2000:]
        assert done.stdout.split()[-1] == "8"
        assert "terminate called" not in done.stderr
