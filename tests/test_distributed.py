"""Two ranks over MLX's ring backend on loopback (issue 18): tensor and pipeline parallel
give mlx-lm's greedy tokens (one rank, unsharded) with 14 requests in flight, prefix
hits and preemption; a rank killed mid-request fails every request, naming the rank,
and the worker exits non-zero."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest

import unikern
from tests.conftest import compare_greedy, reference_greedy

MODELS = {
    "llama": "tiny-llama",  # 4 layers, 4 heads, 2 kv heads
    "qwen3": dict(family="qwen3", hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2,
                  intermediate_size=192, vocab_size=1024, dtype="float32", tie_word_embeddings=False, seed=0),
}
# ring on this CPU; on a 2-GPU machine UNIKERN_TEST_BACKEND=nccl runs the same checks over NCCL
BACKEND = os.environ.get("UNIKERN_TEST_BACKEND", "ring")
GEOMETRY = {"llama": (4, 2, 32), "qwen3": (2, 2, 16)}  # layers, kv heads, head dim
BLOCK = 16
MAX_TOKENS = 12
PREFIX = [(11 * j) % 1000 + 7 for j in range(2 * BLOCK)]


def prompts() -> list[list[int]]:
    """14 prompts of 5-56 tokens; every other one continues the shared prefix."""
    out = []
    for i in range(14):
        own = [(7 * i + 13 * j) % 1000 + 5 for j in range(5 + 3 * i)]
        out.append(PREFIX + own[:8] if i % 2 else own)
    return out


def overrides(family: str, mode: str, num_blocks: int) -> dict:
    layers, kv_heads, head_dim = GEOMETRY[family]
    # rank 0's pool: tensor parallel halves its kv heads, pipeline parallel its layers
    layers, kv_heads = (layers, kv_heads // 2) if mode == "tensor" else (layers // 2, kv_heads)
    bytes_per_block = 2 * layers * BLOCK * kv_heads * head_dim * 4
    return {
        "kv": {"kv_budget_bytes": num_blocks * bytes_per_block, "block_size": BLOCK, "kernel_block_size": BLOCK},
        "schedule": {"max_num_batched_tokens": 96, "decode_lookahead": 4},
        "execute": {f"{mode}_parallel": 2, "distributed_backend": BACKEND},
    }


# MLX keeps one distributed group per process, so each engine of several ranks runs in a
# process of its own: this script, which prints its results and stats as JSON
ENGINE_SCRIPT = """
import json, sys, time, anyio, unikern
from tests.conftest import complete_all
path, overrides, prefix, batch, max_tokens = json.loads(sys.argv[1])

async def main():
    async with unikern.Engine.from_pipeline("generate", model=path, overrides=overrides) as engine:
        warm = await engine.complete(prompt_tokens=prefix + [3, 4], max_tokens=2)  # the prefix, cached
        results = await complete_all(engine, batch, max_tokens)
        time.sleep(0.3)  # per-rank figures are gathered after a step at most every 0.25 s
        await engine.complete(prompt_tokens=[5, 6, 7], max_tokens=2)
        stats = engine.stats()
    print(json.dumps({"warm": warm.token_ids, "tokens": [r.token_ids for r in results],
                      "cached": [r.usage.cached_tokens for r in results], "stats": stats}, default=str))

