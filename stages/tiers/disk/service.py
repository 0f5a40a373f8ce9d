"""disk_tier: the compressed disk tier of the KV cache, lent to the offload mover, so that
cached prefixes survive restarts. One checked, byte-shuffled zstd file per logical block,
and per recurrent-state checkpoint (`disk_format`), kept by a `DiskStore`; a bad file is
a miss, never an error."""

from __future__ import annotations

import errno
import hashlib
import os
from pathlib import Path
from typing import Any

import anyio
import numpy as np
import structlog

from unikern.errors import ConfigError
from unikern.stage import ServiceBase, StageContext, StageParams
from unikern.stages.tiers.block_io import LAYOUT, BlockLayout, tier_pools
from unikern.stages.tiers.disk.format import BlockFormatError, RecordKind
from unikern.stages.tiers.disk.lock import DirectoryLock
from unikern.stages.tiers.disk.store import DiskStore, make_namespace
from unikern.stages.tiers.state_io import StateLayout

log = structlog.get_logger("unikern")

GiB = 1 << 30
_SAMPLE_BYTES = 64 << 10


class DiskTierParams(StageParams, frozen=True):
    path: str = "~/.cache/unikern/kv"
    """Directory of the block files (`~` expands), one store per model below it; one engine at a time
    uses a model's store (a lock file; a second is refused at start)."""
    capacity_bytes: int = 8 * GiB
    """Bytes of block files kept (> 0); above it the least recently used files are deleted."""
    compression_level: int = 3
    """zstd level, -7 to 22: higher packs tighter and costs more CPU; levels 1-3 kept up with a
    prefill on the CPUs measured."""
    fsync: bool = False
    """fsync each file when written: blocks survive a power loss, not only a crash of the process."""

    def validate(self) -> list[str]:
        problems = []
        if self.capacity_bytes <= 0:
            problems.append(f"capacity_bytes: must be > 0, got {self.capacity_bytes}")
        if not -7 <= self.compression_level <= 22:
            problems.append(f"compression_level: must be in -7..22, got {self.compression_level}")
        if not self.path:
            problems.append("path: must name a directory, e.g. ~/.cache/unikern/kv")
        return problems


