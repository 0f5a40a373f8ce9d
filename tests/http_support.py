"""Helpers for the HTTP tests: a server on its own event loop thread, /metrics parsing,
and a scripted model whose chat template declares tools and which always calls one."""

from __future__ import annotations

import concurrent.futures
import contextlib
import json
import shutil
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import anthropic
import anyio.from_thread
import httpx
import openai

from unikern.frontends.http.params import ServerParams
from unikern.frontends.http.server import HTTPServer

API_KEY = "sk-unikern-test"


@dataclass
class Running:
    server: HTTPServer
    portal: Any
    url: str
    exit_code: int | None = None
    clients: list[Any] = field(default_factory=list)

    def openai(self, api_key: str = API_KEY) -> openai.OpenAI:
        """An OpenAI client of this server (closed with it)."""
        client = openai.OpenAI(base_url=f"{self.url}/v1", api_key=api_key, max_retries=0)
        self.clients.append(client)
        return client

    def anthropic(self, api_key: str = API_KEY) -> anthropic.Anthropic:
        client = anthropic.Anthropic(base_url=self.url, api_key=api_key, max_retries=0)
        self.clients.append(client)
        return client

    def call(self, fn: Callable[..., Any], *args: Any) -> Any:
        """Run `fn` on the server's event loop (engine.stats(), server.stop(), ...)."""
        return self.portal.call(fn, *args)

    def metrics(self) -> dict[str, float]:
        return parse_metrics(httpx.get(f"{self.url}/metrics").text)


@contextlib.contextmanager
def running_server(
    engine_factory: Callable[[], Any], params: ServerParams | None = None, *, wait_ready: bool = True, **kwargs: Any
) -> Iterator[Running]:
    """An HTTPServer on 127.0.0.1 (a free port) in a thread of its own; stopped on exit."""
    params = params or ServerParams(port=0)
    with anyio.from_thread.start_blocking_portal(backend="asyncio") as portal:
        server = HTTPServer(engine_factory, params, kwargs.pop("model_id", "test-model"), **kwargs)
        future, port = portal.start_task(server.run)
        running = Running(server, portal, f"http://127.0.0.1:{port}")
        try:
            if wait_ready:  # ready, or run() failed (its exception comes out here)
                ready = portal.start_task_soon(server.ready.wait)
                concurrent.futures.wait([future, ready], return_when=concurrent.futures.FIRST_COMPLETED)
                if future.done():
                    future.result()
            yield running
        finally:
            for client in running.clients:
                client.close()
            portal.call(server.stop)
            running.exit_code = future.result(timeout=120)


def parse_metrics(text: str) -> dict[str, float]:
    """`name{labels} value` lines -> {"name{labels}": value} (comments skipped)."""
    values = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, _, value = line.rpartition(" ")
            values[name] = float(value)
    return values


# ---- a model that calls a tool ---------------------------------------------------------

TOOL_TEMPLATE = (
    "{{ bos_token }}"
    "{% if tools %}<|system|>Tools:{% for tool in tools %} {{ tool | tojson }}{% endfor %}"
    " Call one as <tool_call>{\"name\": ..., \"arguments\": ...}</tool_call>{{ eos_token }}{% endif %}"
    "{% for message in messages %}"
    "{% if message.role == 'tool' %}{{ '<|user|>' + message.content + eos_token }}"
    "{% elif message.role == 'assistant' and message.tool_calls %}<|assistant|>"
    "{% for tool_call in message.tool_calls %}{% set tool_call = tool_call.function %}"
    "<tool_call>{{ {'name': tool_call.name, 'arguments': tool_call.arguments} | tojson }}</tool_call>"
    "{% endfor %}{{ eos_token }}"
    "{% else %}{{ '<|' + message.role + '|>' + message.content + eos_token }}{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)
TOOL_CALL_TEXT = ["<tool_call>", '{"name":"get_weather","arguments":{"city":"Paris"}}', "</tool_call>"]


def build_tool_model(base: str | Path, out: Path) -> Path:
    """A copy of `base` whose reply to any chat is `<tool_call>{...}</tool_call>` then EOS.

    The template names `<tool_call>` and `tool_call.name`, so mlx-lm picks its
    `json_tools` parser for it. The call's three pieces become added tokens; every layer's
    output projections are zeroed, so the logits depend on the last token alone, and the
    embeddings and lm_head rows of the chain <|assistant|> -> pieces -> EOS make each
    token predict the next."""
    import numpy as np
    from safetensors.numpy import load_file, save_file
    from tokenizers import AddedToken, Tokenizer

    shutil.copytree(base, out)
    tokenizer = Tokenizer.from_file(str(out / "tokenizer.json"))
    tokenizer.add_tokens([AddedToken(piece, normalized=False) for piece in TOOL_CALL_TEXT])
    tokenizer.save(str(out / "tokenizer.json"))
    pieces = [tokenizer.token_to_id(piece) for piece in TOOL_CALL_TEXT]
    chain = [tokenizer.token_to_id("<|assistant|>"), *pieces, tokenizer.token_to_id("<|eos|>")]
    vocab_size = max(pieces) + 1

    config = json.loads((out / "config.json").read_text())
    config["vocab_size"] = vocab_size
    (out / "config.json").write_text(json.dumps(config))
    tok_config = json.loads((out / "tokenizer_config.json").read_text())
    tok_config["chat_template"] = TOOL_TEMPLATE
    (out / "tokenizer_config.json").write_text(json.dumps(tok_config))

    weights = load_file(str(out / "model.safetensors"))
    for name in weights:
        if name.endswith(("o_proj.weight", "down_proj.weight")):
            weights[name] = np.zeros_like(weights[name])
    embed, head = weights["model.embed_tokens.weight"], weights["lm_head.weight"]
    grow = np.zeros((vocab_size - embed.shape[0], embed.shape[1]), embed.dtype)
    embed, head = np.concatenate([embed, grow]), np.concatenate([head, grow])
    for i, (token, following) in enumerate(zip(chain, chain[1:], strict=False)):
        embed[token] = 0.0
        embed[token, i] = 1.0
        head[following] = 0.0
        head[following, i] = 100.0
    weights["model.embed_tokens.weight"], weights["lm_head.weight"] = embed, head
    save_file(weights, str(out / "model.safetensors"), metadata={"format": "pt"})
    return out
