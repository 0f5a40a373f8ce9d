"""The execute stage over several ranks (`mx.distributed`): start or join the world, send
each rank-0 operation (a step, a pool release, a stats call) to every rank, and name the
rank that was lost. The model's own collectives (mlx-lm's sharded layers, the pipeline's
send/recv) combine the ranks' work; this module only keeps the ranks in step."""

from __future__ import annotations

import faulthandler
import json
import os
import select
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from typing import Any

import mlx.core as mx
import msgspec
import numpy as np
import structlog

from unikern import messages as m
from unikern.errors import ConfigError, UnikernError

log = structlog.get_logger("unikern")

# one collective carries an operation of up to FRAME_BYTES - 8 bytes (a step of a few
# dozen rows); a longer one takes a second collective of exactly its remaining length
FRAME_BYTES = 16384
STATS_BYTES = 1024  # one rank's stats, JSON, per row of the gather
BACKENDS = ("auto", "ring", "nccl", "mpi", "jaccl")
FOLLOWER_MODULE = "unikern.stages.execute.follower"
# MLX keeps the group of its first successful init for the life of the process: a second
# init hands back that group, whose peers may be gone. So one world per process.
_worlds_started = 0
JOIN_WAIT_S = 300.0  # a rank started here must import MLX and reach init within this
INIT_GUARD_S = 120.0  # then init must finish within this, or the process ends (exit 1)


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
        data = json.dumps(mine).encode()[:STATS_BYTES]
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
        if isinstance(exc, RankLost):
            return exc
        deadline = time.monotonic() + wait_s
        while True:
            why = self.lost()
            if why is not None:
                return RankLost(f"{why}; the {self.backend} backend said: {exc}")
            if time.monotonic() >= deadline:
                break
            time.sleep(0.05)
        if "peer" in str(exc) or "ring" in str(exc) or "nccl" in str(exc).lower():
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
        if self.hostfile and self.hostfile.startswith(tempfile.gettempdir()) and os.path.exists(self.hostfile):
            os.unlink(self.hostfile)

    def describe(self) -> dict[str, Any]:
        ranks = [{"rank": r.get("rank"), "pid": r.get("pid"), "host": r.get("host")} for r in self.ranks]
        if not ranks:  # not gathered yet: what rank 0 knows of the ranks it started
            ranks = [{"rank": 0, "pid": os.getpid(), "host": socket.gethostname()}]
            ranks += [{"rank": f.rank, "pid": f.pid, "host": f.host} for f in self.followers]
        return {"backend": self.backend, "size": self.size, "rank": self.rank, "mode": self.mode, "ranks": ranks}


# ---- starting or joining a world ---------------------------------------------------------


def resolve_backend(backend: str) -> str:
    if backend != "auto":
        return backend
    return "nccl" if mx.default_device() == mx.gpu and mx.cuda.is_available() else "ring"


def start_world(size: int, mode: str, backend: str, hostfile: str | None) -> World:
    """Rank 0's world of `size` ranks, not connected yet (`connect`). MLX_RANK in the environment (mlx.launch, or a rank
    started by hand): join the world it describes. Otherwise, with a hostfile, wait for
    the other ranks to join; with none, start them here on loopback (ring) or on this
    host's GPUs (nccl)."""
    global _worlds_started
    backend = resolve_backend(backend)
    if backend not in BACKENDS[1:]:
        raise ConfigError(f"execute.distributed_backend: {backend!r} is not one of {list(BACKENDS)}")
    if _worlds_started:
        raise ConfigError(
            "execute: this process already ran a world of several ranks, and MLX keeps the group of its "
            "first mx.distributed.init for the life of the process; run each engine with tensor_parallel "
            "or pipeline_parallel > 1 in a process of its own"
        )
    _worlds_started += 1
    followers: list[Follower] = []
    if "MLX_RANK" not in os.environ:
        env = dict(os.environ)
        if hostfile is not None:
            _check_hostfile(hostfile, size, backend)
            os.environ.update({"MLX_HOSTFILE": hostfile, "MLX_RANK": "0"})
            followers = [Follower(r, None) for r in range(1, size)]
        else:
            hostfile, followers = _spawn_local(size, backend, env)
    elif int(os.environ["MLX_RANK"]) != 0:
        raise ConfigError(
            f"MLX_RANK={os.environ['MLX_RANK']}: the front door runs rank 0 only; start other ranks "
            f"with `python -m {FOLLOWER_MODULE}`"
        )
    return World(None, backend, 0, size, mode, followers, hostfile)


def connect(world: World) -> None:
    """Rank 0: mx.distributed.init, which waits for every rank to connect, with no timeout
    and no way to interrupt it: first each rank started here says that it is about to
    connect (or is seen to exit: a clean error), then `init` runs under a native
    watchdog, so a rank that dies in between cannot hold rank 0 for good."""
    for f in world.followers:
        _wait_until_joining(world, f)
    group = _init(world.backend, guard_s=INIT_GUARD_S if world.followers and world.followers[0].process else None)
    if group.size() != world.size:
        world.kill()
        raise ConfigError(
            f"execute: the {world.backend} world has {group.size()} ranks but tensor_parallel x pipeline_parallel "
            f"asks for {world.size}; make the hostfile (or mlx.launch's host list) name {world.size} ranks"
        )
    world.group, world.rank = group, group.rank()


