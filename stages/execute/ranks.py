"""What every rank does alike (load its shard, wire it, warm up, build its pool and runner,
in the same order, since each may run the model's collectives), and rank 0's side of
the world: each step sent to the ranks before it runs, their pool figures gathered,
their processes watched from the event loop."""

from __future__ import annotations

import os
import socket
import time
from dataclasses import dataclass
from typing import Any

import anyio
import mlx.core as mx
import mlx.nn as nn
import psutil

from unikern import messages as m
from unikern.errors import ConfigError
from unikern.platform import cuda_is_default, current_platform, read_ahead, shared_bridge
from unikern.platform.fusion import set_fusion
from unikern.platform.pinning import WeightWiring, WiredReport
from unikern.stages.execute.distributed import (
    MakeRunner,
    Release,
    Report,
    RunStep,
    World,
    for_the_wire,
)
from unikern.stages.execute.model import LoadedModel, load_model
from unikern.stages.execute.quantized import (
    AUTO_DTYPES,
    AUTO_ROWS,
    KERNEL_ROWS,
    route_quantized_layers,
)
from unikern.stages.execute.runner import ModelRunner
from unikern.stages.execute.warmup import warm_up
from unikern.stages.kv.pool import KVPool
from unikern.startup import PhaseClock

REPORT_EVERY_S = 0.25  # per-rank stats are gathered after a step at most this often
WATCH_EVERY_S = 0.1  # how often rank 0 polls the ranks it started


def switch(setting: str, *, auto: bool) -> bool:
    """An "auto" | "always" | "never" parameter, with what auto means here."""
    return {"always": True, "never": False}.get(setting, auto)


def traces_prefill(setting: str, compile_decode: bool, model: Any) -> bool:
    """execute.compile_prefill: "always", or "auto" where the decode windows are traced and
    the model has no quantized layers (measured on an H200 with the 1B shape in bfloat16;
    4-bit models keep the op-by-op prefill their figures were taken with)."""
    quantized = any(isinstance(layer, nn.QuantizedLinear) for _, layer in model.named_modules())
    return switch(setting, auto=compile_decode and not quantized)


@dataclass
class Prepared:
    loaded: LoadedModel
    wired: WiredReport
    kernels: bool
    compile_decode: bool
    warmup: dict[str, Any] | None
    quantized: dict[str, Any]
    paged_attention: bool = False
    compile_one_row: bool = False
    startup: dict[str, float] | None = None  # seconds per start-up phase (stats.model.startup)
    prefill_rows: int = 0  # prompts of up to this many tokens run as rows (execute.prefill_rows)
    compile_prefill: bool = False  # fresh prompts through traced forwards (execute.compile_prefill)
    cudnn_attention: bool = False  # MLX_CUDA_USE_CUDNN_SDPA as this process set it (execute.cudnn_attention)
    fuse_elementwise: bool = True  # MLX's fusion in this process's traces (execute.fuse_elementwise)


def cudnn_attention(on: bool) -> bool:
    """Whether MLX's CUDA backend may take cuDNN's SDPA in this process (execute.cudnn_attention):
    MLX_CUDA_USE_CUDNN_SDPA as the environment already sets it, else as `on` asks. MLX reads
    the variable once, at the process's first attention: set before the model runs, it holds
    unless the process ran an attention before (another engine, mlx-lm)."""
    return os.environ.setdefault("MLX_CUDA_USE_CUDNN_SDPA", "1" if on else "0") not in ("0", "")


def fuses_quantized(setting: str, own_kernels: bool) -> bool:
    """Whether execute.fuse_projections joins quantized projections too: "always", or
    "auto" where unikern's 4-bit kernels multiply them (`own_kernels`). Through MLX's
    quantized kernels the 4-bit 8B shape lost 5% fused on an H200 (tools/bench/bench_gpu.py);
    through the GEMV, one 8B-shape token's GPU time went 4.40 -> 3.83 ms fused (575 -> 476
    kernels; CUPTI on an H200, tools/probe/probe_cuda.py's engine-paged-q): the k and v
    projections (1024 features) were small launches of their own."""
    return setting == "always" or (setting == "auto" and own_kernels)


