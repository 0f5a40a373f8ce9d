"""Every CUDA kernel the engine's paths launch compiles for an H200 (sm_90) with NVRTC,
without spilling registers to local memory and within an SM's registers at its block
size, on a machine without a GPU (tools/device/nvrtc_check.py: the sources wrapped as the engine
builds them, unikern.platform.cuda_build). NVRTC and CUDA's headers come from the test extras'
`nvidia-cuda-nvrtc` and `nvidia-cuda-runtime` wheels (Linux x86_64)."""

import os
from concurrent.futures import ThreadPoolExecutor

import pytest

from tools.device import nvrtc_check


def test_every_kernel_compiles_for_sm90():
    try:
        nvrtc, include = nvrtc_check.find_nvrtc()
    except FileNotFoundError as exc:
        pytest.skip(str(exc))
    builds = {b.launched(): (b.label, b.threads) for b in nvrtc_check.record_launches()}
    labels = " ".join(label for label, _ in builds.values())
    for name in ("paged_decode_group_", "paged_decode_group_parts_", "paged_decode_merge_", "add_rms_norm_",
                 "q4_gemv_", "q4_mma_", "bf16_mma_", "block_gemv_", "pool_write_", "rope_write_", "block_step_",
                 "step_layout_", "rows_"):
        assert f"unikern_{name}" in labels, name  # every kernel was reached
    failures, spills, too_big = {}, {}, {}

    def compile_one(source):  # NVRTC runs without the GIL (ctypes): the builds compile side by side
        return nvrtc_check.compile_source(nvrtc, include, "unikern", source, "sm_90", ptxas=True)[:2]

    with ThreadPoolExecutor(max_workers=os.cpu_count() or 1) as pool:
        logs = dict(zip(builds, pool.map(compile_one, builds), strict=True))
    for source, (label, threads) in builds.items():
        ok, log = logs[source]
        if not ok:
            failures[label] = log[-1500:]
            continue
        if "0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads" not in log:
            spills[label] = log[-500:]  # registers spilled to local memory: a slower kernel
        if nvrtc_check.registers(log) * threads > 65536:  # an SM's register file: the launch would fail
            too_big[label] = (nvrtc_check.registers(log), threads)
    assert not failures, failures
    assert not spills, spills
    assert not too_big, too_big


def test_a_broken_source_does_not_compile():
    try:
        nvrtc, include = nvrtc_check.find_nvrtc()
    except FileNotFoundError as exc:
        pytest.skip(str(exc))
    source = nvrtc_check.wrap("k", "out[0] = undefined_name;", "", [("x", "float32", 1)], [("out", "float32")], [])
    ok, log, _ = nvrtc_check.compile_source(nvrtc, include, "k", source, "sm_90")
    assert not ok and "undefined_name" in log