def join_world(backend: str) -> World:
    """A follower's world, from the environment its launcher set."""
    backend = resolve_backend(backend)
    say_joining()
    group = _init(backend, guard_s=INIT_GUARD_S if "UNIKERN_RANK0_PID" in os.environ else None)
    return World(group, backend, group.rank(), group.size(), "?")


def _wait_until_joining(world: World, f: Follower) -> None:
    if f.process is None:
        return
    deadline = time.monotonic() + JOIN_WAIT_S
    while time.monotonic() < deadline:
        if select.select([f.process.stdout], [], [], 0.1)[0] and f.process.stdout.readline():
            return
        if f.process.poll() is not None:
            raise RankLost(f"rank {f.rank} (pid {f.pid}) exited with code {f.process.returncode} before joining")
    world.kill()
    raise RankLost(f"rank {f.rank} (pid {f.pid}) did not start within {JOIN_WAIT_S:.0f} s")


def say_joining() -> None:
    """A rank started by rank 0: tell it that init comes next (see `connect`)."""
    if "UNIKERN_RANK0_PID" in os.environ:
        sys.stdout.write("joining\n")
        sys.stdout.flush()


def _init(backend: str, guard_s: float | None = None) -> Any:
    """mx.distributed.init; with `guard_s`, a native watchdog (faulthandler's thread needs
    no GIL) ends the process with its tracebacks if init has not returned by then."""
    if guard_s is not None:
        log.info("distributed.init", backend=backend, guard_s=guard_s)
        faulthandler.dump_traceback_later(guard_s, exit=True)
    try:
        return mx.distributed.init(strict=True, backend=backend)
    except RuntimeError as exc:
        raise ConfigError(
            f"execute: mx.distributed.init(backend={backend!r}) failed: {exc}. ring needs MLX_HOSTFILE "
            f"(a JSON list of [\"ip:port\"] per rank) and MLX_RANK; nccl needs NCCL_HOST_IP, NCCL_PORT, "
            f"MLX_WORLD_SIZE and MLX_RANK"
        ) from exc
    finally:
        if guard_s is not None:
            faulthandler.cancel_dump_traceback_later()


def _check_hostfile(path: str, size: int, backend: str) -> None:
    if backend != "ring":
        return
    try:
        with open(path) as f:
            hosts = json.load(f)
    except (OSError, ValueError) as exc:
        raise ConfigError(f"execute.hostfile: cannot read {path!r} as JSON: {exc}") from exc
    if not isinstance(hosts, list) or len(hosts) != size:
        count = len(hosts) if isinstance(hosts, list) else "no list of"
        raise ConfigError(
            f"execute.hostfile: {path!r} names {count} ranks, the world needs {size} "
            f"(a JSON list with one [\"ip:port\"] list per rank, rank 0 first)"
        )


def _free_ports(n: int) -> list[int]:
    sockets = [socket.socket() for _ in range(n)]
    try:
        for s in sockets:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in sockets]
    finally:
        for s in sockets:
            s.close()


def _spawn_local(size: int, backend: str, env: dict[str, str]) -> tuple[str | None, list[Follower]]:
    """Start ranks 1..size-1 on this machine and point this process at rank 0."""
    hostfile = None
    if backend == "ring":
        fd, hostfile = tempfile.mkstemp(prefix="unikern-ring-", suffix=".json")
        with os.fdopen(fd, "w") as f:
            json.dump([[f"127.0.0.1:{p}"] for p in _free_ports(size)], f)
        common = {"MLX_HOSTFILE": hostfile}
    elif backend == "nccl":
        common = {"NCCL_HOST_IP": "127.0.0.1", "NCCL_PORT": str(_free_ports(1)[0]), "MLX_WORLD_SIZE": str(size)}
    else:
        raise ConfigError(
            f"execute.distributed_backend: {backend} ranks cannot be started by unikern on one machine; "
            f"start them with mlx.launch (or use ring or nccl)"
        )
    followers = []
    for rank in range(1, size):
        child = {**env, **common, "MLX_RANK": str(rank), "UNIKERN_RANK0_PID": str(os.getpid())}
        if backend == "nccl":  # one GPU per rank: the rank-th of those this process may see
            visible = env.get("CUDA_VISIBLE_DEVICES", "").split(",") if env.get("CUDA_VISIBLE_DEVICES") else None
            child["CUDA_VISIBLE_DEVICES"] = visible[rank] if visible and rank < len(visible) else str(rank)
        process = subprocess.Popen(
            [sys.executable, "-m", FOLLOWER_MODULE, "--backend", backend],
            env=child, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,  # one line: "joining"
        )
        followers.append(Follower(rank, process, process.pid))
    os.environ.update({**common, "MLX_RANK": "0"})
    return hostfile, followers