anyio.run(main)
"""


def run_engine(path: str, overrides: dict, batch: list[list[int]]) -> dict:
    args = json.dumps([path, overrides, PREFIX, batch, MAX_TOKENS])
    done = subprocess.run([sys.executable, "-c", ENGINE_SCRIPT, args], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("mode", ["tensor", "pipeline"])
@pytest.mark.parametrize("family", list(MODELS))
def test_two_ranks_match_one(family, mode, model_dir):
    path = model_dir(MODELS[family])
    batch = prompts()
    out = run_engine(path, overrides(family, mode, 14), batch)
    stats = out["stats"]
    world = stats["platform"]["world"]
    assert (world["backend"], world["size"], world["rank"], world["mode"]) == (BACKEND, 2, 0, mode)
    ranks = stats["kv"]["ranks"]
    assert [r["rank"] for r in ranks] == [0, 1] and ranks[0]["pid"] != ranks[1]["pid"]
    assert ranks[0]["pool_blocks"] == ranks[1]["pool_blocks"] == stats["kv"]["blocks_total"] + 2  # + 2 reserved
    if mode == "tensor":  # kv heads split, every layer on each rank
        assert ranks[0]["num_kv_heads"] == ranks[1]["num_kv_heads"] == GEOMETRY[family][1] // 2
    else:  # layers split, every kv head on each rank
        assert ranks[0]["num_layers"] + ranks[1]["num_layers"] == GEOMETRY[family][0]
    assert ranks[1]["blocks_allocated"] > 0
    assert stats["schedule"]["preemptions"] > 0
    assert sum(out["cached"]) >= BLOCK
    assert out["warm"] == reference_greedy(path, PREFIX + [3, 4], 2).tokens
    for prompt, tokens in zip(batch, out["tokens"], strict=True):  # near-ties: counted (conftest)
        ok, note = compare_greedy(tokens, reference_greedy(path, prompt, MAX_TOKENS))
        assert ok, f"{family} {mode} parallel, prompt of {len(prompt)} tokens: {note}"


@pytest.mark.parametrize("mode", ["tensor", "pipeline"])
def test_every_rank_copies_partial_prefix_hits(mode, model_dir):
    """Prompts going on from the cached prefix's second block mid-way reuse its leading
    4-token kernel blocks by a copy in each rank's pool (Step.copies): a rank that skipped
    it would attend to zeros there, in its half of the heads or layers."""
    path = model_dir(MODELS["llama"])
    batch = [PREFIX[:n] + [(5 * n + 3 * j) % 1000 + 5 for j in range(6)] for n in (21, 25, 29, 30)]
    settings = overrides("llama", mode, 14)
    settings["kv"]["kernel_block_size"] = 4
    out = run_engine(path, settings, batch)
    assert out["cached"] == [20, 24, 28, 28]  # block 0 whole, then 1-3 kernel blocks of block 1
    assert out["stats"]["tiers"]["device"]["partial_hits"] == len(batch)
    for prompt, tokens in zip(batch, out["tokens"], strict=True):
        ok, note = compare_greedy(tokens, reference_greedy(path, prompt, MAX_TOKENS))
        assert ok, f"{mode} parallel, prompt of {len(prompt)} tokens: {note}"


@pytest.mark.anyio
async def test_one_world_per_process(tiny_llama):
    """MLX keeps its first group for the process: a second world is refused, by reason."""
    from unikern.stages.execute import launch

    launch._worlds_started, before = 1, launch._worlds_started
    try:
        with pytest.raises(unikern.UnikernError, match="in a process of its own"):
            async with unikern.Engine.from_pipeline("generate", model=tiny_llama,
                                                    overrides={"execute": {"tensor_parallel": 2}}):
                pass
    finally:
        launch._worlds_started = before


def test_a_killed_rank_fails_every_request_and_the_worker_exits_non_zero(tiny_llama):
    proc = subprocess.Popen(
        [sys.executable, "-m", "unikern", "worker", "--model", tiny_llama, "--set", "execute.tensor_parallel=2",
         "--set", f"kv.kv_budget_bytes={16 << 20}"],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )
    try:
        assert json.loads(proc.stdout.readline())["event"] == "ready"
        proc.stdin.write(json.dumps({"op": "stats"}) + "\n")
        proc.stdin.flush()
        stats = json.loads(proc.stdout.readline())
        follower = stats["platform"]["world"]["ranks"][1]["pid"]
        for i in range(4):
            line = {"op": "generate", "id": f"r{i}", "prompt_tokens": list(range(5, 20 + i)), "max_tokens": 1900}
            proc.stdin.write(json.dumps(line) + "\n")
        proc.stdin.flush()
        assert json.loads(proc.stdout.readline())["event"] == "token"  # generating
        os.kill(follower, signal.SIGKILL)
        killed = time.monotonic()
        errors = {}
        for line in proc.stdout:
            event = json.loads(line)
            if event["event"] == "error":
                errors[event["id"]] = event["message"]
            assert event["event"] != "done", event
        code = proc.wait(30)
        elapsed = time.monotonic() - killed
    finally:
        proc.kill()
        proc.wait()
        proc.stdin.close()
        proc.stdout.close()
        stderr = proc.stderr.read()
        proc.stderr.close()
    assert sorted(errors) == ["r0", "r1", "r2", "r3"], stderr[-2000:]
    for message in errors.values():
        assert f"rank 1 (pid {follower}) exited with code -9 during step" in message, message
    assert code != 0 and elapsed < 20, (code, elapsed)


def test_ranks_started_by_hand_join_through_a_hostfile(tiny_llama, tmp_path):
    """The two-machine recipe on one machine: rank 1 started by hand with MLX_RANK and the
    hostfile, rank 0 (the worker) given the same hostfile; rank 0 starts no process."""
    from unikern.stages.execute.launch import _free_ports

    hostfile = tmp_path / "hosts.json"
    hostfile.write_text(json.dumps([[f"127.0.0.1:{p}"] for p in _free_ports(2)]))
    env = {**os.environ, "MLX_RANK": "1", "MLX_HOSTFILE": str(hostfile)}
    follower = subprocess.Popen([sys.executable, "-m", "unikern.stages.execute.follower", "--backend", "ring"],
                                env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    prompt = list(range(5, 40))
    line = json.dumps({"op": "generate", "id": "a", "prompt_tokens": prompt, "max_tokens": 10})
    try:
        done = subprocess.run(
            [sys.executable, "-m", "unikern", "worker", "--model", tiny_llama, "--set", "execute.tensor_parallel=2",
             "--set", f"execute.hostfile={hostfile}", "--set", f"kv.kv_budget_bytes={16 << 20}"],
            input=line + "\n", capture_output=True, text=True, timeout=120,
        )
        assert follower.wait(30) == 0  # rank 0 told it to stop
    finally:
        follower.kill()
        follower.wait()
    assert done.returncode == 0, done.stderr[-2000:]
    assert hostfile.exists()  # the user's file: rank 0 removes only the loopback files it wrote
    events = [json.loads(x) for x in done.stdout.splitlines()]
    tokens = [e["token_id"] for e in events if e["event"] == "token"]
    ok, note = compare_greedy(tokens, reference_greedy(tiny_llama, prompt, 10))
    assert ok, note


def test_an_operation_longer_than_a_frame_takes_a_second_collective():
    """What rank 0 sends is what a rank receives, past FRAME_BYTES too; callables stay home."""
    from unikern import messages as m
    from unikern.stages.execute.distributed import FRAME_BYTES, RunStep, World, for_the_wire

    sums: list[bytes] = []

    class Loopback(World):  # the collective of a world of one: rank 0's bytes come back
        def _all_sum(self, data):
            if isinstance(data, int):
                return sums.pop(0)
            sums.append(data)
            return data

    world = Loopback(group=None, backend="ring", rank=0, size=2, mode="tensor")
    params = m.SamplingParams(max_tokens=4, response_format={"type": "json_object"})
    work = tuple(m.SeqWork(f"r{i}", (1, 2, 3), 0, tuple(range(1000, 1600)), True, params, processors=(print,))
                 for i in range(12))
    step = m.Step(7, work, 1)
    world.send(RunStep(for_the_wire(step), {"r0": 5}))
    assert len(sums) == 2 and len(sums[0]) == FRAME_BYTES  # a frame, then the rest
    got = world.receive()
    assert got.seeds == {"r0": 5} and got.step.step_id == 7 and world.step_id == 7
    assert got.step.work[3].block_table == tuple(range(1000, 1600)) and got.step.work[3].processors == ()
    assert got.step.work[0].params.response_format == {"type": "json_object"}


def test_the_kv_tiers_are_refused_with_several_ranks():
    """Tier moves read and write rank 0's pool only: refused at start-up, by name."""
    from types import SimpleNamespace

    from unikern.errors import ConfigError
    from unikern.stages.tiers.disk.service import refuse_several_ranks

    refuse_several_ranks(SimpleNamespace(world=None), "disk_tier")  # one rank: fine
    with pytest.raises(ConfigError, match=r"offload_mover: the KV tiers do not run with several ranks.*give 2"):
        refuse_several_ranks(SimpleNamespace(world=SimpleNamespace(size=2)), "offload_mover")


