"""`unikern serve` over a real engine (tiny-llama), driven by the official `openai` and
`anthropic` clients and by raw httpx: every endpoint, streaming and not, errors in each
API's shape, disconnects, concurrency, and greedy parity with mlx-lm."""

from __future__ import annotations

import json
import time

import anthropic
import anyio
import httpx
import openai
import pytest

from tests.conftest import SMALL_KV, compare_greedy, reference_greedy
from tests.http_support import API_KEY, running_server
from unikern.engine import Engine
from unikern.frontends.http.params import ServerParams

MAX_BODY_BYTES = 64 << 10
# greedy tiny-llama does not reach EOS within 1500 tokens from these prompts
CHAT = [{"role": "user", "content": "hi"}]
PROMPT = "def add(a, b):"
# the anthropic client (2.x) no longer takes sampling keywords; the API still does
GREEDY = {"temperature": 0}


@pytest.fixture(scope="module")
def served(tiny_llama):
    params = ServerParams(port=0, api_key=API_KEY, max_body_bytes=MAX_BODY_BYTES)
    with running_server(
        lambda: Engine.from_pipeline("generate", model=tiny_llama, overrides=SMALL_KV), params, model_id="tiny"
    ) as running:
        yield running
    assert running.exit_code == 0


@pytest.fixture(scope="module")
def oa(served) -> openai.OpenAI:
    return served.openai()


@pytest.fixture(scope="module")
def an(served) -> anthropic.Anthropic:
    return served.anthropic()


def post(served, path: str, body, key: str | None = API_KEY, **kwargs) -> httpx.Response:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    return httpx.post(f"{served.url}{path}", content=content, headers=headers | kwargs.pop("headers", {}), timeout=60, **kwargs)


# ---- endpoints -------------------------------------------------------------------------


def test_health_and_models(served, oa, an) -> None:
    assert httpx.get(f"{served.url}/health").json() == {"status": "ok"}
    assert [m.id for m in oa.models.list().data] == ["tiny"]
    assert oa.models.retrieve("tiny").id == "tiny"
    with pytest.raises(openai.NotFoundError):
        oa.models.retrieve("gpt-4")
    assert [m.id for m in an.models.list().data] == ["tiny"]


def test_anthropic_count_tokens(an) -> None:
    counted = an.messages.count_tokens(model="tiny", system="be brief", messages=CHAT)
    reply = an.messages.create(model="tiny", max_tokens=1, system="be brief", messages=CHAT)
    assert counted.input_tokens == reply.usage.input_tokens + reply.usage.cache_read_input_tokens > 0


def test_chat_completion_streaming_and_not(oa) -> None:
    whole = oa.chat.completions.create(model="tiny", messages=CHAT, max_tokens=12, temperature=0)
    choice = whole.choices[0]
    assert choice.finish_reason == "length" and choice.message.role == "assistant"
    assert whole.usage.completion_tokens == 12 and whole.usage.total_tokens == whole.usage.prompt_tokens + 12
    assert whole.usage.prompt_tokens_details.cached_tokens == 0
    chunks = list(oa.chat.completions.create(
        model="tiny", messages=CHAT, max_tokens=12, temperature=0, stream=True, stream_options={"include_usage": True}
    ))
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == choice.message.content
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 12
    assert all(c.usage is None for c in chunks[:-1])


def test_completions_streaming_and_not(oa) -> None:
    whole = oa.completions.create(model="tiny", prompt=PROMPT, max_tokens=10, temperature=0)
    assert whole.object == "text_completion" and whole.choices[0].finish_reason == "length"
    assert whole.usage.prompt_tokens == 8 and whole.usage.completion_tokens == 10
    chunks = list(oa.completions.create(model="tiny", prompt=PROMPT, max_tokens=10, temperature=0, stream=True))
    assert "".join(c.choices[0].text for c in chunks) == whole.choices[0].text
    assert chunks[-1].choices[0].finish_reason == "length"


