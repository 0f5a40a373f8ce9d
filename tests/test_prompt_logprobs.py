"""Prompt log-probabilities (`prompt_logprobs`; HTTP `echo` + `logprobs`) against mlx-lm's
own forward over the whole prompt (`model(mx.array([tokens]))`, log-softmax in float32),
within 1e-4: through the library, the worker and `/v1/completions`, with chunked prefill
(schedule.max_prefill_chunk below the prompt's length) and with the prompt's blocks in
the prefix cache (a request that asks reads no cached prefix: it computes every position)."""

from __future__ import annotations

import json
import subprocess
import sys

import anyio
import httpx
import msgspec
import numpy as np
import pytest

import unikern
from tests.conftest import compare_greedy, reference_greedy
from tests.http_support import API_KEY, running_server
from tests.test_families import family_model
from unikern import messages as m
from unikern.engine import Engine
from unikern.frontends.http.params import ServerParams

TOLERANCE = 1e-4
PROMPT = [(13 * j) % 1000 + 7 for j in range(70)]  # 70 tokens: 5 chunks of 16, 4 full blocks of 16
# kv blocks of 16 tokens, so that 70 tokens fill four cached blocks; chunks of 16
OVERRIDES = {"kv": {"kv_budget_bytes": 64 << 20, "block_size": 16}, "schedule": {"max_prefill_chunk": 16}}

_MODELS: dict[str, tuple] = {}


def reference(path: str, tokens: list[int]) -> np.ndarray:
    """[len(tokens), vocab]: mlx-lm's log-probabilities at every position of one forward."""
    import mlx.core as mx
    from mlx_lm import load

    if path not in _MODELS:
        _MODELS[path] = load(path)
    logits = _MODELS[path][0](mx.array([tokens]))[0].astype(mx.float32)
    return np.array(logits - mx.logsumexp(logits, axis=-1, keepdims=True))


def reference_in_pieces(path: str, tokens: list[int], piece: int) -> np.ndarray:
    """reference() with mlx-lm's forward run `piece` tokens at a time on its own cache."""
    import mlx.core as mx
    from mlx_lm.models.cache import make_prompt_cache

    model = _MODELS[path][0]
    cache = make_prompt_cache(model)
    logits = mx.concatenate([model(mx.array([tokens[s : s + piece]]), cache=cache)[0]
                             for s in range(0, len(tokens), piece)]).astype(mx.float32)
    return np.array(logits - mx.logsumexp(logits, axis=-1, keepdims=True))


def check(reports: list, tokens: list[int], ref: np.ndarray, top: int, tolerance: float = TOLERANCE) -> None:
    """Reports as the done event gives them (structs, or their JSON as dicts)."""
    get = (lambda r, k: r[k]) if isinstance(reports[1], dict) else getattr
    assert reports[0] is None and len(reports) == len(tokens)
    for p in range(1, len(tokens)):
        r, dist = reports[p], ref[p - 1]
        assert get(r, "token_id") == tokens[p]
        assert abs(get(r, "logprob") - dist[tokens[p]]) < tolerance, (p, get(r, "logprob"), dist[tokens[p]])
        listed = get(r, "top_logprobs")
        ids, values = [get(x, "token_id") for x in listed], [get(x, "logprob") for x in listed]
        assert len(ids) == top and values == sorted(values, reverse=True), p
        best = np.sort(dist)[::-1][:top]
        assert np.allclose(values, best, atol=tolerance, rtol=0.0), p
        # the ids are the reference's top ones, but for ties at the cut
        for token, value in zip(ids, values, strict=True):
            assert abs(dist[token] - value) < tolerance and (top == 0 or dist[token] >= best[-1] - tolerance)


# ---- library ------------------------------------------------------------------------------