def weights_fingerprint(model_path: str | Path) -> str:
    """A cheap digest of the weight files' contents: name, size and three 64 KiB
    samples of each (a full hash of many GiB would slow every start)."""
    digest = hashlib.blake2b(digest_size=16)
    for f in sorted(Path(model_path).glob("*.safetensors")):
        size = f.stat().st_size
        digest.update(f"{f.name}:{size}".encode())
        with open(f, "rb") as fh:
            for offset in sorted({0, max(0, size // 2 - _SAMPLE_BYTES // 2), max(0, size - _SAMPLE_BYTES)}):
                fh.seek(offset)
                digest.update(fh.read(_SAMPLE_BYTES))
    return digest.hexdigest()


class DiskTier:
    """The `disk` resource: block payloads (and, for recurrent models, state checkpoints:
    `state_layout`) in and out of a DiskStore, thread-safe. OS errors are counted and
    turned into misses or skipped writes."""

    def __init__(
        self,
        store: DiskStore,
        layout: BlockLayout,
        lock: DirectoryLock | None = None,
        state_layout: StateLayout | None = None,
    ) -> None:
        self.store = store
        self.layout = layout
        self.state_layout = state_layout
        self.lock = lock
        self.io_errors = 0
        self.shape_mismatches = 0
        self.pending_writes = 0  # promised by a writer, not yet on disk
        self.closed = False

    def queue_writes(self, num_blocks: int) -> bool:
        """A writer will write this many blocks; False once the tier is closed (the
        directory may be someone else's by the time they would land)."""
        if self.closed:
            return False
        self.pending_writes += num_blocks
        return True

    def drop_writes(self, num_blocks: int) -> None:
        """That many queued writes were done, or given up."""
        self.pending_writes -= num_blocks
        self._release_if_idle()

    def close(self) -> None:
        """No new writes; the directory lock goes once the writes under way are done."""
        self.closed = True
        self._release_if_idle()

    def _release_if_idle(self) -> None:
        if self.closed and self.pending_writes <= 0 and self.lock is not None:
            self.lock.release()

    def contains(self, block_hash: bytes) -> bool:
        return self.store.contains(block_hash)

    def write(self, block_hash: bytes, payload: np.ndarray) -> bool:
        layout = self.layout
        return self._put(block_hash, payload, layout.dtype, layout.shape, layout.block_size, RecordKind.KV_BLOCK)

    def read(self, block_hash: bytes, out: np.ndarray) -> bool:
        """Decode a block straight into `out` (garbage there on a miss)."""
        layout = self.layout
        return self._get(block_hash, out, layout.dtype, layout.shape, layout.block_size, RecordKind.KV_BLOCK)

    # ---- state checkpoints (recurrent models): the state after a block, keyed by its hash

    def contains_state(self, block_hash: bytes) -> bool:
        return self.state_layout is not None and self.store.contains(self.state_layout.key(block_hash))

    def write_state(self, block_hash: bytes, payload: np.ndarray, num_tokens: int) -> bool:
        """Store the state after the prompt prefix of `num_tokens` tokens ending with `block_hash`."""
        layout = self._state_layout()
        return self._put(layout.key(block_hash), payload, layout.dtype, layout.shape, num_tokens, RecordKind.STATE)

    def read_state(self, block_hash: bytes, out: np.ndarray, num_tokens: int) -> bool:
        """Decode the checkpoint after `block_hash` straight into `out` (garbage on a miss)."""
        layout = self._state_layout()
        return self._get(layout.key(block_hash), out, layout.dtype, layout.shape, num_tokens, RecordKind.STATE)

    def _state_layout(self) -> StateLayout:
        if self.state_layout is None:
            raise BlockFormatError(
                "disk tier: a state checkpoint was asked of a model without recurrent layers "
                "(its DiskTier has no state_layout); only recurrent models store states"
            )
        return self.state_layout

    def _put(self, key: bytes, payload: np.ndarray, dtype: str, shape: tuple, tokens: int, kind: RecordKind) -> bool:
        try:
            return self.store.put(key, payload, dtype=dtype, shape=shape, token_count=tokens, kind=kind)
        except OSError as exc:
            self.io_errors += 1
            log.warning("disk.write_failed", error=str(exc), errno=errno.errorcode.get(exc.errno or 0))
            return False

    def _get(self, key: bytes, out: np.ndarray, dtype: str, shape: tuple, tokens: int, kind: RecordKind) -> bool:
        try:
            record = self.store.get(key, out=out, kind=kind)
        except OSError as exc:
            self.io_errors += 1
            log.warning("disk.read_failed", error=str(exc))
            return False
        except BlockFormatError:  # a checked file whose size is not this layout's
            self.shape_mismatches += 1
            self.store.delete(key)
            return False
        if record is None:
            return False
        if record.dtype != dtype or tuple(record.shape) != shape or record.token_count != tokens:
            self.shape_mismatches += 1  # a checked file of another layout: never use it
            self.store.delete(key)
            return False
        return True

    def stats(self) -> dict[str, Any]:
        s = self.store.stats()
        s.update(
            io_errors=self.io_errors,
            shape_mismatches=self.shape_mismatches,
            pending_writes=self.pending_writes,
            path=str(self.store.directory),
            locked=self.lock is not None and self.lock.held,
        )
        return s


def open_disk_tier(
    params: DiskTierParams, model_id: str, layout: BlockLayout, state_layout: StateLayout | None = None
) -> DiskTier:
    """Lock, then open (creating it if missing) the store for this model and layout: the
    lock comes first, as opening sweeps half-written files. Blocking.

    The store lives under `path/<namespace>`. The namespace changes whenever blocks stop
    being interchangeable: the model (its identity plus a sample of its weight files'
    bytes, so two checkpoints with one config never share files), the KV dtype, the
    payload layout and the block size. One engine at a time uses a store directory
    (`DirectoryLock`): a second one on the same model and path is refused at start with
    the holder's pid."""
    namespace = make_namespace(model_id, layout.dtype, LAYOUT, layout.block_size)
    root = Path(os.path.expanduser(params.path))
    try:
        root.mkdir(mode=0o700, parents=True, exist_ok=True)
    except OSError as exc:
        raise ConfigError(f"disk.path: cannot use {str(root)!r} as the KV disk tier: {exc}") from exc
    lock = DirectoryLock.acquire(root / f"{namespace}.lock", root / namespace)
    try:
        store = DiskStore(root, namespace, params.capacity_bytes, fsync=params.fsync, level=params.compression_level)
    except OSError as exc:
        lock.release()
        raise ConfigError(f"disk.path: cannot use {str(root)!r} as the KV disk tier: {exc}") from exc
    except BaseException:
        lock.release()
        raise
    return DiskTier(store, layout, lock, state_layout)


def several_ranks_problems(params_by_stage: dict[str, Any]) -> list[str]:
    """The pipeline-level form of `refuse_several_ranks`: a tier member in a pipeline whose
    settings ask for several ranks (the execute stage's `world_size`) is refused when the
    file is read, before any rank starts (`refuse_several_ranks` checks the world again at
    start)."""
    ranks = max((getattr(p, "world_size", 1) for p in params_by_stage.values()), default=1)
    return [_several_ranks(ranks)] if ranks > 1 else []


def _several_ranks(ranks: int) -> str:
    return (f"the KV tiers do not run with several ranks yet (execute.tensor_parallel / pipeline_parallel "
            f"give {ranks}); use the `generate` pipeline, or one rank")


def refuse_several_ranks(loaded, member: str) -> None:
    """Tier moves read and write one rank's pool; the other ranks' shards do not follow them yet."""
    world = getattr(loaded, "world", None)
    if world is not None:
        raise ConfigError(f"{member}: {_several_ranks(world.size)}")


class DiskTierStage(ServiceBase):
    Params = DiskTierParams
    requires = ("model", "kv")
    provides = ("disk",)
    pipeline_problems = staticmethod(several_ranks_problems)  # (kernel/spec.py)

    async def run(self, ctx: StageContext, *, task_status) -> None:
        loaded = ctx.resource("model")
        refuse_several_ranks(loaded, "disk_tier")
        kv = ctx.resource("kv")
        layout = BlockLayout.of(tier_pools(kv))  # both layer groups' pools, if split
        state_layout = StateLayout.of(kv.states) if kv.states is not None else None
        fingerprint = await anyio.to_thread.run_sync(weights_fingerprint, loaded.path)
        model_id = f"{loaded.identity.hex()}.{fingerprint}/{Path(loaded.path).name}"
        self.disk = await anyio.to_thread.run_sync(open_disk_tier, self.params, model_id, layout, state_layout)
        try:
            ctx.provide("disk", self.disk)
            ctx.log.info("disk.ready", directory=str(self.disk.store.directory), **{
                k: v for k, v in self.disk.store.stats().items() if k in ("files", "bytes_on_disk", "corrupt_files", "swept_tmp_files")
            })
            task_status.started()
            await anyio.sleep_forever()
        finally:
            # the offload mover may still be finishing writes: the lock waits for them
            self.disk.close()
            ctx.log.info("disk.closed", directory=str(self.disk.store.directory),
                         writes_under_way=self.disk.pending_writes, lock_released=not self.disk.lock.held)

    def stats(self) -> dict[str, Any]:
        disk = getattr(self, "disk", None)
        if disk is None:
            return {}
        return {"tiers": {"disk": disk.stats()}}
