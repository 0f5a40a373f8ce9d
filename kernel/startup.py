"""Where an engine's start went: seconds per phase, from the process's creation to ready
(`Engine.startup`, stats.model.startup, the worker's and the server's ready lines)."""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Iterable

import psutil

# the load's own phases (stages/execute/model.py), in the order they run
LOAD_PHASES = ("build_s", "fuse_s", "blocks_s", "read_s", "geometry_s")
# the rest, in the order a start runs them; the tokenizer loads beside the model
PHASES = ("import_s", "read_ahead_s", "tokenizer_s", "device_s", "load_s", "wire_s", "torch_s", "warmup_s", "pool_s")


def process_age_s() -> float:
    """Seconds since this process was created. On Linux, its start in clock ticks since
    boot (/proc/self/stat, 10 ms steps) against CLOCK_BOOTTIME: psutil's create_time adds
    the boot time, which the kernel gives in whole seconds, so an age from it runs up to
    1 s long (0.4 s on the CPU machine, 0.83 s on an H200 host). Elsewhere psutil's."""
    if sys.platform.startswith("linux"):
        with open("/proc/self/stat", encoding="ascii") as f:
            fields = f.read().rsplit(")", 1)[1].split()  # after the command name: field 3 on
        start = int(fields[19]) / os.sysconf("SC_CLK_TCK")  # field 22, starttime
        return time.clock_gettime(time.CLOCK_BOOTTIME) - start
    return time.time() - psutil.Process().create_time()


class PhaseClock:
    """Seconds per named phase: each `mark` names the time since the last mark (or since
    `restart`, which leaves out what ran in between)."""

    def __init__(self) -> None:
        self.phases: dict[str, float] = {}
        self.restart()

    def restart(self) -> None:
        self._last = time.perf_counter()

    def mark(self, name: str) -> None:
        now = time.perf_counter()
        self.phases[name] = round(self.phases.get(name, 0.0) + now - self._last, 3)
        self._last = now


def collect(parts: Iterable[dict[str, float]], import_s: float, ready_s: float) -> dict[str, float]:
    """One dict of every stage's `startup` figures, with the seconds before the engine
    started (`import_s`: the interpreter, imports, the pipeline's assembly) and to ready."""
    merged: dict[str, float] = {"import_s": round(import_s, 3)}
    for part in parts:
        merged.update(part)
    merged["ready_s"] = round(ready_s, 3)
    return merged


def describe(startup: dict[str, float]) -> str:
    """`ready in 3.21 s: import 1.10, read ahead 0.80 (beside the import), tokenizer 0.30
    (beside the load), load 0.90 (build 0.01, fuse 0.30, read 0.40, geometry 0.19),
    warm-up 0.50`, for a log line."""

    def name(key: str) -> str:
        return key.removesuffix("_s").replace("warmup", "warm-up").replace("_", " ")

    parts = []
    for key in PHASES:
        if key not in startup:
            continue
        text = f"{name(key)} {startup[key]:.2f}"
        if key == "tokenizer_s":
            text += " (beside the load)"
        if key == "read_ahead_s":  # the weights read on a thread while the rest imported
            text += " (beside the import)"
        if key == "load_s":
            inner = [f"{name(k)} {startup[k]:.2f}" for k in LOAD_PHASES if startup.get(k)]
            text += f" ({', '.join(inner)})" if inner else ""
        parts.append(text)
    ready = startup.get("ready_s")
    head = f"ready in {ready:.2f} s" if ready is not None else "ready"
    return f"{head}: {', '.join(parts)}" if parts else head

