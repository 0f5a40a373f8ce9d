"""The compressed disk tier through the whole engine: a restart serves a 2048-token
prompt from disk with the same output; corrupt, truncated, missing and half-written
files, a missing directory and a full disk never change the output nor crash; bfloat16
KV compresses >= 1.25x and comes back into the pool byte for byte."""

from __future__ import annotations

import errno
import json
import random
import shutil
import subprocess
import sys
from pathlib import Path

import anyio
import pytest

import unikern
from tests.conftest import compare_greedy, reference_greedy
from unikern.stages.tiers.disk.store import SUFFIX, TMP_PREFIX, DiskStore

pytestmark = pytest.mark.anyio

SPEC = dict(family="llama", hidden_size=128, num_layers=2, num_heads=4, num_kv_heads=2,
            intermediate_size=256, vocab_size=1024, max_position_embeddings=4096,
            dtype="bfloat16", tie_word_embeddings=False, seed=1)
BLOCK = 256
PROMPT = [random.Random(11).randrange(5, 1000) for _ in range(2048)]
MAX_TOKENS = 8


def overrides(disk_path: Path, **disk) -> dict:
    return {
        "kv": {"kv_budget_bytes": 64 << 20, "host_bytes": 0},
        "disk": {"path": str(disk_path), **disk},
    }


def engine(model: str, disk_path: Path, **disk) -> unikern.Engine:
    return unikern.Engine.from_pipeline("generate-offload", model=model, overrides=overrides(disk_path, **disk))


async def pool_bytes(eng: unikern.Engine, hashes: list[bytes]) -> dict[bytes, bytes]:
    """The pool's bytes of each cached block named by `hashes`, read on the model thread."""
    from unikern.platform import shared_bridge
    from unikern.stages.tiers.block_io import BlockLayout, copy_out

    kv = eng._router.stages["kv"].kv
    ids = [kv.blocks.hash_to_block[h] for h in hashes]
    layout = BlockLayout.of(kv.pool)
    buffers = [layout.new_buffer() for _ in ids]
    await eng._router.resources["model"].thread.run(copy_out, kv.pool, shared_bridge(), ids, buffers)
    return {h: b.tobytes() for h, b in zip(hashes, buffers, strict=True)}


async def stores_done(eng: unikern.Engine) -> None:
    with anyio.fail_after(30):
        while True:
            stats = eng.stats()
            if not (stats["offload"]["queued_blocks"] or stats["offload"]["inflight_blocks"]
                    or stats["tiers"]["disk"]["pending_writes"]):
                return
            await anyio.sleep(0.02)


async def run_once(model: str, disk_path: Path, prompt=PROMPT, **disk):
    """One request in a fresh engine: (result, stats, pool bytes of its cached blocks)."""
    async with engine(model, disk_path, **disk) as eng:
        result = await eng.complete(prompt_tokens=prompt, max_tokens=MAX_TOKENS)
        await stores_done(eng)
        stats = eng.stats()
        books = eng._router.stages["kv"].kv.blocks
        cached = [h for h in books.prefix_hashes(prompt) if h in books.hash_to_block]
        contents = await pool_bytes(eng, cached)
    return result, stats, contents


def namespace_dir(root: Path) -> Path:
    (directory,) = [p for p in root.iterdir() if p.is_dir()]
    return directory


def block_files(root: Path, hashes: list[bytes]) -> list[Path]:
    return [namespace_dir(root) / (h.hex() + SUFFIX) for h in hashes]


class Cold:
    model: str
    root: Path  # a populated disk tier: copy it, never change it
    tokens: list[int]
    stats: dict
    contents: dict[bytes, bytes]
    hashes: list[bytes]


@pytest.fixture(scope="module")
def cold(tmp_path_factory) -> Cold:
    from unikern.testing.modelgen import cached_model

    c = Cold()
    c.model = str(cached_model(SPEC))
    c.root = tmp_path_factory.mktemp("disk-template") / "kv"
    result, c.stats, c.contents = anyio.run(lambda: run_once(c.model, c.root))
    c.tokens = result.token_ids
    assert result.usage.cached_tokens == 0
    c.hashes = list(c.contents)  # every block of the prompt, in order
    assert len(c.hashes) == len(PROMPT) // BLOCK
    return c


