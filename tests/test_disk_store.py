"""The disk tier's store: LRU under a byte cap, restart, safety, and failure handling."""

from __future__ import annotations

import errno
import os
import stat
import threading
from pathlib import Path

import numpy as np
import pytest

from unikern.errors import ConfigError
from unikern.stages.tiers.disk.format import encode_block
from unikern.stages.tiers.disk.store import DiskStore, InvalidKeyError, make_namespace

NAMESPACE = "tiny-bfloat16-16-0123456789abcdef0123"
SHAPE = (2, 2, 16, 2, 8)  # layers, k/v, tokens, heads, head dim


def key_of(i: int) -> bytes:
    return i.to_bytes(2, "big") * 16


def bf16_block(seed: int) -> np.ndarray:
    values = np.random.default_rng(seed).standard_normal(int(np.prod(SHAPE))).astype(np.float32)
    return (values.view(np.uint32) >> 16).astype(np.uint16).reshape(SHAPE)


def put(store: DiskStore, i: int) -> bool:
    return store.put(key_of(i), bf16_block(i), dtype="bfloat16", shape=SHAPE, token_count=16)


def file_of(store: DiskStore, i: int) -> Path:
    return store.directory / (key_of(i).hex() + ".ukkv")


def block_file_size(i: int) -> int:
    return len(
        encode_block(key_of(i), bf16_block(i), dtype="bfloat16", shape=SHAPE, token_count=16)
    )


@pytest.fixture
def store(tmp_path: Path) -> DiskStore:
    return DiskStore(tmp_path, NAMESPACE, capacity_bytes=1 << 20)


def test_put_then_get_round_trips(store):
    assert put(store, 1)
    block = store.get(key_of(1))
    assert block is not None
    assert block.payload.tobytes() == bf16_block(1).tobytes()
    assert (block.dtype, block.shape, block.token_count) == ("bfloat16", SHAPE, 16)
    assert store.contains(key_of(1)) and not store.contains(key_of(2))
    assert store.get(key_of(2)) is None
    stats = store.stats()
    assert (stats["hits"], stats["misses"], stats["blocks"], stats["files"]) == (1, 1, 1, 1)


def test_get_decodes_into_out(store):
    put(store, 1)
    out = np.zeros(bf16_block(1).nbytes, np.uint8)
    block = store.get(key_of(1), out=out)
    assert block is not None and np.shares_memory(block.payload, out)
    assert out.tobytes() == bf16_block(1).tobytes()


def test_stats_sizes_and_compression_ratio(store):
    assert store.stats()["compression_ratio"] == 0.0
    put(store, 1)
    put(store, 2)
    stats = store.stats()
    on_disk = sum(p.stat().st_size for p in store.directory.iterdir())
    assert stats["bytes_on_disk"] == on_disk
    assert stats["bytes"] == 2 * bf16_block(1).nbytes
    assert stats["compression_ratio"] == pytest.approx(stats["bytes"] / on_disk)
    assert stats["compression_ratio"] > 1.1


def test_lru_eviction_keeps_under_capacity(tmp_path):
    capacity = 3 * block_file_size(1) + 100
    store = DiskStore(tmp_path, NAMESPACE, capacity_bytes=capacity)
    for i in (1, 2, 3):
        assert put(store, i)
    assert store.get(key_of(1)) is not None  # 2 is now least recently used
    assert put(store, 4)
    assert store.keys() == [key_of(3), key_of(1), key_of(4)]
    assert not file_of(store, 2).exists()
    stats = store.stats()
    assert stats["evictions"] == 1 and stats["bytes_on_disk"] <= capacity


def test_block_bigger_than_capacity_is_refused(tmp_path):
    store = DiskStore(tmp_path, NAMESPACE, capacity_bytes=block_file_size(1) - 1)
    assert not put(store, 1)
    assert store.keys() == [] and list(store.directory.iterdir()) == []
    assert store.stats()["refused_too_large"] == 1


