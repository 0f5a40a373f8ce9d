"""The text of generated tokens is what they add to the prompt's text:
decode(prompt + generated)[len(decode(prompt)):], as vLLM and llama-server return it, at
every door: the library's events and complete(), the worker's token events, both OpenAI
endpoints streamed and not, and `unikern run`'s stdout. So a first token that carries a
leading space keeps it (the caller appends the text to its prompt), and a character split
across byte tokens comes out whole with the token that completes it.

Two tokenizer layouts: byte-level BPE as Qwen ships it (tiny-qwen3) and SentencePiece-style
with byte fallback, whose decode strips the text's first space (tiny-llama-spm). Each case
is greedy; its first token carries a leading space, or it splits 'é' over two byte tokens
(logit_bias on both bytes, with a frequency penalty so they alternate), or a regex response
format forces ' exist é 🙂 wörld!' (a leading space, é over two tokens, 🙂 over four).
"""

from __future__ import annotations

import contextlib
import io
import json
import subprocess

import anyio
import pytest

from tests.conftest import SMALL_KV
from tests.http_support import API_KEY, running_server
from tests.test_cli import TIMEOUT_S, unikern_cmd
from unikern import messages as m
from unikern.engine import Engine
from unikern.frontends.worker import Worker
from unikern.testing.modelgen import cached_model

MODELS = ("tiny-qwen3", "tiny-llama-spm")
FORCED = {"type": "regex", "pattern": " exist é 🙂 wörld!"}
SPACE, SPLIT, FORCE = "space", "split", "force"


def cases(model: str, tok) -> dict[str, tuple[str, dict]]:
    """name -> (what it shows, request body): greedy, found on these seeded models."""
    c3, a9 = (str(t) for t in tok.encode("é", add_special_tokens=False)[-2:])

    def user(text: str) -> list[dict]:
        return [{"role": "user", "content": text}]

    if model == "tiny-qwen3":
        return {
            "prompt-space": (SPACE, {"prompt": "for i in", "max_tokens": 8}),
            "chat-space": (SPACE, {"messages": user("print("), "max_tokens": 8}),
            "prompt-split": (SPLIT, {"prompt": "class Foo", "max_tokens": 8, "frequency_penalty": 1.0,
                                     "logit_bias": {c3: 100.0, a9: 100.0}}),
            "chat-force": (FORCE, {"messages": user("hi"), "max_tokens": 40, "response_format": FORCED}),
        }
    return {
        "prompt-space": (SPACE, {"prompt": "return", "max_tokens": 8}),
        "chat-force": (FORCE, {"messages": user("hi"), "max_tokens": 40, "response_format": FORCED}),
        "prompt-force": (FORCE, {"prompt": "def f(x):", "max_tokens": 40, "response_format": FORCED}),
    }


@pytest.fixture(scope="module", params=MODELS)
def model(request):
    from mlx_lm.utils import load_tokenizer

    path = cached_model(request.param)
    return request.param, str(path), load_tokenizer(path)


def prompt_ids(tok, body: dict) -> list[int]:
    if "messages" in body:
        return list(tok.apply_chat_template(body["messages"], add_generation_prompt=True, tokenize=True))
    return list(tok.encode(body["prompt"]))


def in_context(tok, body: dict, generated: list[int]) -> str:
    prompt = prompt_ids(tok, body)
    return tok.decode(prompt + generated)[len(tok.decode(prompt)):]


def check_case(tok, kind: str, body: dict, generated: list[int]) -> str:
    """The expected text, once the case shows what it is meant to."""
    expected = in_context(tok, body, generated)
    if kind in (SPACE, FORCE):
        assert expected.startswith(" "), (expected, generated)
    if kind == SPLIT:
        c3, a9 = tok.encode("é", add_special_tokens=False)[-2:]
        assert "é" in expected and any(generated[i : i + 2] == [c3, a9] for i in range(len(generated))), generated
    if kind == FORCE:
        assert expected == FORCED["pattern"]
    return expected


def without_eos(tok, generated: list[int]) -> list[int]:
    """The HTTP APIs leave the end-of-sequence token's own text out."""
    return generated[:-1] if generated and generated[-1] in tok.eos_token_ids else generated


