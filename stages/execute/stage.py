"""mlx_execute: loads the model with mlx-lm and runs each step on its own thread."""

from __future__ import annotations

import hashlib
import sys
from typing import Any, Literal

import anyio
import msgspec
import structlog

from unikern import messages as m
from unikern.platform import heap
from unikern.platform.fusion import set_fusion
from unikern.platform.pinning import WeightWiring
from unikern.stage import StageBase, StageContext, StageParams, serve_inbox
from unikern.stages.execute.blocks import fused_steps
from unikern.stages.execute.distributed import Init, RankLost
from unikern.stages.execute.fused import fallback_calls
from unikern.stages.execute.launch import connect, start_world
from unikern.stages.execute.ranks import (
    RankZero,
    make_runner,
    pool_spec,
    prepare_model,
    watch_world,
)
from unikern.stages.execute.residual import handed_counts
from unikern.stages.execute.streaming import WindowStream, serve_in_order
from unikern.stages.execute.thread import ModelThread
from unikern.stages.models import DEFAULT_MODEL

log = structlog.get_logger("unikern")

# execute.gil_switch_ms "auto" on CUDA (see the parameter)
AUTO_GIL_SWITCH_MS = 0.5

STOP_WAIT_S = 15.0  # at shutdown, how long the other ranks get to stop
LOST_WAIT_S = 3.0  # after a rank was lost, how long the model thread gets to come back