def fuses_elementwise(setting: str, backend: str) -> bool:
    """Whether traced steps fuse element-wise chains (execute.fuse_elementwise): "auto" is
    off on CUDA, where MLX compiles each fused kernel with NVRTC on a machine's first start
    (an H200's fresh 1B start took 40.0 s with fusion, 14.8 s without, the same machine;
    tools/results/h200/startup-1b-h200-8db264e*.json), and on elsewhere."""
    return switch(setting, auto=backend != "cuda")


def prepare_model(params: Any, world: World | None, wiring: WeightWiring) -> Prepared:
    """Load (this rank's shard of) the model, wire it and warm it up: on the model thread."""
    backend = current_platform().backend
    cudnn = cudnn_attention(params.cudnn_attention)
    clock = PhaseClock()
    ahead = read_ahead.take()  # the command line's read of the weights (platform/read_ahead.py)
    if ahead is not None:
        ahead.arrays()  # done before any other MLX work
        clock.mark("read_ahead_wait_s")
    mx.eval(mx.zeros(1) + 1)  # the device's own start (a CUDA context), apart from the load
    clock.mark("device_s")
    if params.prefill_rows != "auto" and (not isinstance(params.prefill_rows, int) or params.prefill_rows < 0):
        raise ConfigError(f"execute.prefill_rows: {params.prefill_rows!r} is not a number of tokens; use a "
                          "count (0: off) or 'auto'")
    for name in ("quantized_gemv", "quantized_mma", "dense_mma"):
        if getattr(params, name) == "always" and not cuda_is_default():
            raise ConfigError(f"execute.{name}: 'always' needs MLX's CUDA backend (this one is {backend!r}); "
                              "use 'auto' (on where CUDA is) or 'never'")
    gemv = switch(params.quantized_gemv, auto=backend == "cuda") and cuda_is_default()
    mma = switch(params.quantized_mma, auto=backend == "cuda") and cuda_is_default()
    loaded = load_model(params.model, world, fuse=switch(params.fuse_projections, auto=backend == "cuda"),
                        fuse_quantized=fuses_quantized(params.fuse_projections, gemv or mma),
                        fuse_norms=params.fuse_norms == "always",
                        fuse_blocks=switch(params.fuse_blocks, auto=backend == "cuda"),
                        blocks_ops_rows=None if params.fuse_blocks_ops_rows == "auto" else params.fuse_blocks_ops_rows,
                        block_kernel=switch(params.block_kernel, auto=backend == "cuda"),
                        dense_mma=switch(params.dense_mma, auto=backend == "cuda") and cuda_is_default(),
                        ahead=ahead)
    clock.mark("load_s")
    wired = wiring.wire(loaded.weights, params.wire_weights)
    clock.mark("wire_s")
    # (the seconds before, the interpreter's start and imports: Engine.startup's import_s)
    startup = {**clock.phases, **loaded.phases}
    on_cpu = backend == "cpu"
    auto_rows = KERNEL_ROWS["mma" if mma else "gemv"] if gemv or mma else AUTO_ROWS.get(backend)
    rows = {"auto": auto_rows, "never": None}.get(params.dequantize_rows, params.dequantize_rows)
    # "auto" dequantizes only where that gives MLX's quantized matmul's sums (AUTO_DTYPES);
    # a number of rows is taken for every dtype, as asked
    dtypes = AUTO_DTYPES.get(backend) if params.dequantize_rows == "auto" and rows is not None else None
    split = mma and params.quantized_mma_weights == "split"
    routed = route_quantized_layers(loaded.model, rows, gemv, mma, split, dtypes)
    quantized = {"dequantize_rows": rows, "dequantize_dtypes": list(dtypes) if dtypes is not None else None,
                 "routed_layers": routed, "gemv": gemv, "mma": mma,
                 "mma_weights": params.quantized_mma_weights if mma else None}
    kernels = params.cpu_kernels and on_cpu
    if kernels:  # their PyTorch before ready, not in the first request (the command
        clock.restart()  # line keeps it out of transformers' import: platform.imports)
        import torch  # noqa: F401
        clock.mark("torch_s")
        startup["torch_s"] = clock.phases["torch_s"]
    # a pipeline rank evaluates inside each forward (sharding.PipelineBlock): no trace
    pipelined = world is not None and world.mode == "pipeline"
    compile_decode = switch(params.compile_decode, auto=not on_cpu) and not pipelined
    paged = switch(params.paged_attention, auto=backend == "cuda")
    one_row = switch(params.compile_one_row, auto=backend == "cuda")
    prefill_rows = params.prefill_rows
    if prefill_rows == "auto":
        from unikern.stages.execute.blocks import fused_rows

        prefill_rows = fused_rows(loaded.model) if paged and loaded.decode_blocks else 0
    # (the CPU kernels evaluate mid-forward, which a trace cannot: the runner checks too)
    compile_prefill = traces_prefill(params.compile_prefill, compile_decode, loaded.model) and not pipelined and not kernels
    fuse_elementwise = fuses_elementwise(params.fuse_elementwise, backend)
    if compile_decode or compile_prefill:  # before any trace: MLX fixes a trace's fusion when it makes it
        set_fusion(fuse_elementwise)
    warmup = None
    if switch(params.warmup, auto=not on_cpu):
        warmup = warm_up(loaded.model, loaded.geometry, kernels, compile_decode, paged, one_row, prefill_rows,
                         compile_prefill)
        startup["warmup_s"] = warmup["seconds"]
    return Prepared(loaded, wired, kernels, compile_decode, warmup, quantized, paged, one_row, startup, prefill_rows,
                    compile_prefill, cudnn, fuse_elementwise)


