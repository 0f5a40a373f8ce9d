"""Platform accounting: this machine (CPU), fake Metal and CUDA backends, the KV budget."""

from __future__ import annotations

from types import SimpleNamespace

import psutil
import pytest

from unikern.errors import ConfigError, UnikernError
from unikern.platform import blas
from unikern.platform.facts import Platform

GIB = 1 << 30


def fake_psutil(total: int) -> SimpleNamespace:
    return SimpleNamespace(virtual_memory=lambda: SimpleNamespace(total=total))


def fake_mx(*, metal: bool = False, cuda: bool = False, gpu_info: dict | None = None, limit: int = 0):
    return SimpleNamespace(
        get_memory_limit=lambda: limit,
        cpu="cpu",
        gpu="gpu",
        metal=SimpleNamespace(
            is_available=lambda: metal,
            device_info=lambda: {
                "architecture": "applegpu_g15s",
                "device_name": "Apple M3 Max",
                "memory_size": 64 * GIB,
                "max_recommended_working_set_size": 48 * GIB,
            },
        ),
        cuda=SimpleNamespace(is_available=lambda: cuda),
        device_info=lambda device: (gpu_info or {}) if device == "gpu" else {"device_name": "CPU"},
    )


def test_this_machine_is_a_unified_cpu() -> None:
    found = Platform.detect()
    assert found.backend == "cpu"
    assert found.unified_memory is True
    assert found.device_count == 1
    assert found.pin_memory is False
    assert found.total_memory == psutil.virtual_memory().total
    assert found.blas == blas.info().library
    import mlx.core as mx

    assert found.memory_limit == mx.get_memory_limit() > 0


def test_metal_uses_system_ram_and_never_pins() -> None:
    found = Platform.detect(fake_mx(metal=True), fake_psutil(64 * GIB))
    assert (found.backend, found.unified_memory, found.pin_memory) == ("metal", True, False)
    assert found.total_memory == 64 * GIB
    assert found.device_name == "Apple M3 Max"


def test_cuda_uses_the_device_memory_as_managed_memory() -> None:
    info = {"device_name": "NVIDIA H200", "total_memory": 141 * GIB, "free_memory": 140 * GIB}
    found = Platform.detect(fake_mx(cuda=True, gpu_info=info), fake_psutil(2000 * GIB))
    assert found.backend == "cuda"
    assert found.total_memory == 141 * GIB  # the device's, not the host's 2000 GiB
    assert (found.unified_memory, found.pin_memory, found.device_count) == (True, False, 1)
    assert found.device_name == "NVIDIA H200"


def test_cuda_without_a_memory_size_is_an_error() -> None:
    with pytest.raises(UnikernError, match="total_memory"):
        Platform.detect(fake_mx(cuda=True, gpu_info={"device_name": "?"}), fake_psutil(GIB))


def test_cpu_fallback_with_fakes() -> None:
    found = Platform.detect(fake_mx(), fake_psutil(8 * GIB))
    assert (found.backend, found.total_memory, found.device_name) == ("cpu", 8 * GIB, "CPU")


def test_to_stats_has_exactly_the_documented_keys() -> None:
    stats = Platform.detect(fake_mx(), fake_psutil(8 * GIB)).to_stats()
    assert set(stats) == {
        "backend",
        "unified_memory",
        "total_memory",
        "device_count",
        "pin_memory",
        "blas",
        "device_name",
        "memory_limit",
    }
    assert stats["total_memory"] == 8 * GIB


def test_kv_budget_is_fraction_of_total_minus_weights_and_reserve() -> None:
    found = Platform.detect(fake_mx(), fake_psutil(16 * GIB))
    assert found.kv_budget_bytes(0.5, 2 * GIB, GIB) == 5 * GIB
    assert found.kv_budget_bytes(1.0, 0, 0) == 16 * GIB


@pytest.mark.parametrize("fraction", [0.0, -0.1, 1.5])
def test_kv_budget_rejects_fractions_outside_zero_one(fraction: float) -> None:
    found = Platform.detect(fake_mx(), fake_psutil(16 * GIB))
    with pytest.raises(ConfigError, match="memory_fraction"):
        found.kv_budget_bytes(fraction, 0, 0)


def test_kv_budget_that_leaves_nothing_names_the_numbers() -> None:
    found = Platform.detect(fake_mx(), fake_psutil(16 * GIB))
    with pytest.raises(ConfigError) as caught:
        found.kv_budget_bytes(0.5, 7 * GIB, GIB)
    message = str(caught.value)
    for number in (16 * GIB, 8 * GIB, 7 * GIB, GIB):
        assert str(number) in message