def copy_of(cold: Cold, tmp_path: Path) -> Path:
    root = tmp_path / "kv"
    shutil.copytree(cold.root, root)
    return root


def test_cold_run_matches_mlx_lm_and_writes_every_block(cold):
    ok, why = compare_greedy(cold.tokens, reference_greedy(cold.model, PROMPT, MAX_TOKENS))
    assert ok, why
    files = sorted(namespace_dir(cold.root).glob("*" + SUFFIX))
    assert len(files) == len(PROMPT) // BLOCK  # all 8 blocks, drained at shutdown
    assert {f.name for f in files} == {f.name for f in block_files(cold.root, cold.hashes)}
    assert oct(namespace_dir(cold.root).stat().st_mode & 0o777) == "0o700"
    assert all(f.stat().st_mode & 0o777 == 0o600 for f in files)


@pytest.mark.parametrize("anyio_backend", ["asyncio", "trio"])
async def test_restart_serves_the_prompt_from_disk_byte_for_byte(cold, tmp_path):
    root = copy_of(cold, tmp_path)
    result, stats, contents = await run_once(cold.model, root)
    assert result.usage.cached_tokens >= 1792
    assert result.token_ids == cold.tokens
    disk = stats["tiers"]["disk"]
    assert disk["hits"] == 7 and disk["corrupt_files"] == 0
    # what came back into the pool is exactly what the cold run computed
    loaded = cold.hashes[:7]
    assert all(contents[h] == cold.contents[h] for h in loaded)
    assert stats["bridge"]["copies"] == 0


async def test_bfloat16_kv_compresses_at_least_1_25x(cold):
    disk = cold.stats["tiers"]["disk"]
    assert disk["compression_ratio"] >= 1.25, disk
    assert disk["files"] == 8 and disk["bytes"] == 8 * len(cold.contents[cold.hashes[0]])
    raw = sum(len(c) for c in cold.contents.values())
    on_disk = sum(f.stat().st_size for f in block_files(cold.root, cold.hashes))
    assert raw / on_disk >= 1.25, (raw, on_disk)


async def test_flipped_truncated_and_bad_header_files_are_misses(cold, tmp_path):
    root = copy_of(cold, tmp_path)
    files = block_files(root, cold.hashes)
    body = bytearray(files[3].read_bytes())
    body[-100] ^= 0x01  # a bit in the zstd body of block 3: found when read
    files[3].write_bytes(bytes(body))
    files[5].write_bytes(files[5].read_bytes()[:1000])  # truncated: found at start-up
    header = bytearray(files[6].read_bytes())
    header[8] ^= 0xFF  # the header: found at start-up
    files[6].write_bytes(bytes(header))
    result, stats, _ = await run_once(cold.model, root)
    assert result.token_ids == cold.tokens
    assert result.usage.cached_tokens == 3 * BLOCK  # the chain breaks at block 3
    disk = stats["tiers"]["disk"]
    assert disk["corrupt_files"] == 3
    # block 3 failed, so block 4 (read next) was useless; 5 and 6 were gone at start-up
    assert stats["offload"]["load_failures"] == 2
    # the bad files are gone and the recomputed blocks were stored again
    assert all(f.exists() for f in files)


async def test_a_file_deleted_behind_the_index_is_a_miss(cold, tmp_path):
    root = copy_of(cold, tmp_path)
    async with engine(cold.model, root) as eng:
        block_files(root, cold.hashes)[1].unlink()  # after start-up: the index still has it
        result = await eng.complete(prompt_tokens=PROMPT, max_tokens=MAX_TOKENS)
    assert result.token_ids == cold.tokens
    assert result.usage.cached_tokens == BLOCK


