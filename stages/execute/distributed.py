"""The execute stage over several ranks (`mx.distributed`): the world, each rank-0
operation (a step, a pool release, a stats call) sent to every rank, and the rank that
was lost, named (starting or joining a world: launch.py). The model's own collectives
(mlx-lm's sharded layers, the pipeline's hops) combine the ranks' work; this module only
keeps the ranks in step."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import time
from dataclasses import dataclass, field
from typing import Any

import mlx.core as mx
import msgspec
import numpy as np
import structlog

from unikern import messages as m
from unikern.errors import UnikernError

log = structlog.get_logger("unikern")

# one collective carries an operation of up to FRAME_BYTES - 8 bytes (a step of a few
# dozen rows); a longer one takes a second collective of exactly its remaining length
FRAME_BYTES = 16384
STATS_BYTES = 1024  # one rank's stats, JSON, per row of the gather
BACKENDS = ("auto", "ring", "nccl", "mpi", "jaccl")


class RankLost(UnikernError):
    """A rank of the world exited or stopped answering: every request in flight fails."""


# ---- what rank 0 sends to the other ranks (one tagged union, msgpack) ------------------


class Init(msgspec.Struct, frozen=True, tag=True):
    """The execute stage's parameters: every rank loads its shard with the same ones."""

    params: dict[str, Any]


class MakeRunner(msgspec.Struct, frozen=True, tag=True):
    """Build the KV pool (this rank's geometry, these sizes) and the runner."""

    block_size: int
    kernel_block_size: int
    num_blocks: int
    slab_blocks: int
    eager: bool
    fill_value: float


class RunStep(msgspec.Struct, frozen=True, tag=True):
    step: m.Step
    seeds: dict[str, int]


class Release(msgspec.Struct, frozen=True, tag=True):
    keep: list[int]


class Report(msgspec.Struct, frozen=True, tag=True):
    """Every rank contributes its pool figures to one gather."""


class Stop(msgspec.Struct, frozen=True, tag=True):
    pass


RankOp = Init | MakeRunner | RunStep | Release | Report | Stop
_decoder = msgspec.msgpack.Decoder(RankOp)


def for_the_wire(step: m.Step) -> m.Step:
    """The step without per-request callables (logits processors, grammar matchers): they
    act on rank 0's logits only; the other ranks' samples are never read, except inside
    lookahead windows, which carry no callables."""
    if not any(w.processors or w.grammar is not None for w in step.work):
        return step
    work = tuple(msgspec.structs.replace(w, processors=(), grammar=None) for w in step.work)
    return msgspec.structs.replace(step, work=work)


# ---- the world ---------------------------------------------------------------------------


@dataclass
class Follower:
    rank: int
    process: subprocess.Popen | None  # None: started by someone else (mlx.launch, by hand)
    pid: int | None = None
    host: str | None = None