def test_mlx_kernel_cache_defaults_to_the_user_cache_dir(tmp_path):
    """unikern points MLX's kernel cache (MLX_PTX_CACHE_DIR) under the user's cache dir
    at import, so a second start finds its compiled GPU kernels; a user's choice stays."""
    import os
    import subprocess
    import sys
    from importlib import metadata

    env = {k: v for k, v in os.environ.items() if k not in ("MLX_PTX_CACHE_DIR", "XDG_CACHE_HOME")}
    env["HOME"] = str(tmp_path)
    show = "import os, unikern; print(os.environ['MLX_PTX_CACHE_DIR'])"
    out = subprocess.run([sys.executable, "-c", show], env=env, capture_output=True, text=True, check=True)
    expected = tmp_path / ".cache" / "unikern" / "mlx-kernels" / metadata.version("mlx")
    assert out.stdout.strip() == str(expected)
    env["MLX_PTX_CACHE_DIR"] = str(tmp_path / "mine")
    out = subprocess.run([sys.executable, "-c", show], env=env, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == str(tmp_path / "mine")


def test_kernel_cache_follows_xdg_cache_home():
    from unikern.platform import kernel_cache

    env = {"XDG_CACHE_HOME": "/x/cache", "HOME": "/home/u"}
    assert kernel_cache.configure(env).startswith("/x/cache/unikern/mlx-kernels/")
    assert env["MLX_PTX_CACHE_DIR"].startswith("/x/cache/")


def test_unikerns_cuda_kernels_are_named_by_their_source():
    """MLX keys a compiled CUDA kernel (and its PTX on disk, kept across upgrades) by name
    and template arguments alone: each of unikern's kernels is built under a name that
    carries a digest of its source, so a changed source never loads the old code. Every
    build the engine's paths launch (tools/device/nvrtc_check.py drives them with MLX's
    cuda_kernel stood in for)."""
    from tools.device.nvrtc_check import record_launches
    from unikern.platform.kernel_cache import kernel_name

    assert kernel_name("k", "a") != kernel_name("k", "b") and kernel_name("k", "a").startswith("k_")
    assert kernel_name("k", "a", "") != kernel_name("k", "a", "header")
    builds = record_launches()
    bases = {b.name.rsplit("_", 1)[0] for b in builds}
    assert bases == {"unikern_q4_gemv", "unikern_q4_mma", "unikern_paged_decode_group",
                     "unikern_paged_decode_group_parts", "unikern_paged_decode_merge", "unikern_add_rms_norm",
                     "unikern_block_gemv", "unikern_pool_write", "unikern_rope_write", "unikern_block_step",
                     "unikern_bf16_mma", "unikern_step_layout", "unikern_rows"}
    for b in builds:  # the signature (inputs, outputs) is in the digest too
        signature = ",".join(n for n, _, _ in b.inputs), ",".join(n for n, _ in b.outputs)
        assert b.name == kernel_name(b.name.rsplit("_", 1)[0], b.source, b.header, *signature), b.label


def test_kv_budget_stays_inside_mlxs_memory_limit() -> None:
    """A process whose MLX may allocate less than memory_fraction x total (its own
    mx.set_memory_limit, or a GPU shared with other servers) gets a budget inside that
    limit, which the weights count against. (Two MLX servers and llama-server on one GPU,
    each MLX process limited to 30 GiB while its budget was 0.5 x the card: one engine
    failed with cudaMallocAsync out of memory on an H200, 2026-12-05.)"""
    found = Platform.detect(fake_mx(cuda=True, gpu_info={"total_memory": 80 * GIB}, limit=30 * GIB), fake_psutil(GIB))
    assert found.memory_limit == 30 * GIB
    assert found.kv_budget_bytes(0.5, 5 * GIB, GIB) == 24 * GIB  # not 40 - 6
    assert found.kv_budget_bytes(0.25, 5 * GIB, GIB) == 14 * GIB  # 20 GiB is inside the limit
    small = Platform.detect(fake_mx(cuda=True, gpu_info={"total_memory": 80 * GIB}, limit=5 * GIB), fake_psutil(GIB))
    with pytest.raises(ConfigError, match="MLX's memory limit 5368709120 bytes .*mx.set_memory_limit"):
        small.kv_budget_bytes(0.5, 5 * GIB, GIB)


@pytest.mark.anyio
async def test_an_engine_under_a_lower_mlx_limit_budgets_inside_it(tiny_llama) -> None:
    import mlx.core as mx

    import unikern

    limit = 1 << 30  # well below memory_fraction x this machine's RAM (the reserve is 512 MiB)
    previous = mx.set_memory_limit(limit)
    try:
        async with unikern.Engine.from_pipeline("generate", model=tiny_llama) as engine:
            memory = engine.stats()["memory"]
            platform = engine.stats()["platform"]
    finally:
        mx.set_memory_limit(previous)
    assert platform["memory_limit"] == limit
    assert 0 < memory["kv_budget_bytes"] <= limit - (512 << 20)
