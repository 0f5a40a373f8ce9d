"""The HTTP door's own decisions over a scripted engine: readiness, admission (429 past
server.max_waiting, and for the engine's `overloaded` error), errors before and after the
first token, logprobs in each OpenAI shape, sampling fields passed through, and the drain."""

from __future__ import annotations

import json
import threading
import time
from types import SimpleNamespace
from typing import Any

import anthropic
import anyio
import httpx
import msgspec
import openai
import pytest

from tests.http_support import running_server
from unikern import messages as m
from unikern.frontends.http.params import ServerParams

USAGE = m.Usage(prompt_tokens=3, completion_tokens=2, cached_tokens=1)


class FakeTokenizer:
    chat_template = "fake"
    eos_token_ids = frozenset({1})
    has_tool_calling = False

    def apply_chat_template(self, turns, tools=None, add_generation_prompt=True, tokenize=True):
        return [0, 7, 8]

    def decode(self, ids):
        return "".join(f"<{i}>" for i in ids)


class FakeEngine:
    """Each request plays `script(request)`: a list of events, or "wait" (block until
    `release` is set) entries between them. cancel() ends a request with `cancelled`."""

    spec = SimpleNamespace(name="fake")

    def __init__(self, script, *, gate: anyio.Event | None = None) -> None:
        self.script = script
        self.gate = gate
        self.fault = None
        self.calls: list[dict[str, Any]] = []
        self.release = anyio.Event()
        self.waiting = threading.Semaphore(0)  # released as each request reaches a "wait"
        self._cancelled: dict[str, anyio.Event] = {}
        self.closed: list[str] = []  # requests whose event iterator was closed

    async def __aenter__(self) -> FakeEngine:
        if self.gate is not None:
            await self.gate.wait()
        return self

    async def __aexit__(self, *exc_info) -> None:
        return None

    async def wait_for_fault(self):
        await anyio.sleep_forever()

    def stats(self) -> dict[str, Any]:
        return {"kv": {"blocks_used": 0, "blocks_total": 8}}

    def cancel(self, request_id: str) -> bool:
        self._cancelled[request_id].set()
        return True

    def generate(self, prompt=None, *, prompt_tokens=None, max_tokens, request_id, **sampling):
        self.calls.append(dict(prompt=prompt, prompt_tokens=prompt_tokens, max_tokens=max_tokens, **sampling))
        self._cancelled[request_id] = anyio.Event()
        return self._play(request_id)

    async def _play(self, rid: str):
        try:
            async for event in self._steps(rid):
                yield event
        finally:
            self.closed.append(rid)

    async def _steps(self, rid: str):
        for step in self.script(rid):
            if step == "wait":
                self.waiting.release()
                async with anyio.create_task_group() as tg:
                    for event in (self.release, self._cancelled[rid]):
                        tg.start_soon(_then_cancel, event, tg.cancel_scope)
                if self._cancelled[rid].is_set():
                    yield m.DoneEvent(rid, "cancelled", USAGE)
                    return
                continue
            yield msgspec.structs.replace(step, id=rid)


async def _then_cancel(event: anyio.Event, scope: anyio.CancelScope) -> None:
    await event.wait()
    scope.cancel()


def token(token_id: int, text: str, **kwargs) -> m.TokenEvent:
    return m.TokenEvent(id="", token_id=token_id, text=text, **kwargs)


def done(reason: str = "length") -> m.DoneEvent:
    return m.DoneEvent(id="", finish_reason=reason, usage=USAGE)


def two_tokens(_rid: str) -> list[Any]:
    return [token(5, "he"), token(6, "llo"), done()]


def serve(engine: FakeEngine, *, wait_ready: bool = True, **params: Any):
    return running_server(
        lambda: engine, ServerParams(port=0, **params), wait_ready=wait_ready, tokenizer_of=lambda e: FakeTokenizer()
    )


CHAT = [{"role": "user", "content": "hi"}]


def test_health_is_503_until_the_engine_is_ready() -> None:
    gate = anyio.Event()
    with serve(FakeEngine(two_tokens, gate=gate), wait_ready=False) as running:
        response = httpx.get(f"{running.url}/health")
        assert response.status_code == 503 and response.json() == {"status": "starting"}
        assert httpx.post(f"{running.url}/v1/completions", json={"prompt": "x"}).status_code == 503
        running.call(gate.set)
        running.call(running.server.ready.wait)
        assert httpx.get(f"{running.url}/health").status_code == 200
        assert running.openai().completions.create(model="m", prompt="x").choices[0].text == "hello"


