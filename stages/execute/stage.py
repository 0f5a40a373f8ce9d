"""mlx_execute: loads the model with mlx-lm and runs each step on its own thread."""

from __future__ import annotations

import hashlib
from typing import Any, Literal

import structlog

from unikern import messages as m
from unikern.platform import current_platform, shared_bridge
from unikern.platform.pinning import WeightWiring
from unikern.stage import StageBase, StageContext, StageParams, serve_inbox
from unikern.stages.execute.model import load_model
from unikern.stages.execute.quantized import AUTO_ROWS, route_quantized_layers
from unikern.stages.execute.runner import ModelRunner, warm_up
from unikern.stages.execute.thread import ModelThread
from unikern.stages.models import DEFAULT_MODEL

log = structlog.get_logger("unikern")


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
    # per row (quantized.AUTO_ROWS); "auto": 8 on CPU and CUDA, off on Metal
    dequantize_rows: int | Literal["auto", "never"] = "auto"

    def validate(self) -> list[str]:
        problems = super().validate()
        if isinstance(self.dequantize_rows, int) and self.dequantize_rows < 1:
            problems.append(f"dequantize_rows: must be >= 1, \"auto\" or \"never\", got {self.dequantize_rows}")
        return problems


class MLXExecuteStage(StageBase):
    Params = MLXExecuteParams
    consumes = (m.Step,)
    produces = (m.StepDone,)
    provides = ("model",)
    uses = ("kv",)  # the pool, whose service starts after the model exists

    async def run(self, ctx: StageContext, *, task_status) -> None:
        thread = ModelThread()
        wiring = WeightWiring()
        try:
            loaded = await thread.run(load_model, self.params.model)
            loaded.thread = thread
            self.loaded = loaded
            self.wired = await thread.run(wiring.wire, loaded.weights, self.params.wire_weights)
            backend = current_platform().backend
            on_cpu = backend == "cpu"
            rows = self.params.dequantize_rows
            rows = AUTO_ROWS.get(backend) if rows == "auto" else None if rows == "never" else rows
            self.quantized = {"dequantize_rows": rows,
                              "routed_layers": await thread.run(route_quantized_layers, loaded.model, rows)}
            kernels = self.params.cpu_kernels and on_cpu
            compile_decode = _switch(self.params.compile_decode, auto=not on_cpu)
            if _switch(self.params.warmup, auto=not on_cpu):
                self.warmup = await thread.run(warm_up, loaded.model, loaded.geometry, kernels, compile_decode)
                log.info("execute.warmed_up", **self.warmup)
            ctx.provide("model", loaded)
            task_status.started()

            await ctx.all_started()
            kv = ctx.resource("kv")
            runner = await thread.run(
                ModelRunner, loaded.model, kv.pool, shared_bridge(), kernels, compile_decode, loaded.geometry,
                kv.window_pool, kv.states,
            )
            self.runner = runner
            salt = self.params.seed

            async def handle(step: m.Step) -> None:
                seeds = {
                    w.request_id: w.params.seed if w.params.seed is not None else _seed_for(salt, w.request_id)
                    for w in step.work
                    if w.sample and w.params.temperature > 0
                }
                # a request's own failure (processor, grammar) comes back in StepDone.failed;
                # an exception here is the stage's and fails every request
                await ctx.send(await thread.run(runner.execute, step, seeds))

            await serve_inbox(ctx, handle)
        finally:
            wiring.unwire()
            await thread.aclose()

    def stats(self) -> dict[str, Any]:
        loaded = getattr(self, "loaded", None)
        if loaded is None:
            return {}
        runner = getattr(self, "runner", None)
        compiled = runner.compiled if runner else None
        return {
            "model": {"name": loaded.name, "weights_bytes": loaded.weights_bytes,
                      "quantized": getattr(self, "quantized", {"dequantize_rows": None, "routed_layers": 0})},
            "memory": {"wired_bytes": self.wired.wired_bytes, "wired_reason": self.wired.reason},
            "kernels": runner.kernels if runner else {"enabled": False, "reason": "no step run yet"},
            "compiled_decode": {
                "enabled": compiled is not None,
                "traces": compiled.traces if compiled else 0,
                "cache_resets": compiled.resets if compiled else 0,
            },
            "warmup": getattr(self, "warmup", {"ran": False}),
        }


def _switch(setting: str, *, auto: bool) -> bool:
    """An "auto" | "always" | "never" parameter, with what auto means here."""
    return {"always": True, "never": False}.get(setting, auto)


def _seed_for(salt: int, request_id: str) -> int:
    digest = hashlib.blake2b(f"{salt}:{request_id}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1