def test_a_recurrent_model_is_refused_on_several_ranks():
    """Followers build no state pool (nor a windowed layers' pool): a hybrid model on
    several ranks is refused at start, by name, instead of running wrong."""
    from unikern.testing.families import cached_family_model

    path = str(cached_family_model("tiny-qwen3-next"))
    overrides = {"execute": {"pipeline_parallel": 2, "distributed_backend": BACKEND}}
    args = json.dumps([path, overrides, PREFIX, [[5, 6, 7]], 2])
    done = subprocess.run([sys.executable, "-c", ENGINE_SCRIPT, args], capture_output=True, text=True, timeout=120)
    assert done.returncode != 0
    assert "several ranks serve models with one attention-layer group and no recurrent layers" in done.stderr
    assert "qwen3_next has ArraysCache layers" in done.stderr


def test_tensor_parallel_routes_every_quantized_shard():
    """mlx-lm's shard turns quantized layers into sharded classes of its own: each rank
    routes those too (execute.dequantize_rows), and the tokens stay mlx-lm's."""
    from unikern.testing.families import cached_quantized

    path = str(cached_quantized("tiny-llama", 4))
    batch = prompts()[:10]  # 10 rows per decode step: the dequantized path
    out = run_engine(path, {"execute": {"tensor_parallel": 2, "distributed_backend": BACKEND}}, batch)
    quantized = out["stats"]["model"]["quantized"]
    assert quantized["dequantize_rows"] == 8
    assert quantized["routed_layers"] == 4 * 7 + 1  # q, k, v, o, gate, up, down per layer + lm_head
    for prompt, tokens in zip(batch, out["tokens"], strict=True):
        ok, note = compare_greedy(tokens, reference_greedy(path, prompt, MAX_TOKENS))
        assert ok, f"4-bit tensor parallel, prompt of {len(prompt)} tokens: {note}"