def pool_spec(pool: KVPool) -> MakeRunner:
    return MakeRunner(pool.block_size, pool.kernel_block_size, pool.num_blocks, pool.slab_blocks, pool.eager,
                      pool.fill_value)


def pool_like(spec: MakeRunner, loaded: LoadedModel) -> KVPool:
    """A follower's pool: rank 0's sizes (the same block ids everywhere), this rank's geometry."""
    g = loaded.geometry
    return KVPool(num_layers=g.num_layers, num_kv_heads=g.num_kv_heads, head_dim=g.head_dim, dtype=g.dtype,
                  block_size=spec.block_size, kernel_block_size=spec.kernel_block_size, num_blocks=spec.num_blocks,
                  slab_blocks=spec.slab_blocks, eager=spec.eager, fill_value=spec.fill_value)


def make_runner(prepared: Prepared, pool: KVPool, window_pool: KVPool | None = None,
                states: Any = None) -> ModelRunner:
    return ModelRunner(prepared.loaded.model, pool, shared_bridge(), prepared.kernels, prepared.compile_decode,
                       prepared.loaded.geometry, window_pool, states, prepared.paged_attention, prepared.compile_one_row,
                       prepared.prefill_rows, prepared.compile_prefill)


def local_stats(world: World, pool: KVPool | None) -> dict[str, Any]:
    """This rank's figures for `stats.kv.ranks`."""
    row: dict[str, Any] = {"rank": world.rank, "pid": os.getpid(), "host": socket.gethostname(),
                           "rss_bytes": psutil.Process().memory_info().rss}
    if pool is not None:
        row.update(num_layers=pool.num_layers, num_kv_heads=pool.num_kv_heads, pool_blocks=pool.num_blocks,
                   blocks_allocated=pool.committed_blocks(), resident_bytes=pool.resident_bytes)
    return row


class RankZero:
    """Rank 0's side of a world of several ranks. `execute`, `report` and `release` run on
    the model thread; `watch` on the event loop."""

    def __init__(self, world: World, runner: ModelRunner) -> None:
        self.world = world
        self.runner = runner
        self._last_report = 0.0
        runner.pool.on_release = self._release

    def execute(self, step: m.Step, seeds: dict[str, int]) -> m.StepDone:
        self.world.send(RunStep(for_the_wire(step), seeds))
        done = self.runner.execute(step, seeds)
        if time.monotonic() - self._last_report >= REPORT_EVERY_S:
            self.report()
        return done

    def report(self) -> None:
        self.world.send(Report())
        self.world.ranks = self.world.gather(local_stats(self.world, self.runner.pool))
        self._last_report = time.monotonic()

    def _release(self, keep: list[int]) -> None:
        self.world.send(Release(keep))
        self._last_report = 0.0  # the pools changed: gather again after the next step


async def watch_world(world: World) -> str:
    """Rank 0, on the event loop: return why the world broke, once a rank this process
    started has exited."""
    while True:
        why = world.lost()
        if why is not None:
            return why
        await anyio.sleep(WATCH_EVERY_S)
