"""The OpenAI API: request bodies into the engine's terms, and engine output into
`chat.completion(.chunk)` and `text_completion` objects (the one place that shapes them)."""

from __future__ import annotations

import contextlib
import dataclasses
import time
from collections.abc import AsyncIterator
from typing import Any

import msgspec

from unikern import messages as m
from unikern.frontends.http.chat import ToolCall, openai_messages, render_chat
from unikern.frontends.http.errors import APIError
from unikern.frontends.http.generation import Generation, Outcome, Prepared, ServerState
from unikern.frontends.http.responses import sse_event
from unikern.stages.tokenize import text_prompt_tokens

# without max_tokens a chat reply runs to end of sequence or of the context
UNTIL_CONTEXT_END = 1 << 20
COMPLETIONS_DEFAULT_MAX_TOKENS = 16  # the legacy endpoint's documented default
MAX_COMPLETIONS_LOGPROBS = 20


class StreamOptions(msgspec.Struct):
    include_usage: bool = False


class _Sampling(msgspec.Struct):
    """Fields both endpoints share; unknown fields are ignored, as OpenAI's clients send
    more than any one server reads."""

    model: str | None = None
    max_tokens: int | None = None
    temperature: float = 1.0
    top_p: float = 1.0
    seed: int | None = None
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: dict[str, float] | None = None
    user: str | None = None
    n: int | None = None
    # extensions (vLLM's and mlx-lm's names)
    top_k: int = 0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    # vLLM's extension: each choice carries the generated token ids
    return_token_ids: bool = False

    def sampling(self) -> dict[str, Any]:
        if self.n not in (None, 1):
            raise APIError(400, f"n must be 1: this server returns one choice per request (got {self.n})", param="n")
        return dict(
            temperature=self.temperature, top_p=self.top_p, seed=self.seed, stop=self.stop,
            presence_penalty=self.presence_penalty, frequency_penalty=self.frequency_penalty,
            logit_bias=self.logit_bias, top_k=self.top_k, min_p=self.min_p,
            repetition_penalty=self.repetition_penalty,
        )

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage


class ChatRequest(_Sampling):
    messages: list[Any] = []
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int = 0
    response_format: dict[str, Any] | None = None
    tools: list[Any] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None


class CompletionRequest(_Sampling):
    prompt: Any = None
    logprobs: int | None = None
    echo: bool = False
    best_of: int | None = None
    suffix: str | None = None


def prepare_chat(state: ServerState, body: ChatRequest) -> Prepared:
    tools = _checked_tools(body.tools) if body.tool_choice != "none" else None
    tokens = render_chat(state.tokenizer, openai_messages(body.messages), tools)
    max_tokens = next((n for n in (body.max_completion_tokens, body.max_tokens) if n is not None), UNTIL_CONTEXT_END)
    sampling = body.sampling() | dict(
        logprobs=body.logprobs, top_logprobs=body.top_logprobs, response_format=body.response_format
    )
    parse = bool(tools) and bool(getattr(state.tokenizer, "has_tool_calling", False))
    return Prepared(max_tokens, sampling, prompt_tokens=tokens, tools=tools, parse_tools=parse)


def _checked_tools(tools: list[Any] | None) -> list[dict[str, Any]] | None:
    for i, tool in enumerate(tools or ()):
        function = tool.get("function") if isinstance(tool, dict) else None
        if tool.get("type", "function") != "function" or not isinstance(function, dict) or not isinstance(function.get("name"), str):
            raise APIError(400, f"tools[{i}]: expected {{'type': 'function', 'function': {{'name': ...}}}}", param="tools")
    return tools or None


def prepare_completion(body: CompletionRequest, tokenizer: Any = None) -> Prepared:
    prepared = _completion(body)
    return _echoed(prepared, body.logprobs, tokenizer) if body.echo else prepared


def _echoed(prepared: Prepared, logprobs: int | None, tokenizer: Any) -> Prepared:
    """echo: the text starts with the prompt. With logprobs (or max_tokens 0: the prompt
    alone, as vLLM allows) the prompt's tokens come with their log-probabilities
    (prompt_logprobs), so the prompt goes in as the token ids the response names."""
    tokens = prepared.prompt_tokens
    try:
        text = prepared.prompt if tokens is None else tokenizer.decode(tokens)
    except Exception as exc:  # ids outside the vocabulary (the engine would refuse them too)
        raise APIError(400, f"prompt: the token ids cannot be decoded ({exc})", param="prompt") from None
    if logprobs is None and prepared.max_tokens > 0:
        return dataclasses.replace(prepared, echo=text)
    if tokens is None:
        tokens = text_prompt_tokens(tokenizer, prepared.prompt)
    sampling = prepared.sampling | {"prompt_logprobs": logprobs or 0}
    return Prepared(prepared.max_tokens, sampling, prompt_tokens=list(tokens), echo=text)


