"""The one thread that runs all MLX work of a model, awaited without blocking the loop."""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, TypeVar

import anyio
import anyio.to_thread

T = TypeVar("T")

# how long close() waits for the OS thread to finish its exit after Python's join
EXIT_WAIT_SECONDS = 5.0


class ModelThread:
    def __init__(self, name: str = "unikern-mlx") -> None:
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix=name)
        self._native_id: int | None = None

    async def run(self, fn: Callable[..., T], *args: Any) -> T:
        """Run fn(*args) on the model thread. If the caller is cancelled the call still
        finishes on the thread (MLX work cannot be interrupted), but nobody waits."""
        return await self.result(self.submit(fn, *args))

    def submit(self, fn: Callable[..., T], *args: Any) -> Future:
        """Queue fn(*args) behind the thread's earlier calls; `result` awaits it. Calls
        run in the order they were submitted, one at a time."""
        return self._executor.submit(self._call, fn, *args)

    async def result(self, future: Future) -> T:
        """fn's value (or its exception) once it has run. A helper thread waits for it, so
        the model thread goes straight on to its next call without waiting for the event
        loop to take this one's result (the loop may be busy delivering tokens)."""
        if future.done():
            return future.result()
        return await anyio.to_thread.run_sync(future.result, abandon_on_cancel=True)

    def _call(self, fn: Callable[..., T], *args: Any) -> T:
        self._native_id = threading.get_native_id()
        return fn(*args)

    def close(self) -> None:
        """Stop the thread and wait until the OS thread is gone, not only its Python part.

        MLX's Python module keeps thread-local state whose destructor takes the GIL when
        the OS thread exits, after `Thread.join` has already returned. If that happens
        while the interpreter finalizes, CPython ends the thread with a forced unwind
        through the noexcept destructor and the process aborts ("terminate called
        without an active exception", exit 134). Blocking: call it off the event loop."""
        self._executor.shutdown(wait=True, cancel_futures=True)
        tid = self._native_id
        task = f"/proc/self/task/{tid}"
        if tid is None or not os.path.isdir("/proc/self/task"):
            return
        deadline = time.monotonic() + EXIT_WAIT_SECONDS
        while os.path.exists(task) and time.monotonic() < deadline:
            time.sleep(0.001)

    async def aclose(self) -> None:
        """close() on a worker thread, shielded: it runs even while the caller is cancelled."""
        with anyio.CancelScope(shield=True):
            await anyio.to_thread.run_sync(self.close)