def test_a_rank_other_than_0_refuses_a_one_rank_command():
    """Under mlx.launch, a command without tensor/pipeline_parallel would leave ranks > 0
    waiting forever for a rank 0 that serves alone: refused at once, by setting."""
    env = dict(os.environ, MLX_RANK="1")
    done = subprocess.run([sys.executable, "-m", "unikern", "run", "--prompt", "x"], env=env,
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 2
    assert "MLX_RANK=1" in done.stderr and "execute.tensor_parallel or execute.pipeline_parallel" in done.stderr


def test_generate_offload_is_refused_on_several_ranks(model_dir):
    """The disk tier and the mover would move rank 0's blocks only: the start fails, by name."""
    script = ENGINE_SCRIPT.replace('"generate"', '"generate-offload"')
    overrides = {"execute": {"tensor_parallel": 2, "distributed_backend": BACKEND}}
    args = json.dumps([model_dir(MODELS["llama"]), overrides, PREFIX, [[5, 6, 7]], 2])
    done = subprocess.run([sys.executable, "-c", script, args], capture_output=True, text=True, timeout=120)
    assert done.returncode != 0
    assert "the KV tiers do not run with several ranks" in done.stderr


def test_auto_backend_is_ring_where_a_hostfile_describes_the_world(monkeypatch):
    """On a CUDA machine "auto" means nccl, unless the world comes from a hostfile (the
    two-machine recipe): that is ring's format, so both ends pick ring."""
    import mlx.core as mx

    from unikern.stages.execute import launch

    monkeypatch.setattr(launch.mx, "default_device", lambda: mx.gpu)
    monkeypatch.setattr(launch.mx.cuda, "is_available", lambda: True)
    monkeypatch.delenv("MLX_HOSTFILE", raising=False)
    assert launch.resolve_backend("auto") == "nccl"
    assert launch.resolve_backend("auto", "hosts.json") == "ring"  # rank 0: execute.hostfile
    monkeypatch.setenv("MLX_HOSTFILE", "hosts.json")  # a rank started by hand
    assert launch.resolve_backend("auto") == "ring"
    assert launch.resolve_backend("nccl", "hosts.json") == "nccl"  # asked for by name
