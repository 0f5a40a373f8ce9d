"""The one thread that runs all MLX work of a model, awaited without blocking the loop."""

from __future__ import annotations

import threading
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, TypeVar

import anyio
import anyio.from_thread
import anyio.lowlevel

T = TypeVar("T")


class ModelThread:
    def __init__(self, name: str = "unikern-mlx") -> None:
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix=name)

    async def run(self, fn: Callable[..., T], *args: Any) -> T:
        """Run fn(*args) on the model thread. If the caller is cancelled the call still
        finishes on the thread (MLX work cannot be interrupted), but nobody waits."""
        done = anyio.Event()
        token = anyio.lowlevel.current_token()
        loop_thread = threading.get_ident()

        def wake(_: Future) -> None:
            if threading.get_ident() == loop_thread:
                done.set()  # already finished when the callback was added
                return
            try:
                anyio.from_thread.run_sync(done.set, token=token)
            except RuntimeError:
                pass  # the event loop is gone: nobody is waiting any more

        future = self._executor.submit(fn, *args)
        future.add_done_callback(wake)
        await done.wait()
        return future.result()

    def shutdown(self) -> None:
        self._executor.shutdown(wait=False, cancel_futures=True)
