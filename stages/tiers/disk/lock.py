"""One engine at a time on a disk tier's store directory: an exclusive `fcntl.flock` on a
lock file beside it, released at close and by the kernel when the process dies."""

from __future__ import annotations

import fcntl
import os
from pathlib import Path

from unikern.errors import ConfigError

_FLAGS = os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC


class DirectoryLock:
    """Held from `acquire` until `release`. The file keeps the holder's pid so that a
    refused engine can name it; a file left by a dead process is free to take (flock
    locks die with their process), so there is nothing stale to clean up."""

    def __init__(self, fd: int, path: Path) -> None:
        self._fd: int | None = fd
        self.path = path

    @classmethod
    def acquire(cls, path: Path, directory: Path) -> DirectoryLock:
        """Lock `path` for `directory`, or raise ConfigError naming both and the holder."""
        try:
            fd = os.open(path, _FLAGS, 0o600)
        except OSError as exc:
            raise ConfigError(f"disk.path: cannot create the lock file {str(path)!r}: {exc}") from exc
        try:
            # per open file: a second engine in this same process is refused too
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = _holder_pid(fd)
            os.close(fd)
            who = "this process" if holder == os.getpid() else f"pid {holder}" if holder else "an unknown pid"
            raise ConfigError(
                f"disk.path: the KV disk tier directory {str(directory)!r} is in use by another "
                f"engine ({who}, lock file {str(path)!r}); two engines on one model and path "
                "would evict and sweep each other's files: give this one its own disk.path, "
                "or stop the other"
            ) from None
        except BaseException:
            os.close(fd)
            raise
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        return cls(fd, path)

    @property
    def held(self) -> bool:
        return self._fd is not None

    def release(self) -> None:
        if self._fd is None:
            return
        fd, self._fd = self._fd, None
        try:
            fcntl.flock(fd, fcntl.LOCK_UN)
        finally:
            os.close(fd)


def _holder_pid(fd: int) -> int | None:
    try:
        return int(os.pread(fd, 32, 0).split()[0])
    except (OSError, ValueError, IndexError):  # being written, or not ours
        return None
