"""Starting a world of ranks or joining one: rank 0 starts the other ranks on this machine
(a loopback ring hostfile, or one GPU each for nccl) or waits for ranks started elsewhere
(a hostfile, mlx.launch); every rank then calls `mx.distributed.init(strict=True)`."""

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
from typing import Any

import mlx.core as mx
import structlog

from unikern.errors import ConfigError
from unikern.platform import cuda_is_default
from unikern.stages.execute.distributed import BACKENDS, Follower, RankLost, World

log = structlog.get_logger("unikern")

FOLLOWER_MODULE = "unikern.stages.execute.follower"
# MLX keeps the group of its first successful init for the life of the process: a second
# init hands back that group, whose peers may be gone. So one world per process.
_worlds_started = 0
JOIN_WAIT_S = 300.0  # a rank started here must import MLX and reach init within this
INIT_GUARD_S = 120.0  # then init must finish within this, or the process ends (exit 1)


def resolve_backend(backend: str, hostfile: str | None = None) -> str:
    """"auto": ring where a hostfile describes the world (execute.hostfile or MLX_HOSTFILE:
    ring's format), else nccl on a CUDA GPU and ring elsewhere."""
    if backend != "auto":
        return backend
    if hostfile or os.environ.get("MLX_HOSTFILE"):
        return "ring"
    return "nccl" if cuda_is_default() else "ring"


def start_world(size: int, mode: str, backend: str, hostfile: str | None) -> World:
    """Rank 0's world of `size` ranks, not connected yet (`connect`). MLX_RANK in the environment (mlx.launch, or a rank
    started by hand): join the world it describes. Otherwise, with a hostfile, wait for
    the other ranks to join; with none, start them here on loopback (ring) or on this
    host's GPUs (nccl)."""
    global _worlds_started
    backend = resolve_backend(backend, hostfile)
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
    owns = bool(followers) and followers[0].process is not None and backend == "ring"
    return World(None, backend, 0, size, mode, followers, hostfile, owns_hostfile=owns)


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