class MLXExecuteParams(StageParams, frozen=True):
    model: str = DEFAULT_MODEL
    """The model to load: a directory in MLX layout, a hub repo id (fetched by mlx-lm, which needs the
    network), or `default`, the small model shipped with unikern."""
    seed: int = 0
    """Sampling seed for requests that give none; each request still draws from a stream of its own
    (this seed mixed with its request id)."""
    wire_weights: bool = True
    """Keep the weights resident: mlock on Linux, MLX's wired limit on Metal (nothing to do on CUDA,
    where the weights live in device memory)."""
    cpu_kernels: bool = True
    """On MLX's CPU backend, float32 models: SwiGLU and the attention softmax run in PyTorch, in place
    on MLX's buffers (stages/execute/cpu_kernels.py). Ignored on other backends and dtypes."""
    compile_decode: Literal["auto", "always", "never"] = "auto"
    """Trace a decode window's step once per shape with `mx.compile` and replay it. `auto`: on a GPU
    backend only (on the CPU backend MLX builds compiled kernels with the system C++ compiler at first
    use, and `cpu_kernels` cannot be traced); `always` needs that compiler on CPU."""
    warmup: Literal["auto", "always", "never"] = "auto"
    """Before reporting ready, run prefills and decode windows of every row bucket traffic meets on a
    private pool (stages/execute/warmup.py), so MLX builds its kernels and traces its steps at start
    instead of in the first requests (on an H200, 1B bf16: about 32 s of a warm start, 59 s cold;
    tools/bench/first_request.py). `auto`: on a GPU backend only."""
    dequantize_rows: int | Literal["auto", "never"] = "auto"
    """Quantized weights: steps of at least this many rows (>= 1) dequantize each layer's weights and
    run a plain matmul, as MLX's CPU and CUDA quantized kernels cost about a row's time per row.
    `auto`: on CPU 8, for float32 activations only (MLX's CPU kernel sums bfloat16 and float16 rows
    in their own dtype, which no matmul reproduces, so those keep it and mlx-lm's tokens); off on
    Metal; on CUDA 65 with `quantized_mma`, 17 with only `quantized_gemv`, else 8; `never`: off.
    A number applies to every dtype and may change bfloat16 tokens on CPU."""
    quantized_gemv: Literal["auto", "always", "never"] = "auto"
    """4-bit affine weights, steps of fewer rows than `dequantize_rows`: unikern's GEMV kernel instead of
    MLX's quantized matmul (stages/execute/quantized.py). CUDA only: `auto` = on CUDA, `always` elsewhere
    is refused at start. On an H200 (8B 4-bit) it took one request 138 -> 177 tok/s (tools/bench/bench_gpu.py)."""
    quantized_mma: Literal["auto", "always", "never"] = "auto"
    """4-bit affine weights, steps of more than 8 rows with bfloat16 activations: unikern's tensor-core
    kernel (weights dequantized in registers). CUDA only, as `quantized_gemv`. On an H200 (8B 4-bit)
    16 requests went 928 -> 1,705 tok/s and 64 requests 2,633 -> 3,537 (tools/bench/bench_gpu.py)."""
    quantized_mma_weights: Literal["bfloat16", "split"] = "bfloat16"
    """The tensor-core kernel's weights: `bfloat16` rounds each dequantized weight to bf16 (as the
    dequantized path does); `split` runs two bf16 halves through two MMAs, as exact as float32. On an
    H200 `split` cost 5% of a 64-row 8B step and came no nearer mlx-lm's tokens (tools/probe/probe_cuda.py,
    tools/check/parity_check.py)."""
    fuse_projections: Literal["auto", "always", "never"] = "auto"
    """Multiply each attention's q/k/v and each MLP's gate/up projections through one concatenated
    weight (stages/execute/fused.py). `auto`: on CUDA, for unquantized layers and the quantized ones
    unikern's 4-bit kernels run; `always`: every quantized layer too. On an H200 (1B) a one-row token's
    GEMV time went 970 -> 624 us (tools/probe/probe_cuda.py)."""
    fuse_norms: Literal["always", "never"] = "never"
    """Run each pre-norm block's residual adds with the RMS norms that read their sums, one CUDA kernel
    for both (stages/execute/residual.py; llama, qwen2, qwen3, phi3; one rank). Off: on an H200 (1B) a
    token took 1.31 ms of GPU time with it against 1.18 without (tools/probe/probe_cuda.py)."""
    fuse_blocks: Literal["auto", "always", "never"] = "auto"
    """Run a decoder block's decode steps of up to 4 rows as four GEMV kernels with RoPE, SwiGLU and
    the residual adds inside them (stages/execute/blocks.py; llama and qwen2, unquantized, with
    `fuse_projections`, one rank); MLX's own ops off CUDA. `auto`: on CUDA, where on an H200 (1B) it ran
    4 requests 1.40x faster, 12 of 12 repeats (tools/bench/bench_ab.py)."""
    fuse_blocks_ops_rows: int | Literal["auto"] = "auto"
    """With `fuse_blocks`, decode steps of more rows than its kernels take (4), up to this many (>= 0),
    run the block through MLX's ops with fewer graph nodes than the model family's code (4-bit blocks:
    every step up to it). `auto`: 64 for unquantized blocks, 4 for 4-bit ones; 0: off. On an H200 (1B)
    a 64-row step took 1.63 ms against the family code's 3.30 (tools/probe/probe_cuda.py)."""
    block_kernel: Literal["auto", "always", "never"] = "auto"
    """With `fuse_blocks`' kernels, a block's one-row decode step as a single kernel whose phases meet at
    grid-wide barriers (stages/execute/cuda/block_kernel.py). `auto`: on CUDA, where on an H200 (1B) the
    engine at one request gave 769 against 455 tok/s (tools/bench/bench_ab.py)."""
    dense_mma: Literal["auto", "always", "never"] = "never"
    """Plain bfloat16 linear layers, steps of 5 to 64 rows: unikern's tensor-core kernel instead of MLX's
    cuBLASLt matmul (stages/execute/dense_mma.py). CUDA only (`auto` = on CUDA). Off: on an H200 (1B) a
    64-row step took 3.04 ms of GPU time against 2.57, no host time saved (tools/probe/probe_cuda.py)."""
    paged_attention: Literal["auto", "always", "never"] = "auto"
    """Decode attention of full-attention layers reads keys and values straight from the pool by each
    row's slot table (stages/execute/cuda/paged_attention.py): a CUDA kernel on CUDA, MLX's ops elsewhere.
    `auto`: on CUDA, where on an H200 (1B) 64 requests went 10,093 -> 16,891 tok/s (tools/bench/bench_gpu.py)."""
    cudnn_attention: bool = False
    """Prompt attention through MLX's cuDNN SDPA (CUDA) rather than MLX's own kernels. cuDNN builds a
    graph per new (rows, query length, key length), and a server meets a new one with nearly every
    prompt: on an H200 (1B) a first call took 39-68 ms against MLX's own 1-12 ms (later calls 0.1-0.3
    ms against 0.2-0.9), and with it on a shared 1,000-token system prompt's requests waited 109 ms
    (TTFT p50, one stream) against 40 off (tools/probe/probe_load_paths.py sdpa, tools/bench/bench_http.py).
    Sets MLX_CUDA_USE_CUDNN_SDPA, which MLX reads once, at the process's first attention; a value
    already in the environment wins."""
    fuse_elementwise: Literal["auto", "always", "never"] = "auto"
    """Let MLX fuse each traced step's chains of element-wise ops into kernels of their own
    (unikern.platform.fusion). On CUDA MLX compiles each with NVRTC the first time a machine meets it,
    one after another: on an H200 (1B) a fresh start took 40.0 s with them (four fused kernels) and
    14.8 s without, the same machine. `auto`: off on CUDA, on elsewhere. Off, the library ran no slower
    beyond the A/B's own bias (off/on 0.93x-1.19x, an earlier commit; tools/bench/bench_ab.py), and
    greedy parity's one bf16 mismatch (a 300-token prompt's first token, margin 0.031) shows with it
    on and off alike.
    Set for the whole process, before the warm-up; the stage restores MLX's default at stop."""
    compile_one_row: Literal["auto", "always", "never"] = "auto"
    """With `paged_attention`, one-row decode windows are traced (`mx.compile`) too, as windows of
    several rows are. `auto`: on CUDA."""
    prefill_rows: int | Literal["auto"] = 0
    """With `paged_attention`, prompts of up to this many tokens (a prefill group's in all; >= 0) run as
    one decode step of a row per token through `fuse_blocks`' paths. `auto`: the rows the fused blocks
    take (64 unquantized) where both run; 0: off. Off: on an H200 (1B) the first token came no sooner
    and parity had 2 one-ulp mismatches (tools/probe/probe_prefill.py, tools/check/parity_check.py)."""
    compile_prefill: Literal["auto", "always", "never"] = "auto"
    """Run forwards of fresh prompts (every row at position 0, up to 512 tokens, padded to a length
    bucket) through one `mx.compile`d function per shape. `auto`: where `compile_decode` is on,
    `cpu_kernels` off and the model has no quantized layers. On an H200 (1B) 64 requests went 21,769 ->
    24,163 tok/s (tools/bench/bench_ab.py)."""
    stream_interval_ms: float | None = 50.0
    """While a decode window runs (schedule.decode_lookahead), hand its tokens so far on this often (ms,
    >= 0; 0: after each step) rather than all at the window's end (null), so that a stream's tokens
    come steadily (stages/execute/streaming.py). One rank only; a window with log-probabilities sends
    them all at its end."""
    gil_switch_ms: float | Literal["auto"] | None = "auto"
    """Python's GIL switch interval while the stage runs, in ms (> 0; the process's setting, restored at
    stop): how long the model thread can wait for the GIL. `auto`: 0.5 on CUDA, Python's own elsewhere;
    null: Python's own (5 ms). On an H200 (1B) 64 requests took 161 ms at 0.5 against 247 at 5
    (tools/probe/step_gaps.py)."""
    freeze_heap: bool = True
    """Once every stage has started, move the objects alive then out of Python's garbage collections
    (gc.freeze) until the last engine that froze stops: on the CPU machine one full collection took
    171-187 ms inside 60-70 ms runs (tools/probe/host_bound.py)."""
    tensor_parallel: int = 1
    """Ranks (>= 1) splitting each layer's attention heads and MLP columns through mx.distributed; rank 0
    runs the whole pipeline. One of `tensor_parallel` and `pipeline_parallel` may exceed 1."""
    pipeline_parallel: int = 1
    """Ranks (>= 1) each holding a contiguous share of the layers; one of the two at a time."""
    distributed_backend: Literal["auto", "ring", "nccl", "mpi", "jaccl"] = "auto"
    """mx.distributed's backend for several ranks. `auto`: `ring` with a `hostfile`, else `nccl` on a
    CUDA GPU and `ring` elsewhere."""
    hostfile: str | None = None
    """Ranks on several machines: MLX's hostfile (for ring, a JSON list of ["ip:port"] per rank, rank 0
    first), the other ranks started with MLX_RANK=k; null: the other ranks are started here, on loopback."""

    def validate(self) -> list[str]:
        problems = []
        if isinstance(self.dequantize_rows, int) and self.dequantize_rows < 1:
            problems.append(f"dequantize_rows: must be >= 1, \"auto\" or \"never\", got {self.dequantize_rows}")
        if isinstance(self.fuse_blocks_ops_rows, int) and self.fuse_blocks_ops_rows < 0:
            problems.append(f"fuse_blocks_ops_rows: must be >= 0 (0: off) or \"auto\", got {self.fuse_blocks_ops_rows}")
        if self.stream_interval_ms is not None and not self.stream_interval_ms >= 0:
            problems.append(f"stream_interval_ms: must be >= 0 (ms; 0: after each step) or unset for a "
                            f"window's tokens at its end, got {self.stream_interval_ms}")
        if self.gil_switch_ms not in (None, "auto") and not self.gil_switch_ms > 0:
            problems.append(f"gil_switch_ms: must be > 0 (ms), \"auto\" or unset for Python's own 5 ms, "
                            f"got {self.gil_switch_ms}")
        if self.tensor_parallel < 1 or self.pipeline_parallel < 1:
            problems.append("tensor_parallel: tensor_parallel and pipeline_parallel must be >= 1")
        elif self.tensor_parallel > 1 and self.pipeline_parallel > 1:
            problems.append(
                f"tensor_parallel: {self.tensor_parallel} with pipeline_parallel {self.pipeline_parallel}: "
                f"one of the two at a time (set the other to 1)"
            )
        return problems

    @property
    def world_size(self) -> int:
        return self.tensor_parallel * self.pipeline_parallel


