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
from unikern.stages.execute.thread import ModelThread
from unikern.stages.models import DEFAULT_MODEL

log = structlog.get_logger("unikern")

# execute.gil_switch_ms "auto" on CUDA (see the parameter)
AUTO_GIL_SWITCH_MS = 0.5

STOP_WAIT_S = 15.0  # at shutdown, how long the other ranks get to stop
LOST_WAIT_S = 3.0  # after a rank was lost, how long the model thread gets to come back


class MLXExecuteParams(StageParams, frozen=True):
    model: str = DEFAULT_MODEL
    # seed for requests that give none (each request still gets its own stream)
    seed: int = 0
    # keep the weights resident: mlock on Linux, the wired limit on Metal
    wire_weights: bool = True
    # on MLX's CPU backend, run SwiGLU and the attention softmax in PyTorch, in place on
    # MLX's buffers (see stages/cpu_kernels.py); float32 models only; ignored elsewhere
    cpu_kernels: bool = True
    # trace each lookahead decode step once per shape with mx.compile and replay it
    # (compiled.CompiledDecode). "auto": on a GPU backend only, since the CPU backend
    # builds compiled kernels with the system C++ compiler at first use, and its CPU
    # kernels (above) cannot be traced; "always" (a C++ compiler needed on CPU); "never"
    compile_decode: Literal["auto", "always", "never"] = "auto"
    # before saying ready, run a prefill and decode windows on a private pool so MLX's
    # GPU kernels are built at start, not in the first requests (runner.warm_up);
    # "auto": on a GPU backend only
    warmup: Literal["auto", "always", "never"] = "auto"
    # quantized weights: steps of at least this many rows dequantize each layer's weights
    # and run a plain matmul, since MLX's CPU and CUDA quantized kernels cost a row's time
    # per row (quantized.AUTO_ROWS); "auto": 8 on CPU, off on Metal; on CUDA 17 with the
    # GEMV below, 65 with the tensor-core kernel (quantized.KERNEL_ROWS)
    dequantize_rows: int | Literal["auto", "never"] = "auto"
    # 4-bit affine weights, steps of fewer rows than dequantize_rows: unikern's GEMV kernel
    # (quantized.py: each weight word read and dequantized once for up to 16 rows, one
    # pass per 16) instead of MLX's quantized matmul; CUDA only, "auto" = on CUDA, where it
    # was measured (8B shape on an H200, against MLX's kernel and dequantized weights from
    # 8 rows: one request 138 -> 177 tok/s; 16 requests 728 -> 894 with it below 65 rows;
    # tools/results/gpu/session8/a-gemv)
    quantized_gemv: Literal["auto", "always", "never"] = "auto"
    # and steps of more than 8 rows (bfloat16 activations) through unikern's tensor-core
    # kernel (quantized.py: mma.sync on weights dequantized in registers, 64 rows per
    # pass); CUDA only, "auto" = on CUDA, where it was measured (8B shape on an H200,
    # against the GEMV to 16 rows and dequantized weights above, two rounds: 16 requests
    # 928 / 906 -> 1,705 / 1,691 tok/s, 64 requests 2,633 / 2,617 -> 3,537 / 3,596;
    # tools/results/gpu/session8/b-mma)
    quantized_mma: Literal["auto", "always", "never"] = "auto"
    # the tensor-core kernel's weights: "bfloat16" (each dequantized weight rounded to
    # bf16, as the dequantized-weights path does) or "split" (two bf16 halves through two
    # MMAs: as exact as the float32 weights of MLX's one-row kernel). On an H200 the split
    # cost 5% of a 64-row step of the 8B 4-bit shape and did not bring its greedy tokens
    # nearer mlx-lm's (9 mismatches of 16 either way: tools/results/gpu/session9/a-kernels)
    quantized_mma_weights: Literal["bfloat16", "split"] = "bfloat16"
    # multiply each attention's q/k/v and each MLP's gate/up projections through one
    # concatenated weight (stages/execute/fused.py): fewer, wider matmuls. "auto": on
    # CUDA, unquantized layers, where it was measured (a one-row step's GEMV time 970 ->
    # 624 us at the 1B shape; 16 and 64 requests 9-18% faster), and quantized layers
    # where unikern's 4-bit kernels run them (ranks.fuses_quantized); "always": quantized
    # layers too whatever multiplies them
    fuse_projections: Literal["auto", "always", "never"] = "auto"
    # each pre-norm block's residual adds run with the RMS norms that read their sums, one
    # kernel for both on CUDA (stages/execute/residual.py; llama, qwen2, qwen3 and phi3
    # blocks, one rank): 32 fewer kernels per token of the 1B shape. On an H200 its first
    # version was slower (its one output read back as two gathers:
    # tools/results/gpu/session11/a-next); the version with two outputs is not measured,
    # so "never" by default; "always" turns it on
    fuse_norms: Literal["always", "never"] = "never"
    # a decoder block's decode steps of up to 4 rows as four GEMV kernels with RoPE,
    # SwiGLU and the residual adds inside them and MLX's RMS norm kernels before two of
    # them, 9 kernels per block instead of 14 (stages/execute/blocks.py; llama and qwen2
    # blocks, unquantized, with fuse_projections, one rank); MLX's own ops off CUDA. On an
    # H200 (1B shape, one row) a token's GPU time went 1.182 -> 1.089 ms and its kernels
    # 242 -> 166, but its wall time, one process each, 1.430 -> 1.617 ms
    # (tools/results/gpu/session13/b-blocks); in the engine, one-process A/B (session
    # 14): 1.04x / 0.92x / 1.02x at 1 / 16 / 64 requests (above 4 rows it does not run:
    # those two are the A/B's noise). Session 15 (session15/a-probes): 4 requests 1.40x,
    # 12 of 12 repeats won, one request 0.93x, 5 of 12; the runner's one-row token
    # 2.34 / 2.47 -> 1.86 / 2.43 ms in two rounds of processes, the host's part of it
    # (the traced replay and mx.async_eval) 2.26 -> 1.81 ms. So "auto" (CUDA) by default
    fuse_blocks: Literal["auto", "always", "never"] = "auto"
    # with fuse_blocks, decode steps of more rows than its kernels take (4), up to this
    # many, run the same block through MLX's ops instead of the family's code (4-bit
    # blocks, which the kernels do not take: every step of up to this many rows): 2-D
    # matmuls through the weights' transposed views made once, q and k rotated and written
    # into the pool by one kernel (blocks.OPS_ROPE_WRITE), no layout round trips: fewer
    # graph nodes for MLX to encode each step (a 1B 64-row step: 261 primitives against
    # the family's 629). On an H200 (tools/results/gpu/session19) a 1B 64-row step took
    # 1.63 / 1.80 ms in two rounds against the family's 3.30 / 2.17, the same tokens, and the
    # three engines gave 0.91x and 0.89x llama.cpp at 64 requests (session 16: 0.64x).
    # "auto": 64 for unquantized blocks; 4-bit blocks keep the kernels' 4 (not measured
    # there above 4 rows); 0: the kernels' rows only
    fuse_blocks_ops_rows: int | Literal["auto"] = "auto"
    # with fuse_blocks' kernels, a one-row decode step of each block as one kernel whose
    # five phases meet at grid-wide barriers (stages/execute/block_kernel.py): a 1B token
    # 34 kernels instead of 99 for MLX to encode, where the host paced the token. On an
    # H200 (tools/results/gpu/session21/a-one-kernel) the runner's token took 1.13 / 1.15 ms
    # against 1.34 / 1.33 in two rounds, the same tokens (GPU 1.07 against 0.97-0.99 ms),
    # and the engine at one request 769 against 455 tok/s (one-process A/B, 6 of 6
    # repeats). So "auto" (CUDA) by default
    block_kernel: Literal["auto", "always", "never"] = "auto"
    # plain bfloat16 linear layers (the fused projections' among them), steps of 5 to 64
    # rows: unikern's tensor-core kernel (stages/execute/dense_mma.py) instead of MLX's
    # cuBLASLt matmul, whose encoding costs the host 13-17 us per call on an H200 against
    # 3-4 for a kernel of unikern's (tools/results/gpu/session15/c-ops); a decode step of
    # the 1B shape runs 65. CUDA only ("always" without CUDA is refused at start); not
    # measured in the engine yet, so "never" by default ("auto": on CUDA)
    dense_mma: Literal["auto", "always", "never"] = "never"
    # decode steps of full-attention layers read keys and values straight from the pool
    # by each row's slot table and length (stages/execute/paged_attention.py): one CUDA
    # kernel per layer instead of a gathered copy and a masked SDPA; elsewhere MLX's own
    # ops (tests). "auto" = on CUDA, where it was measured (1B shape on an H200, against
    # the gathered path in one run: 64 requests 10,093 -> 16,891 tok/s, 16 requests
    # 3,457 -> 4,943; tools/results/gpu/H200-issue17.md)
    paged_attention: Literal["auto", "always", "never"] = "auto"
    # with paged_attention (no mask), one-row decode windows are traced steps too, as
    # windows of several rows are (compile_decode); "auto": on CUDA only
    compile_one_row: Literal["auto", "always", "never"] = "auto"
    # with paged_attention, prompts of up to this many tokens (a prefill group's in all)
    # run as one decode step of a row per token, each row reading the table up to itself,
    # through fuse_blocks' decode paths instead of the family's prefill code ("auto": the
    # rows the fused blocks take, 64 for unquantized ones, where paged attention and
    # fuse_blocks run; 0: off). On an H200 (tools/results/gpu/session22) the family's
    # 64-token 1B prefill was 262 kernels and 5.1 / 6.2 ms in two processes (1.4 on the
    # GPU), by rows 217 and 4.7 ms in a third; the engine's first token at one request
    # was no sooner (10 ms), and parity with it on gave 2 one-ulp mismatches (margins
    # 0.031) where the defaults had 0. So 0 (off) by default
    prefill_rows: int | Literal["auto"] = 0
    # forwards of fresh prompts (every row at position 0, up to 512 tokens in all, padded
    # to a length bucket) through one mx.compile'd function per (rows, bucket), replayed
    # instead of built op by op in Python (compiled.CompiledPrefill): on an H200 the
    # 64-token 1B prefill's Python build was 1.5-2.4 ms of a 5-8 ms step in the engine
    # (tools/results/gpu/session23). In the engine on an H200, 1B, one-process A/B against
    # op by op: faster at 1 / 16 / 64 requests in 6 / 4 / 5 of 6 repeats, medians 956 /
    # 7,718 / 24,163 against 932 / 6,440 / 21,769 tok/s (session24/b-stage/ab-1b-cp.json).
    # "auto" (default): where compile_decode is on (a GPU), the CPU kernels are off and the
    # model has no quantized layers (not measured with them: ranks.traces_prefill)
    compile_prefill: Literal["auto", "always", "never"] = "auto"
    # Python's GIL switch interval in ms while the stage runs (sys.setswitchinterval; it
    # is the process's, the one before comes back at stop): the longest the model thread
    # waits for the GIL while the event loop detokenizes and delivers, each time it wants
    # it back (after each `mx.async_eval`) to build and launch a step. None: Python's own
    # (5 ms); "auto": AUTO_GIL_SWITCH_MS on CUDA, Python's own elsewhere. With
    # tools/host_bound.py's stand-in model (0.3 ms of Python, then 2.3 ms without the GIL
    # per step) 64 requests took 227-263 ms at 5 ms and 209-213 at 0.2, 16 and one
    # request the same (three interleaved rounds on the CPU machine:
    # tools/results/host-bound-switch/). With a real model on the CPU backend 0.2 was
    # slower (llama-5m, tools/bench_ab.py, 4 paired repeats: 0.88x / 0.94x / 0.97x at 1 /
    # 16 / 64 requests; tools/results/ab-llama-5m-cpu-switch.json). On an H200 (1B shape):
    # tools/bench_ab.py, 6 paired repeats in one process, 0.2 ms: 1.09x / 1.31x / 0.96x at
    # 1 / 16 / 64 requests (tools/results/gpu/session14/a-engines); tools/step_gaps.py, one
    # process per setting, 3 repeats (tools/results/gpu/session20): wall at 16 / 64
    # requests 205 / 247 ms at 5 ms against 131 / 161 at 0.5, 142 / 172 at 0.2, 153 / 189 at
    # 0.1, 131 / 146 at 0.05; the decode windows' `mx.async_eval` per step at 64 requests
    # 2.35 ms at 5 against 1.33-1.64. On a second machine start, at 5 ms, 64 requests took
    # 247 and 180 ms in two processes: the processes' spread is large. One request: 90-124
    # ms at the short intervals, 104-150 at 5
    gil_switch_ms: float | Literal["auto"] | None = "auto"
    # once every stage has started, freeze the objects alive then (gc.freeze, after a
    # collection of the young generations: the imports, the tokenizer, the model's
    # tree), so Python's oldest-generation collection no longer walks them while the
    # engine serves; they go back to the collector when the last engine that froze
    # stops (unikern.platform.heap). On the CPU machine one such collection took
    # 171-187 ms, inside runs of 60-70 ms (tools/results/host-bound-gc/)
    freeze_heap: bool = True
    # several ranks through mx.distributed (stages/execute/distributed.py): attention
    # heads and MLP columns split across ranks (mlx-lm's Model.shard), or the layers
    # split (pipeline); one of the two at a time. Rank 0 runs the whole pipeline.
    tensor_parallel: int = 1
    pipeline_parallel: int = 1
    # "auto": ring with a hostfile (its format is ring's), else nccl on a CUDA GPU, ring elsewhere
    distributed_backend: Literal["auto", "ring", "nccl", "mpi", "jaccl"] = "auto"
    # ranks on several machines: MLX's hostfile (ring: a JSON list of ["ip:port"] per
    # rank, rank 0 first), the other ranks started with MLX_RANK=k (mlx.launch or by
    # hand); none: the other ranks are started here, on loopback
    hostfile: str | None = None

    def validate(self) -> list[str]:
        problems = []
        if isinstance(self.dequantize_rows, int) and self.dequantize_rows < 1:
            problems.append(f"dequantize_rows: must be >= 1, \"auto\" or \"never\", got {self.dequantize_rows}")
        if isinstance(self.fuse_blocks_ops_rows, int) and self.fuse_blocks_ops_rows < 0:
            problems.append(f"fuse_blocks_ops_rows: must be >= 0 (0: off) or \"auto\", got {self.fuse_blocks_ops_rows}")
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
    produces = (m.StepDone,)
    provides = ("model",)
    uses = ("kv",)  # the pool, whose service starts after the model exists

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
                await serve_in_order(ctx, thread, lambda step: (runner.execute, step, seeds_of(step)))
            else:
                await self._serve_world(ctx, handle, world)
        finally:
            if switch_ms is not None:
                sys.setswitchinterval(switch)
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
                      "dense_mma": {"layers": loaded.dense_mma_layers}},
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
            "warmup": getattr(self, "warmup", {"ran": False}),
            **self._world_stats(),
        }

    def _world_stats(self) -> dict[str, Any]:
        world = getattr(self, "world", None)
        if world is None:
            return {}
        return {"platform": {"world": world.describe()}, "kv": {"ranks": world.ranks}}