async def test_missing_directory_is_created_and_one_removed_while_running_is_survived(cold, tmp_path):
    root = tmp_path / "does" / "not" / "exist"
    prompt = PROMPT[:600]
    expected = reference_greedy(cold.model, prompt, MAX_TOKENS)
    async with engine(cold.model, root) as eng:
        first = await eng.complete(prompt_tokens=prompt, max_tokens=MAX_TOKENS)
        with anyio.fail_after(20):
            while eng.stats()["tiers"]["disk"]["files"] < 2:  # noqa: ASYNC110 (polling stats)
                await anyio.sleep(0.05)
        shutil.rmtree(root)
        eng._router.stages["kv"].kv.blocks.evict_all_cached()
        second = await eng.complete(prompt_tokens=prompt, max_tokens=MAX_TOKENS)
        stats = eng.stats()
    for result in (first, second):
        assert compare_greedy(result.token_ids, expected)[0]
    assert second.usage.cached_tokens == 0  # the files went with the directory: misses
    assert stats["tiers"]["disk"]["hits"] == 0


async def test_full_disk_is_counted_and_changes_nothing(cold, tmp_path, monkeypatch):
    def disk_full(self, path, data, fsync):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(DiskStore, "_write_file", disk_full)
    prompt = PROMPT[:600]
    async with engine(cold.model, tmp_path / "kv") as eng:
        first = await eng.complete(prompt_tokens=prompt, max_tokens=MAX_TOKENS)
        second = await eng.complete(prompt_tokens=prompt, max_tokens=MAX_TOKENS)
        await stores_done(eng)
        stats = eng.stats()
    assert compare_greedy(first.token_ids, reference_greedy(cold.model, prompt, MAX_TOKENS))[0]
    # device tier: 2 whole blocks, and 5 kernel blocks the first run's last block kept
    assert second.token_ids == first.token_ids and second.usage.cached_tokens == 512 + 80
    disk = stats["tiers"]["disk"]
    assert disk["write_errors"] == 2 and disk["files"] == 0
    assert not list((tmp_path / "kv").rglob(TMP_PREFIX + "*"))


def kill_worker_after_prefill(model: str, root: Path) -> None:
    """A worker prefills PROMPT, starts storing its blocks, and is SIGKILLed."""
    args = [sys.executable, "-m", "unikern", "worker", "generate-offload", "--model", model,
            "--set", f"disk.path={root}", "--set", "kv.kv_budget_bytes=67108864"]
    with subprocess.Popen(args, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL) as proc:
        try:
            assert json.loads(proc.stdout.readline())["event"] == "ready"
            request = {"op": "generate", "id": "r", "prompt_tokens": PROMPT, "max_tokens": 64}
            proc.stdin.write(json.dumps(request).encode() + b"\n")
            proc.stdin.flush()
            assert json.loads(proc.stdout.readline())["event"] == "token"  # the prefill is done
        finally:
            proc.kill()


async def test_worker_killed_mid_write_leaves_a_usable_tier(cold, tmp_path):
    """SIGKILL a worker while it stores blocks; add a stray temp file as a half-written
    block would leave; the next engine sweeps it and serves the same tokens."""
    root = tmp_path / "kv"
    await anyio.to_thread.run_sync(kill_worker_after_prefill, cold.model, root)
    directory = namespace_dir(root)
    (directory / f"{TMP_PREFIX}0123456789abcdef").write_bytes(b"half a block")
    result, stats, _ = await run_once(cold.model, root)
    assert result.token_ids == cold.tokens
    disk = stats["tiers"]["disk"]
    assert disk["swept_tmp_files"] >= 1 and disk["corrupt_files"] == 0
    assert not list(directory.glob(TMP_PREFIX + "*"))
    assert result.usage.cached_tokens == BLOCK * disk["hits"]


async def test_an_unusable_path_is_a_clear_start_up_error(cold, tmp_path):
    not_a_directory = tmp_path / "file"
    not_a_directory.write_text("x")
    with pytest.raises(unikern.UnikernError, match="disk.path"):
        async with engine(cold.model, not_a_directory):
            pass


async def test_a_failing_disk_read_is_a_miss_not_a_stuck_request(cold, tmp_path, monkeypatch):
    from unikern.stages.tiers.disk.service import DiskTier

    def broken(self, block_hash, out):
        raise RuntimeError("simulated bug in the read path")

    monkeypatch.setattr(DiskTier, "read", broken)
    root = copy_of(cold, tmp_path)
    with anyio.fail_after(60):
        result, stats, _ = await run_once(cold.model, root)
    assert result.token_ids == cold.tokens and result.usage.cached_tokens == 0
    assert stats["offload"]["load_failures"] == 7