@pytest.mark.anyio
async def test_library_prompt_logprobs_with_chunks_and_a_prefix_hit(tiny_llama):
    """The 70-token prompt runs in chunks of 16. Asked again after a plain request of the
    same prompt (which is served 64 tokens from the cache), the reports are the same
    (that request reads no cached prefix), and so are the generated tokens (mlx-lm's)."""
    ref = reference(tiny_llama, PROMPT)
    async with unikern.Engine.from_pipeline("generate", model=tiny_llama, overrides=OVERRIDES) as eng:
        cold = await eng.complete(prompt_tokens=PROMPT, max_tokens=4, prompt_logprobs=5)
        plain = await eng.complete(prompt_tokens=PROMPT, max_tokens=4)
        warm = await eng.complete(prompt_tokens=PROMPT, max_tokens=4, prompt_logprobs=5)
        alone = await eng.complete(prompt_tokens=PROMPT, max_tokens=0, prompt_logprobs=0)
    assert plain.usage.cached_tokens == 64 and plain.prompt_logprobs is None  # the prompt does hit
    assert warm.usage.cached_tokens == 0
    for result in (cold, warm):
        check(list(result.prompt_logprobs), PROMPT, ref, top=5)
        assert result.token_ids == plain.token_ids
    ok, note = compare_greedy(cold.token_ids, reference_greedy(tiny_llama, PROMPT, 4))
    assert ok, note
    # max_tokens 0: the prompt alone
    assert alone.finish_reason == "length" and alone.token_ids == [] and alone.usage.completion_tokens == 0
    check(list(alone.prompt_logprobs), PROMPT, ref, top=0)


@pytest.mark.anyio
async def test_batched_prompts_each_get_their_own(tiny_llama):
    """Prompts of different lengths in one padded prefill group, with one that does not
    ask: each report is its own prompt's; a one-token prompt has only the null entry."""
    prompts = [PROMPT[:30], PROMPT[5:33], PROMPT[:29], PROMPT[:1]]
    asks = [3, 1, None, 2]
    overrides = {"kv": OVERRIDES["kv"]}
    async with unikern.Engine.from_pipeline("generate", model=tiny_llama, overrides=overrides) as eng:
        results = [None] * len(prompts)

        async def one(i: int) -> None:
            extra = {} if asks[i] is None else {"prompt_logprobs": asks[i]}
            results[i] = await eng.complete(prompt_tokens=prompts[i], max_tokens=2, **extra)

        async with anyio.create_task_group() as tg:
            for i in range(len(prompts)):
                tg.start_soon(one, i)
    for i in (0, 1):
        check(list(results[i].prompt_logprobs), prompts[i], reference(tiny_llama, prompts[i]), top=asks[i])
    assert results[2].prompt_logprobs is None
    assert results[3].prompt_logprobs == (None,)


@pytest.mark.anyio
@pytest.mark.parametrize("family", ["qwen3-next", "gemma3"])
async def test_families_with_state_checkpoints_and_windows(family):
    """A hybrid recurrent model (its chunks run in pieces to the state checkpoints at block
    boundaries) and a sliding-window one, each with a prefix in the cache. The recurrent
    model is held within what mlx-lm's own forward moves by when it runs the prompt in the
    same pieces (at least TOLERANCE): its gated delta rule rounds otherwise in pieces, by
    more on some CPUs' BLAS kernels than 1e-4 (on one 2-core EPYC host mlx-lm itself moved
    by 1.0e-3 in pieces of 16, and unikern was 2.1e-4 from its whole forward; gemma3 3e-6)."""
    path = family_model(family)
    prompt = PROMPT + PROMPT[:30]  # 100 tokens: past gemma3's window of 48
    overrides = {"kv": OVERRIDES["kv"], "schedule": {"max_prefill_chunk": 40}}
    async with unikern.Engine.from_pipeline("generate", model=path, overrides=overrides) as eng:
        plain = await eng.complete(prompt_tokens=prompt, max_tokens=2)
        again = await eng.complete(prompt_tokens=prompt, max_tokens=2)
        asked = await eng.complete(prompt_tokens=prompt, max_tokens=2, prompt_logprobs=2)
    assert again.usage.cached_tokens > 0, again.usage
    whole = reference(path, prompt)
    tolerance = TOLERANCE
    if family == "qwen3-next":  # (16: the checkpoints' block size, OVERRIDES)
        tolerance = max(TOLERANCE, float(np.abs(reference_in_pieces(path, prompt, 16) - whole).max()))
    check(list(asked.prompt_logprobs), prompt, whole, top=2, tolerance=tolerance)
    assert asked.token_ids == plain.token_ids