class MLXExecuteStage(StageBase):
    Params = MLXExecuteParams
    consumes = (m.Step,)
    produces = (m.StepDone, m.WindowTokens)
    provides = ("model",)
    uses = ("kv",)  # the pool, whose service starts after the model exists
    fuse_elementwise = True  # as prepare_model set it for the process (execute.fuse_elementwise)
    stream: WindowStream | None = None  # decode windows' tokens while they run (execute.stream_interval_ms)

    async def run(self, ctx: StageContext, *, task_status) -> None:
        p = self.params
        thread = ModelThread()
        wiring = WeightWiring()
        world = None
        switch = sys.getswitchinterval()
        froze = False
        switch_ms = gil_switch_ms(p.gil_switch_ms)
        if switch_ms is not None:
            sys.setswitchinterval(switch_ms / 1e3)
        try:
            if p.world_size > 1:
                mode = "tensor" if p.tensor_parallel > 1 else "pipeline"
                world = await thread.run(start_world, p.world_size, mode, p.distributed_backend, p.hostfile)
                self.world = world
                await self._on_ranks(thread, world, connect, world)
                await self._on_ranks(thread, world, world.send, Init(msgspec.to_builtins(p)))
            prepared = await self._on_ranks(thread, world, prepare_model, p, world, wiring)
            loaded = prepared.loaded
            loaded.thread = thread
            self.loaded, self.wired = loaded, prepared.wired
            self.quantized = prepared.quantized
            self.cudnn_attention = prepared.cudnn_attention
            self.fuse_elementwise = prepared.fuse_elementwise
            self.startup = prepared.startup
            if prepared.warmup is not None:
                self.warmup = prepared.warmup
                log.info("execute.warmed_up", **self.warmup)
            ctx.provide("model", loaded)
            task_status.started()

            await ctx.all_started()
            kv = ctx.resource("kv")
            if world is not None:
                await self._on_ranks(thread, world, world.send, pool_spec(kv.pool))
            runner = await self._on_ranks(thread, world, make_runner, prepared, kv.pool, kv.window_pool, kv.states)
            self.runner = runner
            rank_zero = None
            if world is not None:
                self.rank_zero = rank_zero = RankZero(world, runner)
                await self._on_ranks(thread, world, rank_zero.report)
            salt = p.seed
            if p.freeze_heap:
                heap.freeze()
                froze = True

            def seeds_of(step: m.Step) -> dict[str, int]:
                return {
                    w.request_id: w.params.seed if w.params.seed is not None else _seed_for(salt, w.request_id)
                    for w in step.work
                    if w.sample and w.params.temperature > 0
                }

            # a request's own failure (processor, grammar) comes back in StepDone.failed;
            # an exception here is the stage's and fails every request. The runner's
            # execute is looked up per step: a test may wrap it
            async def handle(step: m.Step) -> None:
                execute = rank_zero.execute if rank_zero is not None else runner.execute
                await ctx.send(await thread.run(execute, step, seeds_of(step)))

            if world is None:
                if p.stream_interval_ms is not None:
                    self.stream = runner.window_stream = WindowStream(p.stream_interval_ms / 1e3)
                await serve_in_order(ctx, thread, lambda step: (runner.execute, step, seeds_of(step)),
                                     self.stream)
            else:
                await self._serve_world(ctx, handle, world)
        finally:
            if switch_ms is not None:
                sys.setswitchinterval(switch)
            if not self.fuse_elementwise:  # the process's setting: MLX's default again
                set_fusion(True)
            if froze:
                heap.thaw()
            wiring.unwire()
            if world is not None and await self._stop_world(thread, world):
                await thread.aclose()
            elif world is None:
                await thread.aclose()

    async def _on_ranks(self, thread: ModelThread, world, fn, *args):
        """thread.run(fn, *args); with several ranks, while the ranks this process started
        are watched (a collective waits forever on a rank that never comes), and with a
        failure that a lost rank explains naming it."""
        if world is None:
            return await thread.run(fn, *args)
        result: list = []
        failure: list[BaseException] = []
        async with anyio.create_task_group() as tg:

            async def call() -> None:
                try:
                    result.append(await thread.run(fn, *args))
                except Exception as exc:
                    failure.append(await anyio.to_thread.run_sync(world.explain, exc))
                tg.cancel_scope.cancel()

            async def watch() -> None:
                failure.append(RankLost(await watch_world(world)))
                tg.cancel_scope.cancel()

            tg.start_soon(call)
            tg.start_soon(watch)
        if failure:
            world.stopping = True
            raise failure[0]
        return result[0]

    async def _serve_world(self, ctx: StageContext, handle, world) -> None:
        """serve_inbox, while the ranks this process started are watched: a rank that exits,
        or a collective that fails, ends the stage with an error naming the rank."""
        failure: list[BaseException] = []
        async with anyio.create_task_group() as tg:

            async def watch() -> None:
                failure.append(RankLost(await watch_world(world)))
                tg.cancel_scope.cancel()

            tg.start_soon(watch)
            try:
                await serve_inbox(ctx, handle)
            except Exception as exc:
                failure.append(await anyio.to_thread.run_sync(world.explain, exc))
            tg.cancel_scope.cancel()
        if failure:
            world.stopping = True
            raise failure[0]

    async def _stop_world(self, thread: ModelThread, world) -> bool:
        """Stop the other ranks; True once the model thread is free (it may be stuck in a
        collective whose peer is gone, where only ending the process frees it)."""
        with anyio.CancelScope(shield=True):
            lost = world.lost_any() or world.stopping
            if lost:
                await anyio.to_thread.run_sync(world.kill)
            with anyio.move_on_after(LOST_WAIT_S if lost else STOP_WAIT_S):
                await thread.run(world.stop)
                return True
        log.error("execute.model_thread_stuck",
                  hint="a collective is still waiting on a lost rank; the process must exit")
        return False

    def stats(self) -> dict[str, Any]:
        loaded = getattr(self, "loaded", None)
        if loaded is None:
            return {}
        runner = getattr(self, "runner", None)
        compiled = runner.compiled if runner else None
        traced = runner.compiled_prefill if runner else None
        return {
            "model": {"name": loaded.name, "weights_bytes": loaded.weights_bytes,
                      "quantized": self.quantized,  # set with self.loaded
                      "cudnn_attention": self.cudnn_attention,
                      "fuse_elementwise": self.fuse_elementwise,
                      "startup": self.startup or {},
                      "fused_projections": {"groups": loaded.fused_groups,
                                            "fallback_calls": fallback_calls(loaded.model) if loaded.fused_groups else 0},
                      "fused_norms": {"blocks": loaded.norm_blocks,
                                      **handed_counts(loaded.model if loaded.norm_blocks else None)},
                      "decode_blocks": {"blocks": loaded.decode_blocks,
                                        "steps": fused_steps(loaded.model) if loaded.decode_blocks else 0,
                                        "ops_steps": fused_steps(loaded.model, "ops_steps"),
                                        "pool_steps": fused_steps(loaded.model, "pool_steps"),
                                        "kernel_steps": fused_steps(loaded.model, "kernel_steps")},
                      "dense_mma": {"layers": loaded.dense_mma_layers},
                      "kernel_embeddings": loaded.kernel_embeddings, "split_ropes": loaded.split_ropes,
                      "pitched_experts": loaded.pitched_experts},
            "memory": {"wired_bytes": self.wired.wired_bytes, "wired_reason": self.wired.reason},
            "kernels": runner.kernels if runner else {"enabled": False, "reason": "no step run yet"},
            "paged_attention": {**runner.paged_report, "one_row_compiled": runner.compile_one_row,
                                "prefill_rows": runner.prefill_rows, "row_prefills": runner.row_prefills}
            if runner else {"enabled": False, "reason": "no step run yet"},
            "compiled_decode": {
                "enabled": compiled is not None,
                "traces": compiled.traces if compiled else 0,
                "cache_resets": compiled.resets if compiled else 0,
                "trace_s": round(compiled.trace_s, 3) if compiled else 0.0,
                "shapes": dict(compiled.shapes) if compiled else {},
            },
            "compiled_prefill": {
                "enabled": traced is not None,
                "traces": traced.traces if traced else 0,
                "forwards": traced.forwards if traced else 0,
                "trace_s": round(traced.trace_s, 3) if traced else 0.0,
                "shapes": dict(traced.shapes) if traced else {},
            },
            "window_tokens": {"interval_ms": self.params.stream_interval_ms,
                              "sent": self.stream.sent if self.stream else 0},
            "warmup": getattr(self, "warmup", {"ran": False}),
            **self._world_stats(),
        }

    def _world_stats(self) -> dict[str, Any]:
        world = getattr(self, "world", None)
        if world is None:
            return {}
        return {"platform": {"world": world.describe()}, "kv": {"ranks": world.ranks}}


def gil_switch_ms(setting: float | str | None) -> float | None:
    """The switch interval the stage sets, in ms (None: leave Python's as it is)."""
    if setting == "auto":
        from unikern.platform import cuda_is_default

        return AUTO_GIL_SWITCH_MS if cuda_is_default() else None
    return setting


def _seed_for(salt: int, request_id: str) -> int:
    digest = hashlib.blake2b(f"{salt}:{request_id}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1