def test_greedy_token_prompt_matches_mlx_lm(oa, tiny_llama) -> None:
    prompt = [0, 771, 560, 204, 317, 639, 13, 70]
    ref = reference_greedy(tiny_llama, prompt, 24)
    whole = oa.completions.create(
        model="tiny", prompt=prompt, max_tokens=24, temperature=0, extra_body={"return_token_ids": True}
    )
    ours = whole.choices[0].model_extra["token_ids"]
    passed, note = compare_greedy(ours, ref)
    assert passed, note
    chunks = oa.completions.create(
        model="tiny", prompt=prompt, max_tokens=24, temperature=0, stream=True, extra_body={"return_token_ids": True}
    )
    assert [t for c in chunks for t in c.choices[0].model_extra["token_ids"]] == ours


def test_stop_strings_in_both_apis(oa, an) -> None:
    text = oa.completions.create(model="tiny", prompt=PROMPT, max_tokens=30, temperature=0).choices[0].text
    stop = text[10:14]
    cut = oa.completions.create(model="tiny", prompt=PROMPT, max_tokens=30, temperature=0, stop=[stop, "\x00never"])
    assert cut.choices[0].finish_reason == "stop" and cut.choices[0].text == text[: text.index(stop)]

    full = an.messages.create(model="tiny", max_tokens=30, messages=CHAT, extra_body=GREEDY).content[0].text
    stop = full[8:12]
    message = an.messages.create(model="tiny", max_tokens=30, messages=CHAT, stop_sequences=[stop], extra_body=GREEDY)
    assert message.stop_reason == "stop_sequence" and message.stop_sequence == stop
    assert message.content[0].text == full[: full.index(stop)]


def test_cached_prompt_tokens_are_reported(oa, an) -> None:
    prompt = [0] + [(7 * i) % 900 + 10 for i in range(599)]  # 600 tokens: two full 256-token blocks
    first = oa.completions.create(model="tiny", prompt=prompt, max_tokens=2, temperature=0)
    again = oa.completions.create(model="tiny", prompt=prompt, max_tokens=2, temperature=0)
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    assert again.usage.prompt_tokens_details.cached_tokens >= 256

    long_chat = [{"role": "user", "content": "def f(x):\n    return x\n" * 60}]
    first = an.messages.create(model="tiny", max_tokens=2, messages=long_chat)
    again = an.messages.create(model="tiny", max_tokens=2, messages=long_chat)
    assert first.usage.cache_read_input_tokens == 0
    assert again.usage.cache_read_input_tokens >= 256
    assert again.usage.input_tokens + again.usage.cache_read_input_tokens == first.usage.input_tokens


def test_anthropic_messages_streaming_and_not(an) -> None:
    message = an.messages.create(model="tiny", max_tokens=10, system="be brief", messages=CHAT, extra_body=GREEDY)
    assert message.type == "message" and message.role == "assistant" and message.stop_reason == "max_tokens"
    assert message.usage.output_tokens == 10 and message.usage.cache_read_input_tokens == 0
    events = list(an.messages.create(model="tiny", max_tokens=10, system="be brief", messages=CHAT, stream=True, extra_body=GREEDY))
    kinds = [e.type for e in events]
    assert kinds[0] == "message_start" and kinds[-2:] == ["message_delta", "message_stop"]
    assert kinds.count("content_block_start") == kinds.count("content_block_stop") == 1
    assert "".join(e.delta.text for e in events if e.type == "content_block_delta") == message.content[0].text
    with an.messages.stream(model="tiny", max_tokens=10, system="be brief", messages=CHAT, extra_body=GREEDY) as stream:
        final = stream.get_final_message()
    assert final.content[0].text == message.content[0].text and final.usage.output_tokens == 10


# ---- errors ----------------------------------------------------------------------------