def _completion(body: CompletionRequest) -> Prepared:
    if (body.best_of or 1) > 1 or body.suffix:
        raise APIError(400, "best_of > 1 and suffix are not supported",
                       param="suffix" if body.suffix else "best_of")
    if body.logprobs is not None and not 0 <= body.logprobs <= MAX_COMPLETIONS_LOGPROBS:
        raise APIError(400, f"logprobs must be an integer in [0, {MAX_COMPLETIONS_LOGPROBS}]", param="logprobs")
    prompt = body.prompt
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]  # a batch of one
    sampling = body.sampling()
    if body.logprobs is not None:
        sampling |= dict(logprobs=True, top_logprobs=body.logprobs)
    max_tokens = COMPLETIONS_DEFAULT_MAX_TOKENS if body.max_tokens is None else body.max_tokens
    if isinstance(prompt, str) and prompt:
        return Prepared(max_tokens, sampling, prompt=prompt)
    if isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        return Prepared(max_tokens, sampling, prompt_tokens=prompt)
    raise APIError(
        400, "prompt must be a non-empty string or a non-empty list of token ids (one prompt per request)",
        param="prompt",
    )


# ---- engine output -> OpenAI objects -------------------------------------------------


def finish_reason(outcome: Outcome) -> str:
    if outcome.finish_reason == "stop":
        return "tool_calls" if outcome.num_tool_calls else "stop"
    return "length"  # max_tokens, the context's end, or cut short by a server shutdown


def usage(outcome: Outcome | None) -> dict[str, Any] | None:
    if outcome is None:
        return None
    u = outcome.usage
    return {
        "prompt_tokens": u.prompt_tokens,
        "completion_tokens": u.completion_tokens,
        "total_tokens": u.prompt_tokens + u.completion_tokens,
        "prompt_tokens_details": {"cached_tokens": u.cached_tokens},
    }


def _tool_calls(calls: list[ToolCall], first_index: int | None = None) -> list[dict[str, Any]]:
    out = []
    for i, call in enumerate(calls):
        item = {"id": call.id, "type": "function", "function": {"name": call.name, "arguments": call.arguments_json()}}
        if first_index is not None:
            item = {"index": first_index + i, **item}
        out.append(item)
    return out