@pytest.mark.anyio
async def test_requests_past_max_waiting_get_429_with_retry_after() -> None:
    engine = FakeEngine(lambda rid: ["wait", *two_tokens(rid)])
    with serve(engine, max_waiting=2, retry_after_seconds=3) as running:
        state = running.server.state
        replies: list[httpx.Response] = []
        async with httpx.AsyncClient(base_url=running.url, timeout=30) as client:

            async def waiting_request() -> None:
                replies.append(await client.post("/v1/completions", json={"prompt": "x"}))

            async with anyio.create_task_group() as tg:
                tg.start_soon(waiting_request)
                tg.start_soon(waiting_request)
                for _ in range(2):
                    await anyio.to_thread.run_sync(engine.waiting.acquire)
                assert state.num_waiting == 2
                refused = await client.post("/v1/completions", json={"prompt": "x"})
                assert refused.status_code == 429 and refused.headers["retry-after"] == "3"
                assert refused.json()["error"]["type"] == "rate_limit_exceeded"
                refused = await client.post("/v1/messages", json={"model": "m", "max_tokens": 4, "messages": CHAT})
                assert refused.status_code == 429 and refused.json()["error"]["type"] == "rate_limit_error"
                metrics = (await client.get("/metrics")).text
                assert "unikern_num_requests_waiting 2.0" in metrics
                running.call(engine.release.set)
            assert [r.status_code for r in replies] == [200, 200]
            assert "unikern_num_requests_waiting 0.0" in (await client.get("/metrics")).text


@pytest.mark.parametrize("stream", [False, True])
def test_an_overloaded_engine_is_429(stream: bool) -> None:
    overloaded = [m.ErrorEvent(id="", code="overloaded", message="too many requests are waiting")]
    with serve(FakeEngine(lambda rid: overloaded)) as running:
        with pytest.raises(openai.RateLimitError) as caught:
            running.openai().chat.completions.create(model="m", messages=CHAT, stream=stream)
        assert caught.value.response.headers["retry-after"] == "1"
        with pytest.raises(anthropic.RateLimitError):
            running.anthropic().messages.create(model="m", max_tokens=4, messages=CHAT, stream=stream)


def test_a_stage_failure_is_500_before_the_first_token_and_an_error_event_after() -> None:
    failed = m.ErrorEvent(id="", code="stage_failed", message="stage 'execute' failed: boom")
    with serve(FakeEngine(lambda rid: [failed])) as running:
        with pytest.raises(openai.InternalServerError):
            running.openai().completions.create(model="m", prompt="x")
    with serve(FakeEngine(lambda rid: [token(5, "he"), failed])) as running:
        body = {"prompt": "x", "stream": True}
        lines = [x for x in httpx.post(f"{running.url}/v1/completions", json=body).text.splitlines() if x]
        assert json.loads(lines[-2][5:])["error"]["message"] == "stage 'execute' failed: boom"
        body = {"model": "m", "max_tokens": 4, "messages": CHAT, "stream": True}
        text = httpx.post(f"{running.url}/v1/messages", json=body).text
        assert "event: error\ndata: " in text and "api_error" in text and "message_stop" not in text


