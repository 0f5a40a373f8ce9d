"""The compressed disk tier's storage: one checked file per KV block or state checkpoint, LRU
under a byte cap. Synchronous and thread-safe; the disk stage calls it from a worker thread."""

from __future__ import annotations

import errno
import hashlib
import os
import re
import secrets
import stat
import threading
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from unikern.errors import ConfigError, UnikernError
from unikern.stages.tiers.disk.format import (
    MAX_HEADER_BYTES,
    CorruptBlockError,
    DecodedBlock,
    RecordKind,
    decode_block,
    encode_block,
    parse_header,
)

SUFFIX = ".ukkv"
TMP_PREFIX = ".tmp-"
KEY_HEX = re.compile(r"[0-9a-f]{32,64}")
NAMESPACE = re.compile(r"[a-z0-9][a-z0-9._-]{0,127}")
DISK_FULL = frozenset({errno.ENOSPC, errno.EDQUOT})
_READ_FLAGS = os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC
_CREATE_FLAGS = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC


class InvalidKeyError(UnikernError, ValueError):
    """A block key that cannot name a file: not bytes, or not 16..32 bytes long."""


def make_namespace(model_id: str, dtype: str, layout: str, block_size: int) -> str:
    """A directory name that changes whenever blocks stop being interchangeable."""
    if not all(isinstance(part, str) and part for part in (model_id, dtype, layout)):
        raise ConfigError(
            f"model_id, dtype and layout must be non-empty strings, got {(model_id, dtype, layout)!r}"
        )
    if isinstance(block_size, bool) or not isinstance(block_size, int) or block_size <= 0:
        raise ConfigError(f"block_size must be a positive int, got {block_size!r}")
    identity = "\0".join((model_id, dtype, layout, str(block_size))).encode()
    digest = hashlib.blake2b(identity, digest_size=10).hexdigest()
    readable = re.sub(r"[^a-z0-9._-]+", "-", model_id.rsplit("/", 1)[-1].lower()).strip("-._")[:40]
    return f"{readable or 'model'}-{dtype}-{block_size}-{digest}"[:128]


@dataclass(slots=True)
class _Entry:
    file_bytes: int
    raw_bytes: int
    kind: RecordKind = RecordKind.KV_BLOCK


