"""The disk tier's directory lock and its shutdown (issue 16): a second engine on the
same model and disk.path is refused with the path and the holder's pid; the lock goes
at shutdown and when the holder dies; stores still queued at shutdown are dropped and
counted, those under way are finished, and a log line says so."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import anyio
import pytest
from structlog.testing import capture_logs

import unikern
from unikern.errors import ConfigError
from unikern.stages.tiers.disk.lock import DirectoryLock
from unikern.stages.tiers.disk.service import DiskTier

pytestmark = pytest.mark.anyio

BLOCK = 16
PROMPT = [(7 * i) % 1000 + 5 for i in range(8 * BLOCK + 3)]  # 8 full blocks to store


def offload(model: str, root: Path, **mover) -> unikern.Engine:
    overrides = {
        "kv": {"kv_budget_bytes": 64 << 20, "host_bytes": 0, "block_size": BLOCK},
        "disk": {"path": str(root)},
        "offload": mover,
    }
    return unikern.Engine.from_pipeline("generate-offload", model=model, overrides=overrides)


async def test_a_second_engine_on_the_same_directory_is_refused(tiny_llama, tmp_path):
    root = tmp_path / "kv"
    async with offload(tiny_llama, root) as first:
        with pytest.raises(unikern.UnikernError) as refused:
            async with offload(tiny_llama, root):
                pass
        # start-up failures name their stage: "stage 'disk' failed: ConfigError: ..."
        assert isinstance(refused.value.cause, ConfigError)
        message = str(refused.value)
        directory = first.stats()["tiers"]["disk"]["path"]
        assert directory in message and "this process" in message and "disk.path" in message
        assert first.stats()["tiers"]["disk"]["locked"]
        result = await first.complete(prompt_tokens=PROMPT, max_tokens=2)  # the first still serves
        assert result.finish_reason == "length"
    assert not first.stats()["tiers"]["disk"]["locked"]
    async with offload(tiny_llama, root) as again:  # released at shutdown
        assert again.stats()["tiers"]["disk"]["locked"]


async def test_engines_on_different_models_share_a_path(tiny_llama, model_dir, tmp_path):
    root = tmp_path / "kv"
    async with offload(tiny_llama, root) as a, offload(model_dir("tiny-qwen3"), root) as b:
        assert a.stats()["tiers"]["disk"]["path"] != b.stats()["tiers"]["disk"]["path"]


HOLD = textwrap.dedent("""
    import sys, time
    from pathlib import Path
    from unikern.stages.tiers.disk.lock import DirectoryLock
    DirectoryLock.acquire(Path(sys.argv[1]), Path(sys.argv[2]))
    print("held", flush=True)
    time.sleep(600)
""")


def test_the_lock_names_another_process_and_dies_with_it(tmp_path):
    lock_file, directory = tmp_path / "ns.lock", tmp_path / "ns"
    holder = subprocess.Popen([sys.executable, "-c", HOLD, str(lock_file), str(directory)], stdout=subprocess.PIPE)
    try:
        assert holder.stdout.readline().strip() == b"held"
        with pytest.raises(ConfigError, match=f"pid {holder.pid}") as refused:
            DirectoryLock.acquire(lock_file, directory)
        assert str(directory) in str(refused.value)
        os.kill(holder.pid, signal.SIGKILL)  # no cleanup runs: the kernel drops the lock
        holder.wait()
    finally:
        if holder.poll() is None:
            holder.kill()
            holder.wait()
        holder.stdout.close()
    lock = DirectoryLock.acquire(lock_file, directory)
    assert lock.held and lock_file.read_text().strip() == str(os.getpid())
    lock.release()
    assert not lock.held


async def test_queued_stores_are_dropped_and_counted_at_shutdown(tiny_llama, tmp_path, monkeypatch):
    """Slow writes, one block at a time: when the request is done, most of its 8 blocks
    still wait to be stored. Shutdown finishes the one under way and drops the rest."""
    write = DiskTier.write
    under_way = threading.Event()

    def slow_write(self, block_hash, payload):
        under_way.set()
        time.sleep(0.2)  # a worker thread: a slow disk
        return write(self, block_hash, payload)

    monkeypatch.setattr(DiskTier, "write", slow_write)
    root = tmp_path / "kv"
    with capture_logs() as logs:
        async with offload(tiny_llama, root, max_inflight_blocks=1) as engine:
            await engine.complete(prompt_tokens=PROMPT, max_tokens=2)
            # shut down with a write under way (on a busy machine the first one may not
            # have started yet when the request is done)
            assert await anyio.to_thread.run_sync(under_way.wait, 30)
        stats = engine.stats()
    mover, disk = stats["offload"], stats["tiers"]["disk"]
    assert stats["offload"]["stores_requested"] == 8
    assert mover["shutdown_dropped_blocks"] >= 1
    assert mover["blocks_stored"] + mover["shutdown_dropped_blocks"] == 8
    assert 1 <= mover["blocks_stored"] and mover["shutdown_flushed_blocks"] <= mover["blocks_stored"]
    assert disk["pending_writes"] == 0 and not disk["locked"]
    (line,) = [e for e in logs if e["event"] == "offload.shutdown"]
    assert line["dropped_blocks"] == mover["shutdown_dropped_blocks"]
    assert line["flushed_blocks"] == mover["shutdown_flushed_blocks"]
    monkeypatch.setattr(DiskTier, "write", write)
    async with offload(tiny_llama, root) as again:  # what was written is there after restart
        assert again.stats()["tiers"]["disk"]["files"] == mover["blocks_stored"]


async def test_the_lock_waits_for_writes_under_way(tiny_llama, tmp_path, monkeypatch):
    """The disk service may close before the mover has finished: its lock is released
    only once the writes under way are done, never while one could still land."""
    released_with_writes: list[int] = []
    release = DirectoryLock.release

    def checked_release(self, tier_writes=released_with_writes):
        tier_writes.append(DiskTier.live.pending_writes)
        release(self)

    original_init = DiskTier.__init__

    def remember(self, *args, **kwargs):
        original_init(self, *args, **kwargs)
        DiskTier.live = self

    monkeypatch.setattr(DiskTier, "__init__", remember)
    monkeypatch.setattr(DirectoryLock, "release", checked_release)
    write = DiskTier.write
    monkeypatch.setattr(DiskTier, "write", lambda self, h, p: (time.sleep(0.1), write(self, h, p))[1])
    async with offload(tiny_llama, tmp_path / "kv", max_inflight_blocks=2) as engine:
        await engine.complete(prompt_tokens=PROMPT, max_tokens=2)
        with anyio.fail_after(30):
            while not engine.stats()["tiers"]["disk"]["pending_writes"]:  # noqa: ASYNC110
                await anyio.sleep(0.01)
    assert released_with_writes[:1] == [0]