def test_index_is_rebuilt_on_restart_in_lru_order(tmp_path, store):
    for i in (1, 2, 3):
        put(store, i)
    for age, i in enumerate((2, 3, 1)):  # oldest first, by mtime
        os.utime(file_of(store, i), ns=(10**18 + age * 10**9,) * 2)
    restarted = DiskStore(tmp_path, NAMESPACE, capacity_bytes=1 << 20)
    assert restarted.keys() == [key_of(2), key_of(3), key_of(1)]
    before, after = store.stats(), restarted.stats()
    for field in ("blocks", "bytes", "bytes_on_disk", "compression_ratio"):
        assert after[field] == before[field]
    assert restarted.get(key_of(3)).payload.tobytes() == bf16_block(3).tobytes()


def test_a_hit_refreshes_lru_order_across_restart(tmp_path, store):
    for i in (1, 2):
        put(store, i)
        os.utime(file_of(store, i), ns=(10**18 + i * 10**9,) * 2)
    store.get(key_of(1))
    assert DiskStore(tmp_path, NAMESPACE, 1 << 20).keys() == [key_of(2), key_of(1)]


def test_restart_with_smaller_capacity_evicts(tmp_path, store):
    for i in (1, 2, 3):
        put(store, i)
    smaller = DiskStore(tmp_path, NAMESPACE, capacity_bytes=block_file_size(3) + 10)
    assert smaller.keys() == [key_of(3)]
    assert sorted(p.name for p in smaller.directory.iterdir()) == [file_of(store, 3).name]


