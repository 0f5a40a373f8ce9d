"""A `python -m unikern worker` subprocess driven line by line: requests in, timestamped
events out (read on a thread), and its resident memory sampled on another. The load
check (tools/check/load.py), the fuzzer and the worker tests drive workers through it."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import psutil

MiB = 1 << 20


class WorkerClient:
    """A worker subprocess: numbered lines in, timestamped events out (read on a thread)."""

    def __init__(
        self,
        model: str,
        *,
        sets: Sequence[str] = (),
        args: Sequence[str] = (),
        env: dict[str, str] | None = None,
        stderr_path: Path | None = None,
    ) -> None:
        cmd = [sys.executable, "-m", "unikern", "worker", "--model", model, *args]
        for item in sets:
            cmd += ["--set", item]
        self._stderr = open(stderr_path, "wb") if stderr_path else subprocess.DEVNULL
        self.stderr_path = stderr_path
        self.proc = subprocess.Popen(
            cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self._stderr,
            env={**os.environ, "TOKENIZERS_PARALLELISM": "false", **(env or {})},
        )
        self.started_at = time.monotonic()
        self.cond = threading.Condition()
        self.lines_sent = 0
        self.events: list[dict[str, Any]] = []  # every event but tokens (those are counted)
        self.not_json: list[bytes] = []
        self.by_line: dict[int, list[dict[str, Any]]] = {}
        self.tokens: dict[str, list[int]] = {}
        self.terminal: dict[str, dict[str, Any]] = {}  # id -> its done/error event
        self.sent_at: dict[str, float] = {}
        self.first_token_at: dict[str, float] = {}
        self.ended_at: dict[str, float] = {}
        self.on_first_token: Callable[[str], None] | None = None  # called under the lock
        self.eof = False
        self.eof_at: float | None = None  # when stdout closed: the process is ending
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for raw in iter(self.proc.stdout.readline, b""):
            now = time.monotonic()
            try:
                event = json.loads(raw)
                kind = event["event"]
            except (ValueError, TypeError, KeyError):
                with self.cond:
                    self.not_json.append(raw)
                    self.cond.notify_all()
                continue
            with self.cond:
                rid = event.get("id")
                if kind == "token":
                    ids = self.tokens.setdefault(rid, [])
                    if not ids:
                        self.first_token_at[rid] = now
                        if self.on_first_token is not None:
                            self.on_first_token(rid)
                    ids.append(event["token_id"])
                else:
                    event["_t"] = now - self.started_at
                    self.events.append(event)
                    if event.get("line") is not None:
                        self.by_line.setdefault(event["line"], []).append(event)
                    if kind in ("done", "error") and isinstance(rid, str) and rid in self.sent_at and rid not in self.terminal:
                        self.terminal[rid] = event
                        self.ended_at[rid] = now
                self.cond.notify_all()
        with self.cond:
            self.eof = True
            self.eof_at = time.monotonic()
            self.cond.notify_all()

    # ---- input ----
    def send(self, data: bytes, request_id: str | None = None) -> int:
        """Write one line (no newline inside); return its 1-based line number."""
        assert self.proc.stdin is not None
        with self.cond:
            self.lines_sent += 1
            number = self.lines_sent
            if request_id is not None:
                self.sent_at[request_id] = time.monotonic()
        self.proc.stdin.write(data + b"\n")
        self.proc.stdin.flush()
        return number

    def send_json(self, obj: dict[str, Any]) -> int:
        rid = obj.get("id") if obj.get("op") == "generate" else None
        return self.send(json.dumps(obj).encode(), rid)

    def close_stdin(self) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.close()

    # ---- waiting ----
    def wait(self, what: str, predicate: Callable[[WorkerClient], bool], timeout: float) -> None:
        deadline = time.monotonic() + timeout
        with self.cond:
            while not predicate(self):
                left = deadline - time.monotonic()
                if self.eof:
                    raise AssertionError(f"the worker closed stdout before {what}\n{self.stderr_tail()}")
                if left <= 0:
                    raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what}\n{self.stderr_tail()}")
                self.cond.wait(min(left, 0.5))

    def wait_ready(self, timeout: float = 180.0) -> None:
        self.wait("ready", lambda c: any(e["event"] == "ready" for e in c.events), timeout)

    def wait_done(self, ids: Sequence[str], timeout: float) -> None:
        self.wait(f"{len(ids)} requests to end", lambda c: all(i in c.terminal for i in ids), timeout)

    def wait_exit(self, timeout: float) -> int:
        """The exit code; raises subprocess.TimeoutExpired if it is not out in time."""
        code = self.proc.wait(timeout)
        self._reader.join(5)
        return code

    def stats_events(self) -> list[dict[str, Any]]:
        with self.cond:
            return [e for e in self.events if e["event"] == "stats"]

    def rss_bytes(self) -> int:
        return psutil.Process(self.proc.pid).memory_info().rss

    def stderr_tail(self, size: int = 4000) -> str:
        if self.stderr_path is None:
            return ""
        self._stderr.flush()
        return self.stderr_path.read_bytes()[-size:].decode(errors="replace")

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        for stream in (self.proc.stdin, self.proc.stdout):
            try:
                stream.close()
            except (BrokenPipeError, OSError):
                pass
        if self.stderr_path is not None:
            self._stderr.close()


class RssSampler:
    """The worker's resident memory every `interval` seconds, on a thread."""

    def __init__(self, client: WorkerClient, interval: float = 0.5) -> None:
        self.client, self.interval = client, interval
        self.samples: list[tuple[float, int]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            try:
                rss = self.client.rss_bytes()
            except psutil.Error:
                return
            if self.client.proc.poll() is not None:  # exited: a zombie reports 0
                return
            self.samples.append((time.monotonic() - self.client.started_at, rss))

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()
