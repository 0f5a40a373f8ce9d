"""Wired weights: real mlock where allowed, a clear reason where the limit is too low, Metal."""

from __future__ import annotations

import json
import os
import resource
import shutil
import subprocess
import sys
from types import SimpleNamespace

import mlx.core as mx
import pytest

from unikern.platform.pinning import WeightWiring, locked_bytes, unwire, wire_weights

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="mlock path")

MIB = 1 << 20


def weights() -> list[mx.array]:
    # ~2.3 MiB in all: inside the default 8 MiB RLIMIT_MEMLOCK even without CAP_IPC_LOCK
    arrays = [
        mx.random.normal((256, 1024)),
        mx.random.normal((1024,)),
        mx.random.normal((128, 512)).astype(mx.bfloat16),
    ]
    mx.eval(*arrays)
    return arrays


def test_mlock_wires_every_weight_and_unwire_releases() -> None:
    arrays = weights()
    wiring = WeightWiring(getrlimit=lambda _: (64 * MIB, 64 * MIB), has_ipc_lock=lambda: False)
    before = locked_bytes()
    report = wiring.wire(arrays)
    try:
        assert report.wired_bytes == report.requested_bytes == sum(a.nbytes for a in arrays)
        assert "mlocked" in report.reason
        assert locked_bytes() - before >= report.wired_bytes  # the kernel agrees
    finally:
        wiring.unwire()
    assert locked_bytes() == before


def test_a_low_memlock_limit_wires_nothing_and_says_why() -> None:
    arrays = weights()
    wiring = WeightWiring(getrlimit=lambda _: (64 * 1024, 64 * 1024), has_ipc_lock=lambda: False)
    before = locked_bytes()
    report = wiring.wire(arrays)
    assert report.wired_bytes == 0
    assert report.requested_bytes == sum(a.nbytes for a in arrays)
    assert "RLIMIT_MEMLOCK is 65536 bytes" in report.reason and "need" in report.reason
    assert locked_bytes() == before


def test_cap_ipc_lock_lifts_a_low_limit() -> None:
    arrays = weights()
    wiring = WeightWiring(getrlimit=lambda _: (64 * 1024, 64 * 1024), has_ipc_lock=lambda: True)
    report = wiring.wire(arrays)
    try:
        if report.wired_bytes == 0:  # a process that only claimed the capability
            assert "mlock failed" in report.reason
        else:
            assert "CAP_IPC_LOCK" in report.reason
    finally:
        wiring.unwire()


def test_unlimited_limit_and_disabled() -> None:
    arrays = weights()
    unlimited = resource.RLIM_INFINITY
    wiring = WeightWiring(getrlimit=lambda _: (unlimited, unlimited), has_ipc_lock=lambda: False)
    try:
        assert "unlimited" in wiring.wire(arrays).reason
    finally:
        wiring.unwire()
    report = wiring.wire(arrays, enabled=False)
    assert (report.wired_bytes, report.reason) == (0, "wiring disabled")


def test_process_wide_helpers_on_this_machine() -> None:
    arrays = weights()
    before = locked_bytes()
    report = wire_weights(arrays)
    try:
        assert report.requested_bytes == sum(a.nbytes for a in arrays)
        assert report.wired_bytes in (0, report.requested_bytes)
        assert report.reason
    finally:
        unwire()
    assert locked_bytes() == before


def test_metal_sets_the_wired_limit_and_restores_it() -> None:
    calls: list[int] = []

    def set_wired_limit(limit: int) -> int:
        calls.append(limit)
        return 0

    fake = SimpleNamespace(
        eval=lambda *arrays: None,
        set_wired_limit=set_wired_limit,
        metal=SimpleNamespace(
            is_available=lambda: True,
            device_info=lambda: {"max_recommended_working_set_size": 48 * MIB},
        ),
        cuda=SimpleNamespace(is_available=lambda: False),
    )
    arrays = weights()
    wiring = WeightWiring(mx_module=fake)
    report = wiring.wire(arrays)
    assert report.wired_bytes == sum(a.nbytes for a in arrays)
    assert calls == [48 * MIB]
    wiring.unwire()
    assert calls == [48 * MIB, 0]
    too_big = WeightWiring(mx_module=fake).wire([mx.zeros((64 * MIB // 4,))])
    assert too_big.wired_bytes == 48 * MIB and "exceed" in too_big.reason


CHILD = """
import json, ctypes, os
import mlx.core as mx
from unikern.platform.bridge import mlx_buffer
from unikern.platform.pinning import wire_weights
weights = [mx.random.normal((4096, 1024))]  # 16 MiB, over the 8 MiB default limit
mx.eval(*weights)
report = wire_weights(weights)
libc = ctypes.CDLL(None, use_errno=True)
libc.mlock.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
address, _ = mlx_buffer(weights[0])
raw = libc.mlock(address & ~4095, weights[0].nbytes)
print(json.dumps({"wired": report.wired_bytes, "reason": report.reason, "raw_mlock": raw}))
"""


@pytest.mark.skipif(shutil.which("capsh") is None or os.geteuid() != 0, reason="needs root + capsh")
def test_without_cap_ipc_lock_the_real_limit_decides() -> None:
    # Drop CAP_IPC_LOCK for a child: the kernel then enforces RLIMIT_MEMLOCK, and the
    # report must predict what a raw mlock of the same buffer does.
    soft, _ = resource.getrlimit(resource.RLIMIT_MEMLOCK)
    if soft == resource.RLIM_INFINITY or soft >= 16 * MIB:
        pytest.skip(f"RLIMIT_MEMLOCK {soft} is not below the 16 MiB test weights")
    done = subprocess.run(
        ["capsh", "--drop=cap_ipc_lock", "--", "-c", f"exec {sys.executable} -c '{CHILD}'"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr
    got = json.loads(done.stdout.strip().splitlines()[-1])
    assert got["wired"] == 0 and "RLIMIT_MEMLOCK" in got["reason"]
    assert got["raw_mlock"] == -1  # the kernel agrees: it would have failed
