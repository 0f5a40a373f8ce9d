"""Times a unikern engine's steps on the model thread: each step's time inside
`ModelRunner.execute`, the gaps between steps, and the decode windows' and prefills' host
time split into build, submit and wait (tools/probe/step_gaps.py prints it;
tools/bench/bench_gpu.py --split records it beside its throughput)."""

from __future__ import annotations

import statistics
import threading
import time


class StepClock:
    """Times ModelRunner.execute per step and splits the decode windows' time on the model
    thread into build (the traced step's replay), submit (`mx.async_eval`), wait
    (`mx.eval`) and other (the runner's own Python). install() patches the classes for
    the process (a tool's, not the engine's)."""

    PARTS = ("build", "submit", "wait")

    def __init__(self) -> None:
        # start, end, num_steps, rows, tokens fed, follow-up, the window's host time by part
        self.steps: list[tuple[float, float, int, int, int, bool, dict[str, float]]] = []
        self.spent = dict.fromkeys(self.PARTS, 0.0)  # seconds, on the model thread
        self._thread: int | None = None  # the thread inside a decode window's execute

    def install(self) -> None:
        import mlx.core as mx

        from tools.probe.probe_cuda import timed
        from unikern.stages.execute.compiled import CompiledDecode
        from unikern.stages.execute.runner import ModelRunner

        execute = ModelRunner.execute
        clock = self

        def execute_timed(runner, step, seeds):
            clock._thread = threading.get_ident()
            before = dict(clock.spent)
            start = time.perf_counter()
            try:
                return execute(runner, step, seeds)
            finally:
                end = time.perf_counter()
                clock._thread = None
                clock.steps.append((start, end, step.num_steps, len(step.work),
                                    sum(len(w.token_ids) for w in step.work), any(w.continues for w in step.work),
                                    {k: clock.spent[k] - before[k] for k in clock.PARTS}))

        ModelRunner.execute = execute_timed

        def on_model_thread() -> bool:
            return self._thread == threading.get_ident()

        timed(CompiledDecode, "__call__", self.spent, "build", when=on_model_thread)
        # a prefill's forward: the family's (_logits) or by rows (_logits_by_rows)
        timed(ModelRunner, "_logits", self.spent, "build", when=on_model_thread)
        timed(ModelRunner, "_logits_by_rows", self.spent, "build", when=on_model_thread)
        timed(mx, "async_eval", self.spent, "submit", when=on_model_thread)
        timed(mx, "eval", self.spent, "wait", when=on_model_thread)

    def summary(self, began: float, ended: float, with_steps: bool = False) -> dict:
        """The steps since `steps` was last cleared, in ms: time inside execute, the gaps
        between steps, head (from `began` to the first step) and tail (from the last step
        to `ended`), and per decode-window step its time and parts."""
        steps = self.steps
        gaps = [steps[i + 1][0] - steps[i][1] for i in range(len(steps) - 1)]
        windows = [s for s in steps if s[2] > 1]
        decode_steps = sum(s[2] for s in windows)
        out = {"execute_ms": sum(s[1] - s[0] for s in steps) * 1e3,
               "gaps_ms": sum(gaps) * 1e3, "largest_gap_ms": max(gaps, default=0) * 1e3,
               "head_ms": (steps[0][0] - began) * 1e3 if steps else None,
               "tail_ms": (ended - steps[-1][1]) * 1e3 if steps else None}
        if decode_steps:
            out.update({f"{k}_ms": sum(s[6][k] for s in windows) / decode_steps * 1e3 for k in self.PARTS})
            out["window_step_ms"] = sum(s[1] - s[0] for s in windows) / decode_steps * 1e3
            out["other_ms"] = out["window_step_ms"] - sum(out[f"{k}_ms"] for k in self.PARTS)
        # steps that feed a prompt (more tokens than rows) and decode no window
        prefills = [s for s in steps if s[2] == 1 and s[4] > s[3]]
        if prefills:
            out["prefill_step_ms"] = sum(s[1] - s[0] for s in prefills) / len(prefills) * 1e3
            for k in ("build", "wait"):
                out[f"prefill_{k}_ms"] = sum(s[6][k] for s in prefills) / len(prefills) * 1e3
            out["prefill_other_ms"] = out["prefill_step_ms"] - out["prefill_build_ms"] - out["prefill_wait_ms"]
        if with_steps:
            out["steps"] = [{"num_steps": n, "rows": r, "tokens_fed": t, "follow_up": f, "ms": (e - s) * 1e3,
                             "gap_before_ms": (s - steps[i - 1][1]) * 1e3 if i else None}
                            for i, (s, e, n, r, t, f, _) in enumerate(steps)]
        return out


def medians(runs: list[dict]) -> dict:
    """Each figure the runs all have (numbers, not None), as its median over them."""
    return {k: statistics.median(r[k] for r in runs) for k, v in runs[0].items()
            if isinstance(v, int | float) and all(isinstance(r.get(k), int | float) for r in runs)}


def steps_line(row: dict) -> str:
    line = ""
    if "prefill_step_ms" in row:
        line = (f"prefill steps: {row['prefill_step_ms']:.2f} ms  build {row['prefill_build_ms']:.2f}  "
                f"wait {row['prefill_wait_ms']:.2f}  other {row['prefill_other_ms']:.2f}; ")
    if "window_step_ms" in row:
        line += (f"decode windows: {row['window_step_ms']:.3f} ms per step  build {row['build_ms']:.3f}  "
                 f"submit {row['submit_ms']:.3f}  wait {row['wait_ms']:.3f}  other {row['other_ms']:.3f}")
    return line