@dataclass
class World:
    group: Any
    backend: str
    rank: int
    size: int
    mode: str  # "tensor" | "pipeline"
    followers: list[Follower] = field(default_factory=list)
    hostfile: str | None = None
    owns_hostfile: bool = False  # written by rank 0 (loopback): removed when the world stops
    step_id: int | None = None  # the step rank 0 is running, for the error that names a rank
    stopping: bool = False
    ranks: list[dict[str, Any]] = field(default_factory=list)  # last gathered per-rank stats

    @property
    def stream(self) -> Any:
        return mx.cpu if self.backend in ("ring", "mpi") else mx.default_stream(mx.default_device())

    def _all_sum(self, data: bytes | int) -> bytes:
        """Sum bytes across ranks as int32 words (exact, and a type every backend sums):
        rank 0 passes its bytes, the others the same length of zeros (an int)."""
        length = data if isinstance(data, int) else len(data)
        words = np.zeros(-(-length // 4), np.int32)
        if not isinstance(data, int):
            words.view(np.uint8)[:length] = np.frombuffer(data, np.uint8)
        out = mx.distributed.all_sum(mx.array(words), group=self.group, stream=self.stream)
        mx.eval(out)
        return np.array(out).view(np.uint8)[:length].tobytes()

    # ---- rank 0 -> every rank -------------------------------------------------------

    def send(self, op: RankOp) -> None:
        """Rank 0: hand `op` to every rank (the others contribute zeros to the sum)."""
        if isinstance(op, RunStep):
            self.step_id = op.step.step_id
        payload = msgspec.msgpack.encode(op)
        head = payload[: FRAME_BYTES - 8]
        self._all_sum(len(payload).to_bytes(8, "little") + head + bytes(FRAME_BYTES - 8 - len(head)))
        if len(payload) > len(head):
            self._all_sum(payload[len(head) :])

    def receive(self) -> RankOp:
        """Other ranks: the next operation rank 0 sends (blocks until it does)."""
        frame = self._all_sum(FRAME_BYTES)
        length = int.from_bytes(frame[:8], "little")
        payload = frame[8 : 8 + min(length, FRAME_BYTES - 8)]
        if length > len(payload):
            payload += self._all_sum(length - len(payload))
        return _decoder.decode(payload)

    def gather(self, mine: dict[str, Any]) -> list[dict[str, Any]]:
        """Every rank's `mine` (JSON, under STATS_BYTES), in rank order, on every rank."""
        rows = bytearray(self.size * STATS_BYTES)
        data = json.dumps(mine).encode()
        if len(data) > STATS_BYTES:  # cut, it would be invalid JSON on every rank
            raise ValueError(f"rank {self.rank}: its stats row is {len(data)} bytes, over STATS_BYTES "
                             f"({STATS_BYTES}) in stages/execute/distributed.py; raise it or trim the row")
        rows[self.rank * STATS_BYTES : self.rank * STATS_BYTES + len(data)] = data
        summed = self._all_sum(bytes(rows))
        rows_out = [summed[r * STATS_BYTES : (r + 1) * STATS_BYTES] for r in range(self.size)]
        return [json.loads(r.rstrip(b"\0") or b"{}") for r in rows_out]

    # ---- rank 0: watching the others ----------------------------------------------------

    def lost(self) -> str | None:
        """Why the world is broken, naming the rank, if a follower this process started has
        exited; None while all run (or while rank 0 is stopping them on purpose)."""
        if self.stopping:
            return None
        for f in self.followers:
            code = f.process.poll() if f.process is not None else None
            if code is not None:
                during = f"during step {self.step_id}" if self.step_id is not None else "before the first step"
                return f"rank {f.rank} (pid {f.pid}) exited with code {code} {during}"
        return None

    def explain(self, exc: BaseException, wait_s: float = 3.0) -> BaseException:
        """A collective failed on rank 0: if a follower died, the error names it (its exit
        may take a moment to be reaped); otherwise the original error stands."""
        if isinstance(exc, (RankLost, UnikernError)):  # ours, e.g. a refusal every rank made alike
            return exc
        deadline = time.monotonic() + wait_s
        while True:
            why = self.lost()
            if why is not None:
                return RankLost(f"{why}; the {self.backend} backend said: {exc}")
            if time.monotonic() >= deadline:
                break
            time.sleep(0.05)
        said = str(exc)
        if "connection to a peer was lost" in said or "[ring]" in said or "nccl" in said.lower():
            known = ", ".join(f"rank {r.get('rank')} pid {r.get('pid')} on {r.get('host')}" for r in self.ranks[1:])
            during = f" during step {self.step_id}" if self.step_id is not None else ""
            return RankLost(f"a rank of the {self.backend} world was lost{during} ({known or 'ranks unknown'}): {exc}")
        return exc

    def stop(self, timeout_s: float = 10.0) -> None:
        """Rank 0: tell every rank to exit, then wait for the followers it started."""
        self.stopping = True
        if self.lost_any() or self.group is None:
            self.kill()
            return
        try:
            self.send(Stop())
        except Exception as exc:  # a rank is gone already: nothing to tell
            log.warning("distributed.stop_failed", error=str(exc))
        deadline = time.monotonic() + timeout_s
        for f in self.followers:
            if f.process is None:
                continue
            try:
                f.process.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                f.process.kill()
                f.process.wait()
        self._release_followers()

    def lost_any(self) -> bool:
        return any(f.process is not None and f.process.poll() is not None for f in self.followers)

    def kill(self) -> None:
        """Rank 0, after a loss: end the followers still running (by their own pids)."""
        self.stopping = True
        for f in self.followers:
            if f.process is not None and f.process.poll() is None:
                f.process.kill()
                f.process.wait()
        self._release_followers()

    def _release_followers(self) -> None:
        for f in self.followers:
            if f.process is not None and f.process.stdout is not None:
                f.process.stdout.close()
        if self.owns_hostfile and self.hostfile and os.path.exists(self.hostfile):
            os.unlink(self.hostfile)

    def describe(self) -> dict[str, Any]:
        ranks = [{"rank": r.get("rank"), "pid": r.get("pid"), "host": r.get("host")} for r in self.ranks]
        if not ranks:  # not gathered yet: what rank 0 knows of the ranks it started
            ranks = [{"rank": 0, "pid": os.getpid(), "host": socket.gethostname()}]
            ranks += [{"rank": f.rank, "pid": f.pid, "host": f.host} for f in self.followers]
        return {"backend": self.backend, "size": self.size, "rank": self.rank, "mode": self.mode, "ranks": ranks}