# ---- library and worker ------------------------------------------------------------------


@pytest.mark.anyio
async def test_library_and_worker_text_is_the_decode_in_context(model) -> None:
    name, path, tok = model
    table = cases(name, tok)
    async with Engine.from_pipeline("generate", model=path, overrides=SMALL_KV) as engine:
        for case, (kind, body) in table.items():
            texts, generated = [], []
            async with contextlib.aclosing(engine.generate(**body)) as events:
                async for event in events:
                    if isinstance(event, m.TokenEvent):
                        texts.append(event.text)
                        generated.append(event.token_id)
            expected = check_case(tok, kind, body, generated)
            assert "".join(texts) == expected, case
            # each token brings what it adds in context; a character with the token completing it
            for k in range(len(generated)):
                assert "".join(texts[: k + 1]) == in_context(tok, body, generated[: k + 1]).rstrip("\ufffd"), (case, k)
            assert (await engine.complete(**body)).text == expected, case

        out = io.BytesIO()

        async def lines():
            for case, (_, body) in table.items():
                yield json.dumps({"op": "generate", "id": case, **body}).encode()

        assert await Worker(engine, out).serve(lines()) == 0
    events = [json.loads(line) for line in out.getvalue().splitlines()]
    for case, (kind, body) in table.items():
        tokens = [e for e in events if e["event"] == "token" and e["id"] == case]
        expected = check_case(tok, kind, body, [e["token_id"] for e in tokens])
        assert "".join(e["text"] for e in tokens) == expected, case


# ---- HTTP ------------------------------------------------------------------------------


def test_openai_text_is_the_decode_in_context_streamed_or_not(model) -> None:
    name, path, tok = model
    factory = lambda: Engine.from_pipeline("generate", model=path, overrides=SMALL_KV)  # noqa: E731
    with running_server(factory, model_id="tiny") as served:
        oa = served.openai(API_KEY)
        for case, (kind, body) in cases(name, tok).items():
            chat = "messages" in body
            if not chat and "response_format" in body:  # /v1/completions takes none
                continue
            extra = {"return_token_ids": True} | ({"response_format": body["response_format"]} if "response_format" in body else {})
            args = {k: v for k, v in body.items() if k != "response_format"} | {"model": "tiny", "temperature": 0, "extra_body": extra}
            create = oa.chat.completions.create if chat else oa.completions.create
            whole = create(**args).choices[0]
            generated = whole.model_extra["token_ids"]
            expected = check_case(tok, kind, body, without_eos(tok, generated))
            assert (whole.message.content if chat else whole.text) == expected, case
            pieces, streamed_ids = [], []
            for chunk in create(**args, stream=True):
                for choice in chunk.choices:
                    pieces.append((choice.delta.content if chat else choice.text) or "")
                    streamed_ids += choice.model_extra.get("token_ids") or []
            assert streamed_ids == generated and "".join(pieces) == expected, case


# ---- unikern run ---------------------------------------------------------------------------


def test_unikern_run_prints_the_decode_in_context(model) -> None:
    name, path, tok = model
    runs = {case: body for case, (kind, body) in cases(name, tok).items() if kind == SPACE}
    procs = {}
    for case, body in runs.items():  # `run` takes no sampling options beyond temperature
        chat = "messages" in body
        prompt = body["messages"][0]["content"] if chat else body["prompt"]
        procs[case] = subprocess.Popen(
            [*unikern_cmd(), "run", "--model", path, "--prompt", prompt, "--max-tokens", str(body["max_tokens"]),
             "--set", f"kv.kv_budget_bytes={SMALL_KV['kv']['kv_budget_bytes']}", *["--chat"] * chat],
            stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
        )

    async def reference() -> dict[str, list[int]]:
        async with Engine.from_pipeline("generate", model=path, overrides=SMALL_KV) as engine:
            return {case: (await engine.complete(**body)).token_ids for case, body in runs.items()}

    generated = anyio.run(reference)
    for case, proc in procs.items():
        out, err = proc.communicate(timeout=TIMEOUT_S)
        assert proc.returncode == 0, err.decode()
        expected = check_case(tok, SPACE, runs[case], generated[case])
        assert out.decode("utf-8") == expected + "\n", case
