"""Where an engine's start went: the phases in stats, Engine.startup and the ready lines."""

from __future__ import annotations

import pytest

import unikern
from tests.conftest import SMALL_KV
from unikern.startup import collect, describe

pytestmark = pytest.mark.anyio


def test_collect_and_describe_name_every_phase_in_order():
    startup = collect([{"tokenizer_s": 0.3}, {"device_s": 0.02, "load_s": 0.9, "build_s": 0.01, "fuse_s": 0.3,
                                              "read_s": 0.4, "geometry_s": 0.19, "wire_s": 0.0, "warmup_s": 0.5}],
                      import_s=1.1, ready_s=3.21)
    assert list(startup)[0] == "import_s" and startup["ready_s"] == 3.21
    line = describe(startup)
    assert line.startswith("ready in 3.21 s: import 1.10, tokenizer 0.30 (beside the load), device 0.02, load 0.90 "
                           "(build 0.01, fuse 0.30, read 0.40, geometry 0.19), wire 0.00, warm-up 0.50")
    assert describe({}) == "ready"


async def test_engine_reports_its_start_split_at_ready_and_in_stats(tiny_llama):
    overrides = {**SMALL_KV, "execute": {"warmup": "always"}}
    async with unikern.Engine.from_pipeline("generate", model=tiny_llama, overrides=overrides) as engine:
        startup = engine.startup
        for key in ("import_s", "tokenizer_s", "device_s", "load_s", "read_s", "geometry_s", "wire_s",
                    "warmup_s", "pool_s", "ready_s"):
            assert startup[key] >= 0, key
        # the phases before ready fit in the time to ready (the tokenizer runs beside the load)
        assert startup["import_s"] + startup["load_s"] + startup["warmup_s"] <= startup["ready_s"]
        assert startup["read_s"] + startup["geometry_s"] <= startup["load_s"]
        assert engine.stats()["model"]["startup"] == startup


def test_a_processs_age_is_no_longer_than_its_parent_saw_it_live():
    """import_s is the process's age when the engine starts: measured from the process's
    start, not from a boot time rounded to whole seconds (psutil's create_time on Linux,
    up to 1 s long)."""
    import subprocess
    import sys
    import time

    code = "from unikern.startup import process_age_s; print(process_age_s())"
    for _ in range(3):
        spawned = time.perf_counter()
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
        lived = time.perf_counter() - spawned
        age = float(out)
        # its start is counted in 10 ms clock ticks: a tick of slack
        assert 0 <= age <= lived + 0.011, (age, lived)
