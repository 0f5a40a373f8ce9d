"""Python's garbage collector under a long-lived engine.

By the time an engine serves, the process holds hundreds of thousands of objects that
live as long as it does: the modules mlx-lm and transformers import, the tokenizer's
vocabulary, the model's parameter tree. Python's oldest-generation collection walks all
of them, and one ran about once per 20 benchmark runs of 64 requests on the CPU machine,
taking 171-187 ms inside a 60-70 ms run (`tools/probe/host_bound.py`, the model's time ~0;
tools/results/host-bound-gc/). `freeze()` collects the young generations and moves
everything alive into the collector's permanent generation (`gc.freeze`), so later
collections walk only what serving allocates; `thaw()` gives them back when the last
engine that froze stops. Cyclic garbage among the frozen objects waits until then. (No
full collection first: it took 130 ms with the test suite's imports, once per engine.)
"""

from __future__ import annotations

import gc
import threading

_lock = threading.Lock()
_holders = 0  # engines that froze and have not stopped


def freeze() -> None:
    """Freeze what is alive (again for each engine: its own objects too)."""
    global _holders
    with _lock:
        _holders += 1
        gc.collect(1)  # the start-up's young garbage; the old generation as it is
        gc.freeze()


def thaw() -> None:
    """One engine stopped; the last one hands the frozen objects back to the collector."""
    global _holders
    with _lock:
        if _holders == 0:
            return
        _holders -= 1
        if _holders == 0:
            gc.unfreeze()


def holders() -> int:
    return _holders