class Shaper:
    """Builds one request's OpenAI objects (`chat` or `text` flavour)."""

    def __init__(self, state: ServerState, gen: Generation, request_id: str, *, chat: bool, token_ids: bool) -> None:
        self.state = state
        self.gen = gen
        self.id = request_id
        self.chat = chat
        self.token_ids = token_ids
        self.created = int(time.time())
        self.object = "chat.completion" if chat else "text_completion"

    def _envelope(self, choices: list[dict[str, Any]], chunk: bool) -> dict[str, Any]:
        kind = self.object + (".chunk" if chunk and self.chat else "")
        return {"id": self.id, "object": kind, "created": self.created, "model": self.state.model_id, "choices": choices}

    # ---- logprobs --------------------------------------------------------------------

    def _token_text(self, token_id: int) -> str:
        return self.state.tokenizer.decode([token_id])

    def logprobs(self, tokens: list[m.TokenEvent], text_offset: int = 0) -> dict[str, Any] | None:
        tokens = [t for t in tokens if t.logprob is not None]
        if not tokens:
            return None
        if self.chat:
            def entry(token_id: int, logprob: float) -> dict[str, Any]:
                text = self._token_text(token_id)
                return {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8"))}

            return {"content": [
                entry(t.token_id, t.logprob) | {"top_logprobs": [entry(x.token_id, x.logprob) for x in t.top_logprobs or ()]}
                for t in tokens
            ]}
        texts, offsets = self._texts_at([t.token_id for t in tokens], text_offset)
        return {
            "tokens": texts,
            "token_logprobs": [t.logprob for t in tokens],
            "top_logprobs": [{self._token_text(x.token_id): x.logprob for x in t.top_logprobs or ()} for t in tokens],
            "text_offset": offsets,
        }

    def _texts_at(self, token_ids: list[int], offset: int) -> tuple[list[str], list[int]]:
        """Each token's text and where it starts, the first at `offset` (the legacy
        `tokens` and `text_offset`)."""
        texts = [self._token_text(t) for t in token_ids]
        offsets = []
        for text in texts:
            offsets.append(offset)
            offset += len(text)
        return texts, offsets

    def _prompt_logprobs(self) -> dict[str, Any] | None:
        """An echoed prompt's part of the `logprobs` object (its first token has none), when
        the request asked for logprobs; offsets count each token's text from 0, as vLLM's."""
        prepared, outcome = self.gen.prepared, self.gen.outcome
        reports = outcome.prompt_logprobs if outcome is not None else None
        if reports is None or not prepared.sampling.get("logprobs"):
            return None
        texts, offsets = self._texts_at(prepared.prompt_tokens, 0)
        return {
            "tokens": texts,
            "token_logprobs": [None if r is None else r.logprob for r in reports],
            "top_logprobs": [None if r is None else self._top_by_text(r.top_logprobs) for r in reports],
            "text_offset": offsets,
        }

    def _top_by_text(self, top: tuple[m.TopLogprob, ...]) -> dict[str, float]:
        """{text: logprob}, best first; where two ids read the same, the better one stays."""
        out: dict[str, float] = {}
        for x in top:
            out.setdefault(self._token_text(x.token_id), x.logprob)
        return out

    def _echo_logprobs(self, tokens: list[m.TokenEvent]) -> dict[str, Any] | None:
        """An echoed completion's `logprobs`: the prompt's tokens, then the generated ones
        (their offsets in the text, which starts with the prompt)."""
        generated = self.logprobs(tokens, len(self.gen.prepared.echo))
        prompt = self._prompt_logprobs()
        if prompt is None or generated is None:
            return prompt or generated
        return {key: prompt[key] + generated[key] for key in prompt}

    # ---- whole responses -------------------------------------------------------------

    async def collect(self) -> dict[str, Any]:
        text, calls, tokens = [], [], []
        async with contextlib.aclosing(self.gen.pieces()) as pieces:
            async for piece in pieces:
                text.append(piece.text)
                calls += piece.tool_calls
                tokens += piece.tokens
        if self.gen.error is not None:
            raise self.gen.error
        outcome = self.gen.outcome
        content = "".join(text)
        logprobs = self.logprobs(tokens)
        if not self.chat and self.gen.prepared.echo is not None:
            content = self.gen.prepared.echo + content
            logprobs = self._echo_logprobs(tokens)
        choice: dict[str, Any] = {"index": 0, "logprobs": logprobs, "finish_reason": finish_reason(outcome)}
        if self.chat:
            message: dict[str, Any] = {"role": "assistant", "content": content if content or not calls else None}
            if calls:
                message["tool_calls"] = _tool_calls(calls)
            choice["message"] = message
        else:
            choice["text"] = content
        if self.token_ids:
            choice["token_ids"] = outcome.token_ids
        return self._envelope([choice], chunk=False) | {"usage": usage(outcome)}

    async def stream(self, include_usage: bool) -> AsyncIterator[bytes]:
        extra = {"usage": None} if include_usage else {}
        num_calls = 0
        offset = 0
        if self.chat:
            start = {"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None}
            yield sse_event(self._envelope([start], chunk=True) | extra)
        source = self.gen.pieces()
        echo = None if self.chat else self.gen.prepared.echo
        if echo is not None:
            if self.gen.prepared.sampling.get("prompt_logprobs") is not None:
                # the prompt's log-probabilities come with the done event: its chunk waits for it
                async with contextlib.aclosing(source) as pieces:
                    held = [piece async for piece in pieces]
                source = _replay(held)
            first = {"index": 0, "logprobs": self._prompt_logprobs(), "finish_reason": None, "text": echo}
            if self.token_ids:
                first["token_ids"] = []
            yield sse_event(self._envelope([first], chunk=True) | extra)
            offset = len(echo)
        async with contextlib.aclosing(source) as pieces:
            async for piece in pieces:
                choice: dict[str, Any] = {"index": 0, "logprobs": self.logprobs(piece.tokens, offset), "finish_reason": None}
                offset += len(piece.text)
                if self.chat:
                    delta: dict[str, Any] = {"content": piece.text} if piece.text or not piece.tool_calls else {}
                    if piece.tool_calls:
                        delta["tool_calls"] = _tool_calls(piece.tool_calls, first_index=num_calls)
                        num_calls += len(piece.tool_calls)
                    choice["delta"] = delta
                else:
                    choice["text"] = piece.text
                if self.token_ids:
                    choice["token_ids"] = [t.token_id for t in piece.tokens]
                yield sse_event(self._envelope([choice], chunk=True) | extra)
        if self.gen.error is not None:
            yield sse_event(self.gen.error.openai_body())
            yield sse_event("[DONE]")
            return
        outcome = self.gen.outcome
        last: dict[str, Any] = {"index": 0, "logprobs": None, "finish_reason": finish_reason(outcome)}
        last |= {"delta": {}} if self.chat else {"text": ""}
        if self.token_ids:
            last["token_ids"] = []
        yield sse_event(self._envelope([last], chunk=True) | extra)
        if include_usage:
            yield sse_event(self._envelope([], chunk=True) | {"usage": usage(outcome)})
        yield sse_event("[DONE]")


async def _replay(pieces: list[Any]) -> AsyncIterator[Any]:
    for piece in pieces:
        yield piece