def test_killed_mid_write_temp_file_is_swept_and_never_read(tmp_path, store):
    whole = encode_block(key_of(5), bf16_block(5), dtype="bfloat16", shape=SHAPE, token_count=16)
    partial = store.directory / ".tmp-0123abcd"
    partial.write_bytes(whole[: len(whole) // 2])
    restarted = DiskStore(tmp_path, NAMESPACE, capacity_bytes=1 << 20)
    assert not partial.exists()
    assert restarted.stats()["swept_tmp_files"] == 1
    assert restarted.get(key_of(5)) is None and restarted.keys() == []


def test_truncated_block_file_is_dropped_at_startup(tmp_path, store):
    put(store, 1)
    path = file_of(store, 1)
    path.write_bytes(path.read_bytes()[:-10])
    restarted = DiskStore(tmp_path, NAMESPACE, capacity_bytes=1 << 20)
    assert restarted.keys() == [] and not path.exists()
    assert restarted.stats()["corrupt_files"] == 1


def test_files_with_other_names_are_ignored_and_kept(tmp_path, store):
    (store.directory / "notes.txt").write_text("mine")
    (store.directory / ("AB" * 16 + ".ukkv")).write_bytes(b"upper-case hex is not ours")
    restarted = DiskStore(tmp_path, NAMESPACE, capacity_bytes=1 << 20)
    assert restarted.keys() == []
    assert (store.directory / "notes.txt").read_text() == "mine"


def test_corrupt_file_is_counted_deleted_and_a_miss(store):
    put(store, 1)
    path = file_of(store, 1)
    damaged = bytearray(path.read_bytes())
    damaged[-5] ^= 0xFF
    path.write_bytes(bytes(damaged))
    assert store.get(key_of(1)) is None
    assert not path.exists() and not store.contains(key_of(1))
    stats = store.stats()
    assert (stats["corrupt_files"], stats["misses"], stats["blocks"], stats["bytes"]) == (
        1,
        1,
        0,
        0,
    )


def test_renamed_file_is_detected(store):
    put(store, 1)
    put(store, 2)
    os.replace(file_of(store, 1), file_of(store, 2))  # block 1's bytes under block 2's name
    assert store.get(key_of(2)) is None
    assert store.stats()["corrupt_files"] == 1


def test_renamed_file_is_dropped_at_startup(tmp_path, store):
    put(store, 1)
    os.rename(file_of(store, 1), file_of(store, 2))
    restarted = DiskStore(tmp_path, NAMESPACE, capacity_bytes=1 << 20)
    assert restarted.keys() == [] and restarted.stats()["corrupt_files"] == 1


def test_permissions_are_private(tmp_path):
    (tmp_path / NAMESPACE).mkdir(mode=0o755)
    os.chmod(tmp_path / NAMESPACE, 0o755)
    store = DiskStore(tmp_path, NAMESPACE, capacity_bytes=1 << 20)
    put(store, 1)
    assert stat.S_IMODE(os.stat(store.directory).st_mode) == 0o700
    assert stat.S_IMODE(os.stat(file_of(store, 1)).st_mode) == 0o600
    fresh = DiskStore(tmp_path / "new", NAMESPACE, capacity_bytes=1 << 20)
    assert stat.S_IMODE(os.stat(fresh.directory).st_mode) == 0o700


@pytest.mark.parametrize("bad_key", ["../../etc/passwd", b"short", b"x" * 33, bytearray(16), None])
def test_bad_keys_are_refused(store, bad_key):
    with pytest.raises(InvalidKeyError):
        store.put(bad_key, bf16_block(1), dtype="bfloat16", shape=SHAPE, token_count=16)
    with pytest.raises(InvalidKeyError):
        store.get(bad_key)


def test_key_bytes_that_spell_a_path_stay_inside(store):
    key = b"../../../etc/pwd"  # 16 bytes: fine as a key, the file name is its hex
    assert store.put(key, bf16_block(1), dtype="bfloat16", shape=SHAPE, token_count=16)
    assert [p.name for p in store.directory.iterdir()] == [key.hex() + ".ukkv"]


@pytest.mark.parametrize(
    ("arguments", "match"),
    [
        ({"capacity_bytes": 0}, "capacity_bytes"),
        ({"level": 99}, "level"),
        ({"level": True}, "level"),
    ],
)
def test_bad_store_parameters_are_refused(tmp_path, arguments, match):
    with pytest.raises(ConfigError, match=match):
        DiskStore(tmp_path, NAMESPACE, **({"capacity_bytes": 1 << 20} | arguments))


@pytest.mark.parametrize("namespace", ["../escape", "a/b", "", ".hidden", "UPPER"])
def test_bad_namespaces_are_refused(tmp_path, namespace):
    with pytest.raises(ConfigError):
        DiskStore(tmp_path, namespace, capacity_bytes=1 << 20)


def test_symlinks_in_the_directory_are_removed_not_followed(tmp_path, store):
    outside = tmp_path / "outside.ukkv"
    outside.write_bytes(
        encode_block(key_of(7), bf16_block(7), dtype="bfloat16", shape=SHAPE, token_count=16)
    )
    file_of(store, 7).symlink_to(outside)
    (store.directory / ".tmp-link").symlink_to(outside)
    restarted = DiskStore(tmp_path, NAMESPACE, capacity_bytes=1 << 20)
    assert not restarted.contains(key_of(7)) and restarted.get(key_of(7)) is None
    assert not file_of(store, 7).is_symlink() and not (store.directory / ".tmp-link").is_symlink()
    assert outside.exists() and restarted.stats()["removed_symlinks"] == 2


def test_symlink_swapped_in_while_running_is_not_followed(tmp_path, store):
    put(store, 1)
    outside = tmp_path / "outside"
    outside.write_bytes(file_of(store, 1).read_bytes())
    file_of(store, 1).unlink()
    file_of(store, 1).symlink_to(outside)
    assert store.get(key_of(1)) is None
    assert not file_of(store, 1).is_symlink() and outside.exists()


def test_namespace_directory_that_is_a_symlink_is_refused(tmp_path):
    (tmp_path / "real").mkdir()
    (tmp_path / NAMESPACE).symlink_to(tmp_path / "real")
    with pytest.raises(ConfigError, match="symlink"):
        DiskStore(tmp_path, NAMESPACE, capacity_bytes=1 << 20)


def _fail_writes(monkeypatch, error_number: int) -> None:
    def write(fd, data):
        raise OSError(error_number, os.strerror(error_number))

    monkeypatch.setattr(os, "write", write)


@pytest.mark.parametrize("error_number", [errno.ENOSPC, errno.EDQUOT])
def test_disk_full_returns_false_and_leaves_no_temp_file(store, monkeypatch, error_number):
    put(store, 1)
    with monkeypatch.context() as patch:
        _fail_writes(patch, error_number)
        assert not put(store, 2)
    assert [p.name for p in store.directory.iterdir()] == [file_of(store, 1).name]
    assert store.stats()["write_errors"] == 1 and store.keys() == [key_of(1)]
    assert put(store, 2)  # and it recovers once there is space


def test_other_write_errors_propagate_and_leave_no_temp_file(store, monkeypatch):
    with monkeypatch.context() as patch:
        _fail_writes(patch, errno.EIO)
        with pytest.raises(OSError):
            put(store, 1)
    assert list(store.directory.iterdir()) == []


def test_put_replaces_and_delete_removes(store):
    put(store, 1)
    other = bf16_block(9)
    assert store.put(key_of(1), other, dtype="bfloat16", shape=SHAPE, token_count=3)
    assert store.get(key_of(1)).token_count == 3
    assert store.stats()["blocks"] == 1
    assert store.delete(key_of(1)) and not store.delete(key_of(1))
    assert list(store.directory.iterdir()) == [] and store.stats()["bytes_on_disk"] == 0


def test_fsync_mode_writes_the_same_file(tmp_path):
    store = DiskStore(tmp_path, NAMESPACE, capacity_bytes=1 << 20, fsync=True)
    assert put(store, 1) and store.get(key_of(1)) is not None


def test_concurrent_puts_and_gets_keep_the_books(tmp_path):
    capacity = 6 * block_file_size(1)
    store = DiskStore(tmp_path, NAMESPACE, capacity_bytes=capacity)
    errors: list[BaseException] = []

    def worker(offset: int) -> None:
        try:
            for i in range(offset, offset + 40):
                put(store, i % 12)
                block = store.get(key_of((i * 7) % 12))
                if block is not None:
                    assert block.payload.tobytes() == bf16_block((i * 7) % 12).tobytes()
        except BaseException as exc:  # surfaced below
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(n * 5,)) for n in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert not errors
    stats = store.stats()
    files = list(store.directory.iterdir())
    assert stats["bytes_on_disk"] == sum(p.stat().st_size for p in files) <= capacity
    assert sorted(store.keys()) == sorted(bytes.fromhex(p.name.split(".")[0]) for p in files)
    assert stats["corrupt_files"] == 0


def test_make_namespace_is_stable_safe_and_distinct(tmp_path):
    base = make_namespace("mlx-community/Qwen3-0.6B-bf16", "bfloat16", "lhtd", 256)
    assert base == make_namespace("mlx-community/Qwen3-0.6B-bf16", "bfloat16", "lhtd", 256)
    assert base.startswith("qwen3-0.6b-bf16-bfloat16-256-")
    variants = {
        make_namespace("other/model", "bfloat16", "lhtd", 256),
        make_namespace("mlx-community/Qwen3-0.6B-bf16", "float16", "lhtd", 256),
        make_namespace("mlx-community/Qwen3-0.6B-bf16", "bfloat16", "hltd", 256),
        make_namespace("mlx-community/Qwen3-0.6B-bf16", "bfloat16", "lhtd", 16),
    }
    assert base not in variants and len(variants) == 4
    weird = make_namespace("../../..//ÜBER model!", "bfloat16", "x", 16)
    assert "/" not in weird and not weird.startswith(".")
    for name in (base, weird):  # the store accepts every name it makes
        assert DiskStore(tmp_path, name, capacity_bytes=1).directory.name == name


@pytest.mark.parametrize(
    "arguments",
    [("", "bfloat16", "x", 16), ("m", "bfloat16", "x", 0), ("m", "bfloat16", "x", True)],
)
def test_make_namespace_refuses_bad_input(arguments):
    with pytest.raises(ConfigError):
        make_namespace(*arguments)
