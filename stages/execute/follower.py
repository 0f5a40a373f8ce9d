"""A rank other than 0: `python -m unikern.stages.execute.follower [--backend ring]`.

It joins the world its launcher describes (MLX_RANK plus MLX_HOSTFILE for ring, or
NCCL_HOST_IP / NCCL_PORT / MLX_WORLD_SIZE for nccl), takes the execute stage's
parameters from rank 0, loads its shard, builds its own KV pool and runs every
operation rank 0 sends, through the same runner code, until told to stop."""

from __future__ import annotations

import argparse
import os
import sys
import threading
import time

import msgspec
import structlog

from unikern.platform.pinning import WeightWiring
from unikern.stages.execute.distributed import (
    BACKENDS,
    Init,
    MakeRunner,
    Release,
    Report,
    RunStep,
    Stop,
)
from unikern.stages.execute.launch import join_world
from unikern.stages.execute.ranks import local_stats, make_runner, pool_like, prepare_model

log = structlog.get_logger("unikern")


def serve(backend: str) -> int:
    from unikern.stages.execute.stage import MLXExecuteParams

    world = join_world(backend)
    first = world.receive()
    if not isinstance(first, Init):
        raise RuntimeError(f"rank {world.rank}: expected Init from rank 0 first, got {type(first).__name__}")
    params = msgspec.convert(first.params, MLXExecuteParams)
    world.mode = "tensor" if params.tensor_parallel > 1 else "pipeline"
    wiring = WeightWiring()
    prepared = prepare_model(params, world, wiring)
    runner = None
    steps = 0
    while True:
        op = world.receive()
        match op:
            case RunStep(step=step, seeds=seeds):
                runner.execute(step, seeds)  # its tokens are rank 0's too; only rank 0's are read
                steps += 1
            case MakeRunner():
                runner = make_runner(prepared, pool_like(op, prepared.loaded))
            case Release(keep=keep):
                runner.pool.release(keep)
            case Report():
                world.gather(local_stats(world, runner.pool if runner else None))
            case Stop():
                log.info("follower.stopped", rank=world.rank, steps=steps)
                wiring.unwire()
                return 0
            case _:
                raise RuntimeError(f"rank {world.rank}: unexpected operation {type(op).__name__}")


def _exit_with_rank_zero(pid: int) -> None:
    """Started by rank 0 on this machine: end when it is gone (a collective may never
    notice, e.g. NCCL waiting on a dead peer)."""
    def poll() -> None:
        while True:
            time.sleep(0.5)
            try:
                os.kill(pid, 0)
            except ProcessLookupError:
                os._exit(3)
            if os.getppid() != pid:
                os._exit(3)

    threading.Thread(target=poll, name="unikern-rank0-watch", daemon=True).start()


def main(argv: list[str] | None = None) -> int:
    from unikern.frontends import logs

    parser = argparse.ArgumentParser(prog="python -m unikern.stages.execute.follower", description=__doc__)
    parser.add_argument("--backend", default="auto", choices=BACKENDS)
    parser.add_argument("--log-level", default="warning")
    args = parser.parse_args(argv)
    logs.configure(args.log_level)
    if "UNIKERN_RANK0_PID" in os.environ:
        _exit_with_rank_zero(int(os.environ["UNIKERN_RANK0_PID"]))
    try:
        code = serve(args.backend)
    except Exception as exc:  # the world broke (rank 0 gone) or a step failed here
        print(f"unikern rank {os.environ.get('MLX_RANK', '?')}: {type(exc).__name__}: {exc}", file=sys.stderr)
        code = 1
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)  # no interpreter teardown of MLX's native state (see cli.leave)


if __name__ == "__main__":
    main()