def test_logprobs_in_each_openai_shape() -> None:
    tops = (m.TopLogprob(6, -0.1), m.TopLogprob(9, -2.5))
    events = [token(6, "<6>", logprob=-0.1, top_logprobs=tops), token(7, "<7>", logprob=-0.7, top_logprobs=tops), done()]
    engine = FakeEngine(lambda rid: events)
    with serve(engine) as running:
        chat = running.openai().chat.completions.create(model="m", messages=CHAT, logprobs=True, top_logprobs=2)
        assert engine.calls[-1]["logprobs"] is True and engine.calls[-1]["top_logprobs"] == 2
        content = chat.choices[0].logprobs.content
        assert [(c.token, c.logprob, c.bytes) for c in content] == [("<6>", -0.1, list(b"<6>")), ("<7>", -0.7, list(b"<7>"))]
        assert [(t.token, t.logprob) for t in content[0].top_logprobs] == [("<6>", -0.1), ("<9>", -2.5)]

        text = running.openai().completions.create(model="m", prompt="x", logprobs=2)
        assert engine.calls[-1]["logprobs"] is True and engine.calls[-1]["top_logprobs"] == 2
        logprobs = text.choices[0].logprobs
        assert logprobs.tokens == ["<6>", "<7>"] and logprobs.token_logprobs == [-0.1, -0.7]
        assert logprobs.top_logprobs[1] == {"<6>": -0.1, "<9>": -2.5} and logprobs.text_offset == [0, 3]

        chunks = list(running.openai().chat.completions.create(model="m", messages=CHAT, logprobs=True, stream=True))
        streamed = [c.token for chunk in chunks if chunk.choices and chunk.choices[0].logprobs for c in chunk.choices[0].logprobs.content]
        assert streamed == ["<6>", "<7>"]


def test_sampling_fields_reach_the_engine_as_given() -> None:
    engine = FakeEngine(two_tokens)
    fields = dict(
        temperature=0.5, top_p=0.9, seed=7, stop=["\n\n"], presence_penalty=0.5, frequency_penalty=0.25,
        logit_bias={"42": -100}, response_format={"type": "json_object"},
    )
    extensions = dict(top_k=40, min_p=0.05, repetition_penalty=1.1)
    with serve(engine) as running:
        running.openai().chat.completions.create(
            model="m", messages=CHAT, max_tokens=50, max_completion_tokens=20, user="u", extra_body=extensions, **fields
        )
        call = engine.calls[-1]
        assert call["prompt_tokens"] == [0, 7, 8] and call["max_tokens"] == 20
        assert {k: call[k] for k in fields} | {k: call[k] for k in extensions} == fields | extensions
        reply = running.anthropic().messages.create(
            model="m", max_tokens=9, messages=CHAT, stop_sequences=["END"], extra_body={"temperature": 0.3, "top_k": 5}
        )
        call = engine.calls[-1]
        assert (call["max_tokens"], call["stop"], call["temperature"], call["top_k"]) == (9, ["END"], 0.3, 5)
        assert reply.usage.input_tokens == 2 and reply.usage.cache_read_input_tokens == 1


@pytest.mark.parametrize("drain_seconds", [30.0, 0.0])
def test_stop_drains_then_cancels(drain_seconds: float) -> None:
    engine = FakeEngine(lambda rid: [token(5, "he"), "wait", token(6, "llo"), done()])
    with serve(engine, drain_seconds=drain_seconds) as running:
        with httpx.stream("POST", f"{running.url}/v1/completions", json={"prompt": "x", "stream": True}, timeout=30) as r:
            lines = r.iter_lines()
            assert json.loads(next(lines)[5:])["choices"][0]["text"] == "he"
            running.call(running.server.stop)
            if drain_seconds:  # the request may finish: it does
                while not running.server.state.draining:
                    time.sleep(0.01)
                running.call(engine.release.set)
            chunks = [json.loads(x[5:]) for x in lines if x.startswith("data: {")]
        text = "".join(c["choices"][0]["text"] for c in chunks)
        assert (text, chunks[-1]["choices"][0]["finish_reason"]) == ("llo" if drain_seconds else "", "length")
        assert running.server.state.active == set()
    assert running.exit_code == 0


@pytest.mark.parametrize("stream", [False, True])
def test_a_client_that_leaves_while_its_request_waits_cancels_it(stream: bool) -> None:
    engine = FakeEngine(lambda rid: ["wait", *two_tokens(rid)])
    with serve(engine) as running:
        body = {"prompt": "x", "stream": stream}
        with pytest.raises(httpx.ReadTimeout):  # the client gives up before the first token
            httpx.post(f"{running.url}/v1/completions", json=body, timeout=httpx.Timeout(10, read=0.5))
        while running.server.state.active:
            time.sleep(0.01)
        assert len(engine.closed) == 1
        metrics = running.metrics()
        assert metrics['unikern_request_success_total{finish_reason="cancelled"}'] == 1
        assert metrics["unikern_num_requests_waiting"] == 0