class DiskStore:
    """Blocks on disk under `root/namespace`, at most `capacity_bytes` of files (a block
    being written adds one temp file on top). `level` is the zstd level.

    Files live in `root/<namespace>/<key hex>.ukkv`. They are written to a private temp
    file and renamed into place, so a reader sees a whole file or none; a crash leaves only
    a `.tmp-*` file, swept at the next start. Files are verified when read, not at start-up.
    One `DiskStore` (one process) owns a directory: the index and the byte cap are its own."""

    def __init__(
        self,
        root: Path | str,
        namespace: str,
        capacity_bytes: int,
        *,
        fsync: bool = False,
        level: int = 3,
    ) -> None:
        if not isinstance(namespace, str) or not NAMESPACE.fullmatch(namespace):
            raise ConfigError(
                f"namespace {namespace!r} must match {NAMESPACE.pattern} (see make_namespace)"
            )
        if (
            isinstance(capacity_bytes, bool)
            or not isinstance(capacity_bytes, int)
            or capacity_bytes <= 0
        ):
            raise ConfigError(f"capacity_bytes must be a positive int, got {capacity_bytes!r}")
        if isinstance(level, bool) or not isinstance(level, int) or not -7 <= level <= 22:
            raise ConfigError(f"zstd level must be an int in -7..22, got {level!r}")
        self.directory = Path(root) / namespace
        self.capacity_bytes = capacity_bytes
        self.fsync = fsync
        self.level = level
        self._lock = threading.Lock()
        self._index: OrderedDict[bytes, _Entry] = OrderedDict()  # least recently used first
        self._file_bytes = 0
        self._raw_bytes = 0
        self._counters = dict.fromkeys(
            (
                "hits",
                "misses",
                "evictions",
                "corrupt_files",
                "write_errors",
                "refused_too_large",
                "swept_tmp_files",
                "removed_symlinks",
            ),
            0,
        )
        self._prepare_directory(Path(root))
        self._rebuild_index()

    # ---- public API -------------------------------------------------------------------

    def put(
        self,
        key: bytes,
        payload: memoryview | bytes | np.ndarray,
        *,
        dtype: str,
        shape: tuple[int, ...],
        token_count: int,
        fsync: bool | None = None,
        kind: RecordKind = RecordKind.KV_BLOCK,
    ) -> bool:
        """Store a record (replacing one under the same key). False if it is bigger than the
        whole cap or the disk is full; other OS errors propagate."""
        name = self._file_name(key)
        data = encode_block(
            key, payload, dtype=dtype, shape=shape, token_count=token_count, level=self.level, kind=kind
        )
        if len(data) > self.capacity_bytes:
            with self._lock:
                self._counters["refused_too_large"] += 1
            return False
        entry = _Entry(len(data), parse_header(data).raw_length, RecordKind(kind))
        fsync = self.fsync if fsync is None else fsync
        tmp_path = self.directory / f"{TMP_PREFIX}{secrets.token_hex(8)}"
        try:
            self._write_file(tmp_path, data, fsync)
            with self._lock:
                os.replace(tmp_path, self.directory / name)
                self._forget(key)
                self._remember(key, entry)
                self._evict_until_free(0)  # the new block is newest, so it is never the victim
            if fsync:
                self._fsync_directory()
        except OSError as exc:
            tmp_path.unlink(missing_ok=True)
            if exc.errno not in DISK_FULL:
                raise
            with self._lock:
                self._counters["write_errors"] += 1
            return False
        return True

    def get(
        self, key: bytes, out: np.ndarray | None = None, kind: RecordKind = RecordKind.KV_BLOCK
    ) -> DecodedBlock | None:
        """The verified record, or None on a miss. A corrupt file (or one of another kind)
        is deleted and is a miss. With `out`, the payload is decoded straight into it
        (garbage on a miss)."""
        path = self.directory / self._file_name(key)
        with self._lock:
            if key not in self._index:
                self._counters["misses"] += 1
                return None
        try:
            fd = os.open(path, _READ_FLAGS)
        except OSError as exc:
            if exc.errno not in (errno.ENOENT, errno.ELOOP):
                raise
            with self._lock:
                self._drop_missing_or_link(key, path)
                self._counters["misses"] += 1
            return None
        try:
            inode = os.fstat(fd).st_ino
            data = _read_all(fd)
            block = decode_block(data, expected_key=key, out=out, expected_kind=kind)
            _touch(fd)
        except CorruptBlockError:
            with self._lock:
                self._drop_corrupt(key, path, inode)
                self._counters["misses"] += 1
            return None
        finally:
            os.close(fd)
        with self._lock:
            if key in self._index:
                self._index.move_to_end(key)
            self._counters["hits"] += 1
        return block

    def contains(self, key: bytes) -> bool:
        self._file_name(key)
        with self._lock:
            return key in self._index

    def keys(self) -> list[bytes]:
        """Stored keys, least recently used first."""
        with self._lock:
            return list(self._index)

    def delete(self, key: bytes) -> bool:
        name = self._file_name(key)
        with self._lock:
            if not self._forget(key):
                return False
            (self.directory / name).unlink(missing_ok=True)
            return True

    def stats(self) -> dict[str, int | float]:
        """Counters and sizes. `compression_ratio` is raw bytes / file bytes, 0.0 when empty."""
        with self._lock:
            ratio = self._raw_bytes / self._file_bytes if self._file_bytes else 0.0
            states = sum(1 for e in self._index.values() if e.kind == RecordKind.STATE)
            return {
                "blocks": len(self._index) - states,
                "states": states,  # recurrent-state checkpoints
                "files": len(self._index),  # one file per block or state
                "bytes_on_disk": self._file_bytes,
                "bytes": self._raw_bytes,
                "compression_ratio": ratio,
                "capacity_bytes": self.capacity_bytes,
                **self._counters,
            }

    # ---- index bookkeeping (caller holds the lock) -------------------------------------

    def _remember(self, key: bytes, entry: _Entry) -> None:
        self._index[key] = entry
        self._file_bytes += entry.file_bytes
        self._raw_bytes += entry.raw_bytes

    def _forget(self, key: bytes) -> bool:
        entry = self._index.pop(key, None)
        if entry is None:
            return False
        self._file_bytes -= entry.file_bytes
        self._raw_bytes -= entry.raw_bytes
        return True

    def _evict_until_free(self, needed_bytes: int) -> None:
        while self._index and self._file_bytes + needed_bytes > self.capacity_bytes:
            victim = next(iter(self._index))
            self._forget(victim)
            (self.directory / (victim.hex() + SUFFIX)).unlink(missing_ok=True)
            self._counters["evictions"] += 1

    def _drop_missing_or_link(self, key: bytes, path: Path) -> None:
        # Re-check under the lock: a put may have just replaced the name with a good file.
        try:
            info = os.lstat(path)
        except FileNotFoundError:
            self._forget(key)
            return
        if stat.S_ISLNK(info.st_mode):  # we never make links: drop it, never follow it
            path.unlink()
            self._counters["removed_symlinks"] += 1
            self._forget(key)

    def _drop_corrupt(self, key: bytes, path: Path, inode: int) -> None:
        # A put may have replaced the file since we read it; only delete the file we read.
        self._counters["corrupt_files"] += 1
        try:
            if os.lstat(path).st_ino != inode:
                return
            path.unlink()
        except FileNotFoundError:
            pass
        self._forget(key)

    # ---- files ------------------------------------------------------------------------

    def _file_name(self, key: bytes) -> str:
        if not isinstance(key, bytes):
            raise InvalidKeyError(f"key must be bytes, got {type(key).__name__} {key!r:.80}")
        name = key.hex()
        if not KEY_HEX.fullmatch(name):
            raise InvalidKeyError(f"key must be 16..32 bytes, got {len(key)}: {name[:80]}")
        return name + SUFFIX

    def _prepare_directory(self, root: Path) -> None:
        root.mkdir(mode=0o700, parents=True, exist_ok=True)
        try:
            self.directory.mkdir(mode=0o700)
        except FileExistsError:
            pass
        info = os.lstat(self.directory)
        if not stat.S_ISDIR(info.st_mode):
            raise ConfigError(f"{self.directory} is not a directory (symlinks are refused)")
        if info.st_uid != os.getuid():
            raise ConfigError(f"{self.directory} belongs to uid {info.st_uid}, not to this user")
        if stat.S_IMODE(info.st_mode) != 0o700:
            os.chmod(self.directory, 0o700)

    def _rebuild_index(self) -> None:
        found: list[tuple[int, str, bytes, _Entry]] = []
        with os.scandir(self.directory) as entries:
            for entry in entries:
                if entry.is_symlink():
                    # We never make links; one here could point reads or deletes elsewhere.
                    Path(entry.path).unlink(missing_ok=True)
                    self._counters["removed_symlinks"] += 1
                    continue
                if entry.name.startswith(TMP_PREFIX) and entry.is_file(follow_symlinks=False):
                    Path(entry.path).unlink(missing_ok=True)  # a write that never finished
                    self._counters["swept_tmp_files"] += 1
                    continue
                stem = entry.name.removesuffix(SUFFIX)
                if stem == entry.name or not KEY_HEX.fullmatch(stem):
                    continue  # not ours: leave it alone
                if not entry.is_file(follow_symlinks=False):
                    continue
                key = bytes.fromhex(stem)
                scanned = self._scan_header(Path(entry.path), key)
                if scanned is None:
                    self._counters["corrupt_files"] += 1
                    Path(entry.path).unlink(missing_ok=True)
                    continue
                mtime_ns, file_entry = scanned
                found.append((mtime_ns, entry.name, key, file_entry))
        for _, _, key, file_entry in sorted(found):
            self._remember(key, file_entry)
        self._evict_until_free(0)

    @staticmethod
    def _scan_header(path: Path, key: bytes) -> tuple[int, _Entry] | None:
        """(mtime, sizes) from a file's header, or None if the header or length is wrong."""
        try:
            fd = os.open(path, _READ_FLAGS)
        except FileNotFoundError:
            return None
        try:
            info = os.fstat(fd)
            header = parse_header(os.read(fd, MAX_HEADER_BYTES))
        except CorruptBlockError:
            return None
        finally:
            os.close(fd)
        if header.key != key or header.file_length != info.st_size:
            return None
        return info.st_mtime_ns, _Entry(info.st_size, header.raw_length, header.kind)

    def _write_file(self, path: Path, data: bytes, fsync: bool) -> None:
        fd = os.open(path, _CREATE_FLAGS, 0o600)
        try:
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view) :]
            if fsync:
                os.fsync(fd)
        finally:
            os.close(fd)

    def _fsync_directory(self) -> None:
        fd = os.open(self.directory, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def _touch(fd: int) -> None:
    # The file's mtime carries the LRU order across restarts; best effort.
    if os.utime in os.supports_fd:
        try:
            os.utime(fd)
        except OSError:
            pass


def _read_all(fd: int) -> bytes:
    size = os.fstat(fd).st_size
    chunks = []
    while True:
        chunk = os.read(fd, max(size, 1 << 16))
        if not chunk:
            return b"".join(chunks) if len(chunks) != 1 else chunks[0]
        chunks.append(chunk)