@pytest.mark.anyio
async def test_tiered_pipeline_after_a_restart(tiny_llama, tmp_path):
    """generate-offload: a second engine finds the prompt's blocks on disk alone; a request
    that asks loads none of them (it reads no cached prefix)."""
    overrides = {"kv": {**OVERRIDES["kv"], "host_bytes": 0}, "schedule": OVERRIDES["schedule"],
                 "disk": {"path": str(tmp_path / "kv")}}
    async with unikern.Engine.from_pipeline("generate-offload", model=tiny_llama, overrides=overrides) as eng:
        await eng.complete(prompt_tokens=PROMPT, max_tokens=1)
    async with unikern.Engine.from_pipeline("generate-offload", model=tiny_llama, overrides=overrides) as eng:
        on_disk = eng.stats()["tiers"]["disk"]["files"]
        asked = await eng.complete(prompt_tokens=PROMPT, max_tokens=1, prompt_logprobs=1)
        loads = eng.stats()["offload"]["loads_requested"]
    assert on_disk == 4 and loads == 0 and asked.usage.cached_tokens == 0
    check(list(asked.prompt_logprobs), PROMPT, reference(tiny_llama, PROMPT), top=1)


@pytest.mark.anyio
async def test_prompt_logprobs_are_checked(tiny_llama):
    async with unikern.Engine.from_pipeline("generate", model=tiny_llama, overrides=OVERRIDES) as eng:
        with pytest.raises(unikern.RequestError, match="prompt_logprobs"):
            eng.generate(prompt_tokens=[1, 2], prompt_logprobs=21)
        with pytest.raises(unikern.RequestError, match="max_tokens"):
            eng.generate(prompt_tokens=[1, 2], max_tokens=0)  # 0 only with prompt_logprobs
        events = [e async for e in eng.generate(prompt_tokens=[5, 6, 7], max_tokens=1)]
    assert isinstance(events[-1], m.DoneEvent) and events[-1].prompt_logprobs is None
    assert "prompt_logprobs" not in json.loads(msgspec.json.encode(events[-1]))  # the done event as it was


def test_runner_paths_of_a_gpu_take_the_asking_rows_op_by_op(tiny_llama):
    """The runner with the prefill options a GPU turns on (traced prefills, prompts by rows
    through the paged attention, here in its reference ops): an asking prompt's chunks run
    op by op (every position's logits), a plain one still by rows; the first chunk's last
    position reports the second chunk's first token, the second chunk samples."""
    from mlx_lm import load

    from unikern.stages.execute.model import ModelGeometry
    from unikern.stages.execute.runner import ModelRunner
    from unikern.stages.kv.pool import KVPool

    model, _ = load(tiny_llama)
    geo = ModelGeometry(model)
    pool = KVPool(num_layers=geo.num_layers, num_kv_heads=geo.num_kv_heads, head_dim=geo.head_dim, dtype=geo.dtype,
                  block_size=16, kernel_block_size=16, num_blocks=64, slab_blocks=64)
    runner = ModelRunner(model, pool, compile_decode=True, paged_attention=True, prefill_rows=64, compile_prefill=True)
    assert runner.compiled_prefill is not None and runner.prefill_rows == 64
    asks, table = m.SamplingParams(max_tokens=4, prompt_logprobs=2), tuple(range(2, 7))
    first = runner.execute(m.Step(1, (m.SeqWork("a", tuple(PROMPT[:30]), 0, table, False, asks,
                                                prompt_targets=tuple(PROMPT[1:31])),), 1), {})
    plain = m.SeqWork("b", tuple(PROMPT[:30]), 0, tuple(range(7, 12)), True, m.SamplingParams(max_tokens=4))
    assert runner.execute(m.Step(2, (plain,), 1), {}).sampled["b"]
    second = runner.execute(m.Step(3, (m.SeqWork("a", tuple(PROMPT[30:40]), 30, table, True, asks,
                                                 prompt_targets=tuple(PROMPT[31:40])),), 1), {})
    assert runner.row_prefills == 1 and runner.compiled_prefill.forwards == 0 and second.sampled["a"]
    reports = [None, *first.prompt_logprobs["a"], *second.prompt_logprobs["a"]]
    check(reports, PROMPT[:40], reference(tiny_llama, PROMPT[:40]), top=2)