def test_api_keys(served, oa) -> None:
    wrong = served.openai("nope")
    with pytest.raises(openai.AuthenticationError) as caught:
        wrong.models.list()
    assert caught.value.status_code == 401 and caught.value.body["code"] == "invalid_api_key"
    with pytest.raises(anthropic.AuthenticationError) as caught_an:
        served.anthropic("nope").messages.create(
            model="tiny", max_tokens=2, messages=CHAT
        )
    assert caught_an.value.body["error"]["type"] == "authentication_error"
    assert post(served, "/v1/completions", {"prompt": "x", "max_tokens": 1}, key=None).status_code == 401
    by_header = post(served, "/v1/completions", {"prompt": "x", "max_tokens": 1}, key=None, headers={"x-api-key": API_KEY})
    assert by_header.status_code == 200
    assert httpx.get(f"{served.url}/health").status_code == 200  # health and metrics stay open


@pytest.mark.parametrize(
    "path, body, param",
    [
        ("/v1/chat/completions", {"messages": "hi"}, "messages"),
        ("/v1/chat/completions", {"messages": CHAT, "temperature": "hot"}, "temperature"),
        ("/v1/chat/completions", {"messages": CHAT, "temperature": -1}, "temperature"),
        ("/v1/chat/completions", {"messages": CHAT, "n": 2}, "n"),
        ("/v1/chat/completions", {"messages": CHAT, "max_tokens": 0}, "max_tokens"),
        ("/v1/chat/completions", {"messages": [{"role": "robot", "content": "x"}]}, "messages"),
        ("/v1/chat/completions", {"messages": CHAT, "response_format": {"type": "yaml"}}, "response_format"),
        ("/v1/completions", {"prompt": []}, "prompt"),
        ("/v1/completions", {"prompt": "x", "logit_bias": {"a": 1}}, "logit_bias"),
        ("/v1/completions", b"{not json", None),
    ],
)
def test_invalid_fields_are_400_in_openai_shape(served, path, body, param) -> None:
    response = post(served, path, body)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["type"] == "invalid_request_error" and error["message"] and error["param"] == param


def test_invalid_anthropic_fields_are_400_in_anthropic_shape(an) -> None:
    with pytest.raises(anthropic.BadRequestError) as caught:
        an.messages.create(model="tiny", max_tokens=5, messages=[{"role": "user", "content": [{"type": "image"}]}])
    assert caught.value.body["type"] == "error" and caught.value.body["error"]["type"] == "invalid_request_error"


@pytest.mark.parametrize("stream", [False, True])
def test_a_prompt_longer_than_the_context_is_400(oa, stream) -> None:
    with pytest.raises(openai.BadRequestError) as caught:
        oa.completions.create(model="tiny", prompt=[5] * 2100, max_tokens=4, stream=stream)
    assert caught.value.body["code"] == "context_length_exceeded"


def test_unknown_routes_are_404_in_each_shape(served) -> None:
    response = httpx.get(f"{served.url}/v1/nope")
    assert response.status_code == 404 and response.json()["error"]["type"] == "invalid_request_error"
    response = post(served, "/v1/messages/batches", {})
    assert response.status_code == 404 and response.json()["error"]["type"] == "not_found_error"
    assert httpx.get(f"{served.url}/v1/chat/completions").status_code == 405


def test_bodies_over_the_limit_are_413(served) -> None:
    big = json.dumps({"prompt": "x" * MAX_BODY_BYTES, "max_tokens": 1}).encode()
    assert post(served, "/v1/completions", big).status_code == 413

    def chunked():
        yield big[:1000]
        yield big[1000:]

    response = httpx.post(f"{served.url}/v1/messages", content=chunked(), headers={"x-api-key": API_KEY})
    assert response.status_code == 413 and response.json()["error"]["type"] == "request_too_large"