async def serve_in_order(ctx: StageContext, thread: ModelThread, call) -> None:
    """Each Step goes to the model thread as it arrives, `call(step)` giving what to run;
    the StepDones go out in the steps' order. A step sent while the one before runs
    (schedule's overlap_windows) then starts the moment that one ends, without waiting
    for the event loop to take its StepDone."""
    try:
        async with anyio.create_task_group() as tg:
            previous: anyio.Event | None = None
            async for step in ctx.inbox:
                sent = anyio.Event()
                tg.start_soon(_deliver, ctx, thread, thread.submit(*call(step)), previous, sent)
                previous = sent
    except BaseExceptionGroup as group:  # the failed step's own error, as the stage's
        if len(group.exceptions) == 1:
            raise group.exceptions[0] from None
        raise


async def _deliver(ctx: StageContext, thread: ModelThread, future, previous: anyio.Event | None,
                   sent: anyio.Event) -> None:
    done = await thread.result(future)
    if previous is not None:
        await previous.wait()
    await ctx.send(done)
    sent.set()


def gil_switch_ms(setting: float | str | None) -> float | None:
    """The switch interval the stage sets, in ms (None: leave Python's as it is)."""
    if setting == "auto":
        from unikern.platform import cuda_is_default

        return AUTO_GIL_SWITCH_MS if cuda_is_default() else None
    return setting


def _seed_for(salt: int, request_id: str) -> int:
    digest = hashlib.blake2b(f"{salt}:{request_id}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1