# ---- worker -------------------------------------------------------------------------------


def test_worker_done_event_carries_them(tiny_llama):
    """The worker's generate op takes `prompt_logprobs`; the done event carries them as JSON:
    null, then {token_id, logprob, top_logprobs: [{token_id, logprob}]} per token. One
    request after the other, so that the second and third find the prompt's blocks cached."""
    args = [sys.executable, "-m", "unikern", "worker", "--model", tiny_llama, "--set", "kv.kv_budget_bytes=67108864",
            "--set", "kv.block_size=16", "--set", "schedule.max_prefill_chunk=16"]
    requests = [{"op": "generate", "id": rid, "prompt_tokens": PROMPT, "max_tokens": n, **extra}
                for rid, n, extra in (("a", 0, {"prompt_logprobs": 3}), ("plain", 2, {}),
                                      ("b", 2, {"prompt_logprobs": 3}))]
    events = []
    proc = subprocess.Popen(args, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
    try:
        assert json.loads(proc.stdout.readline())["event"] == "ready"
        for request in requests:
            proc.stdin.write(json.dumps(request).encode() + b"\n")
            proc.stdin.flush()
            while events[-1:] == [] or events[-1]["event"] not in ("done", "error"):
                events.append(json.loads(proc.stdout.readline()))
            events.append({"event": "-"})  # the next request's events begin after it
        proc.stdin.close()
        assert proc.wait(timeout=120) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        proc.stdout.close()
    ref = reference(tiny_llama, PROMPT)
    by_id = {e["id"]: e for e in events if e["event"] in ("done", "error")}
    assert all(e["event"] == "done" for e in by_id.values()), by_id
    assert by_id["a"]["finish_reason"] == "length" and by_id["a"]["usage"]["completion_tokens"] == 0
    assert by_id["plain"]["usage"]["cached_tokens"] == 64 and "prompt_logprobs" not in by_id["plain"]
    for rid in ("a", "b"):
        check(by_id[rid]["prompt_logprobs"], PROMPT, ref, top=3)
    assert not [e for e in events if e["event"] == "token" and e["id"] == "a"]


# ---- HTTP ---------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def served(tiny_llama):
    params = ServerParams(port=0, api_key=API_KEY)
    with running_server(
        lambda: Engine.from_pipeline("generate", model=tiny_llama, overrides=OVERRIDES), params, model_id="tiny"
    ) as running:
        yield running
    assert running.exit_code == 0


def completion(served, **body) -> dict:
    response = httpx.post(f"{served.url}/v1/completions", json={"model": "tiny", "temperature": 0, **body},
                          headers={"Authorization": f"Bearer {API_KEY}"}, timeout=120)
    assert response.status_code == 200, response.text
    return response.json()


def check_legacy(logprobs: dict, tokens: list[int], ref: np.ndarray, top: int, tokenizer) -> None:
    """OpenAI's legacy `logprobs` object over the prompt's tokens: their texts, null then
    each one's log-probability, null then {text: logprob} of the top ones, text offsets."""
    n = len(tokens)
    assert logprobs["tokens"][:n] == [tokenizer.decode([t]) for t in tokens]
    assert logprobs["token_logprobs"][0] is None and logprobs["top_logprobs"][0] is None
    for p in range(1, n):
        assert abs(logprobs["token_logprobs"][p] - ref[p - 1, tokens[p]]) < TOLERANCE, p
        values = sorted(logprobs["top_logprobs"][p].values(), reverse=True)
        # texts of distinct ids may coincide (then one entry): those it lists are the best
        assert len(values) <= top and np.allclose(values, np.sort(ref[p - 1])[::-1][: len(values)], atol=TOLERANCE)
    offsets = logprobs["text_offset"][:n]
    assert offsets[0] == 0 and all(b - a == len(t) for a, b, t in zip(offsets, offsets[1:], logprobs["tokens"], strict=False))


def test_http_echo_logprobs_with_and_without_a_prefix_hit(served, tiny_llama):
    """A text prompt, asked twice (the second time its blocks are cached), with max_tokens
    0 (the prompt alone) and 1 (lm-evaluation-harness's loglikelihood request: the prompt's
    entries, then the one generated token's)."""
    from mlx_lm import load

    tokenizer = load(tiny_llama)[1]
    text = "def fibonacci(n):\n    if n < 2:\n        return n\n    return fibonacci(n - 1) + fibonacci(n - 2)\n" * 2
    tokens = tokenizer.encode(text)
    assert len(tokens) > 32
    ref = reference(tiny_llama, tokens)
    alone = completion(served, prompt=text, echo=True, logprobs=2, max_tokens=0)
    plain = completion(served, prompt=text, max_tokens=1)
    one = completion(served, prompt=text, echo=True, logprobs=2, max_tokens=1)
    assert plain["usage"]["prompt_tokens_details"]["cached_tokens"] >= 32
    choice = alone["choices"][0]
    assert choice["text"] == text and choice["finish_reason"] == "length"
    assert alone["usage"]["completion_tokens"] == 0 and len(choice["logprobs"]["tokens"]) == len(tokens)
    check_legacy(choice["logprobs"], tokens, ref, 2, tokenizer)
    choice = one["choices"][0]
    assert choice["text"] == text + plain["choices"][0]["text"]
    assert len(choice["logprobs"]["tokens"]) == len(tokens) + 1
    check_legacy(choice["logprobs"], tokens, ref, 2, tokenizer)
    assert choice["logprobs"]["text_offset"][-1] == len(text)  # the generated token, in `text`


def test_http_echo_of_token_prompts_and_streams(served, tiny_llama):
    """A token-id prompt echoes its decoded text; streamed, the prompt's chunk comes first
    (with its logprobs, so it waits for the end); echo without logprobs adds the text only."""
    from mlx_lm import load

    tokenizer = load(tiny_llama)[1]
    prompt = PROMPT[:40]
    ref = reference(tiny_llama, prompt)
    whole = completion(served, prompt=prompt, echo=True, logprobs=1, max_tokens=3)
    assert whole["choices"][0]["text"].startswith(tokenizer.decode(prompt))
    check_legacy(whole["choices"][0]["logprobs"], prompt, ref, 1, tokenizer)
    body = {"model": "tiny", "prompt": prompt, "echo": True, "logprobs": 1, "max_tokens": 3, "temperature": 0, "stream": True}
    with httpx.stream("POST", f"{served.url}/v1/completions", json=body, headers={"Authorization": f"Bearer {API_KEY}"},
                      timeout=120) as response:
        chunks = [json.loads(x[5:]) for x in response.iter_lines() if x.startswith("data: {")]
    first = chunks[0]["choices"][0]
    assert first["text"] == tokenizer.decode(prompt)
    check_legacy(first["logprobs"], prompt, ref, 1, tokenizer)
    assert "".join(c["choices"][0]["text"] for c in chunks) == whole["choices"][0]["text"]
    bare = completion(served, prompt="def add(a, b):", echo=True, max_tokens=3)
    assert bare["choices"][0]["text"].startswith("def add(a, b):") and bare["choices"][0]["logprobs"] is None
    refused = httpx.post(f"{served.url}/v1/completions", json={"model": "tiny", "prompt": "x", "max_tokens": 0},
                         headers={"Authorization": f"Bearer {API_KEY}"}, timeout=60)
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "max_tokens"