def test_malformed_requests_do_not_disturb_a_stream(served) -> None:
    body = {"prompt": PROMPT, "max_tokens": 200, "temperature": 0, "stream": True}
    with httpx.stream("POST", f"{served.url}/v1/completions", json=body, headers={"x-api-key": API_KEY}, timeout=60) as r:
        lines = r.iter_lines()
        next(line for line in lines if line.startswith("data:"))
        for bad in (b"{", b"[]", json.dumps({"prompt": 3}).encode()):
            assert post(served, "/v1/completions", bad).status_code == 400
        rest = [line for line in lines if line.startswith("data:")]
    assert rest[-1] == "data: [DONE]"
    assert json.loads(rest[-2][5:])["choices"][0]["finish_reason"] == "length"


# ---- disconnects, concurrency, metrics ----------------------------------------------------


def wait_until(check, what: str) -> None:
    """Poll `check` (the per-test timeout bounds the wait)."""
    while not check():
        time.sleep(0.02)


def test_a_client_that_disconnects_cancels_its_request_and_frees_its_blocks(served) -> None:
    before = served.metrics()
    cancelled = 'unikern_request_success_total{finish_reason="cancelled"}'
    body = {"prompt": PROMPT, "max_tokens": 1500, "temperature": 0, "stream": True}
    with httpx.stream("POST", f"{served.url}/v1/completions", json=body, headers={"x-api-key": API_KEY}, timeout=60) as r:
        chunks = (line for line in r.iter_lines() if line.startswith("data:"))
        for _ in range(3):
            next(chunks)
        assert served.metrics()["unikern_num_requests_running"] == 1
        assert served.call(served.server.state.engine.stats)["kv"]["blocks_used"] > 0
    wait_until(lambda: served.metrics()["unikern_num_requests_running"] == 0, "the request to end")
    after = served.metrics()
    assert after.get(cancelled, 0) == before.get(cancelled, 0) + 1
    assert after["unikern_generation_tokens_total"] - before["unikern_generation_tokens_total"] < 1500
    assert after["unikern_kv_blocks_used"] == 0
    wait_until(lambda: served.call(served.server.state.engine.stats)["kv"]["blocks_used"] == 0, "blocks freed")


@pytest.mark.anyio
async def test_64_concurrent_streams_all_complete(served) -> None:
    client = openai.AsyncOpenAI(base_url=f"{served.url}/v1", api_key=API_KEY, max_retries=0, timeout=120)
    before = served.metrics()
    results: dict[int, tuple[str, str, int]] = {}

    async def one(i: int) -> None:
        chat = [{"role": "user", "content": f"request {i}"}]
        stream = await client.chat.completions.create(
            model="tiny", messages=chat, max_tokens=16, temperature=0, stream=True, stream_options={"include_usage": True}
        )
        text, reason, tokens = [], None, 0
        async for chunk in stream:
            if chunk.choices:
                text.append(chunk.choices[0].delta.content or "")
                reason = chunk.choices[0].finish_reason or reason
            if chunk.usage is not None:
                tokens = chunk.usage.completion_tokens
        results[i] = ("".join(text), reason, tokens)

    async with client, anyio.create_task_group() as tg:
        for i in range(64):
            tg.start_soon(one, i)
    assert sorted(results) == list(range(64))
    assert all(reason == "length" and tokens == 16 for _, reason, tokens in results.values())
    after = served.metrics()
    done = 'unikern_request_success_total{finish_reason="length"}'
    assert after[done] - before.get(done, 0) == 64
    assert after["unikern_time_to_first_token_seconds_count"] - before["unikern_time_to_first_token_seconds_count"] == 64


def test_metrics_exposes_the_documented_names(served, oa) -> None:
    oa.completions.create(model="tiny", prompt=PROMPT, max_tokens=3, temperature=0)
    text = httpx.get(f"{served.url}/metrics").text
    for name in (
        "unikern_num_requests_running", "unikern_num_requests_waiting", "unikern_kv_cache_usage_perc",
        "unikern_prompt_tokens_total", "unikern_generation_tokens_total", "unikern_prefix_cache_hit_tokens_total",
        'unikern_request_success_total{finish_reason="length"}', "unikern_time_to_first_token_seconds_bucket",
        "unikern_inter_token_latency_seconds_bucket",
    ):
        assert f"\n{name}" in text, name
