"""The Anthropic Messages API: request bodies into the engine's terms, and engine output
into `message` objects and the streaming event sequence (the one place that shapes them)."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from typing import Any

import msgspec

from unikern.frontends.http.chat import ToolCall, render_chat, tool_call_id
from unikern.frontends.http.errors import APIError
from unikern.frontends.http.generation import Generation, Outcome, Prepared, ServerState
from unikern.frontends.http.responses import sse_event


class MessagesRequest(msgspec.Struct):
    model: str
    max_tokens: int
    messages: list[Any]
    system: str | list[Any] | None = None
    stop_sequences: list[str] | None = None
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    stream: bool = False
    metadata: dict[str, Any] | None = None
    tools: list[Any] | None = None
    tool_choice: dict[str, Any] | None = None


class CountTokensRequest(msgspec.Struct):
    model: str
    messages: list[Any]
    system: str | list[Any] | None = None
    tools: list[Any] | None = None
    tool_choice: dict[str, Any] | None = None

    def fields(self) -> dict[str, Any]:
        return dict(messages=self.messages, system=self.system, tools=self.tools, tool_choice=self.tool_choice)


def _blocks(content: Any, where: str) -> list[dict[str, Any]]:
    if isinstance(content, str):
        return [{"type": "text", "text": content}]
    if not isinstance(content, list):
        raise APIError(400, f"{where}: expected a string or a list of content blocks", param=where)
    for i, block in enumerate(content):
        kind = block.get("type") if isinstance(block, dict) else None
        if kind not in ("text", "tool_use", "tool_result"):
            raise APIError(400, f"{where}[{i}]: unsupported content block {kind!r} (text, tool_use, tool_result)", param=where)
    return content


def _text(blocks: list[dict[str, Any]]) -> str:
    return "".join(b.get("text", "") for b in blocks if b.get("type") == "text")


def template_turns(body: MessagesRequest) -> list[dict[str, Any]]:
    """System, messages and tool blocks as the chat template expects them."""
    turns: list[dict[str, Any]] = []
    if body.system:
        turns.append({"role": "system", "content": _text(_blocks(body.system, "system"))})
    if not body.messages:
        raise APIError(400, "messages: give at least one message", param="messages")
    for i, message in enumerate(body.messages):
        where = f"messages[{i}]"
        if not isinstance(message, dict) or message.get("role") not in ("user", "assistant"):
            raise APIError(400, f"{where}.role: expected user or assistant", param="messages")
        blocks = _blocks(message.get("content"), f"{where}.content")
        for block in blocks:
            if block["type"] == "tool_result":
                result = block.get("content", "")
                text = result if isinstance(result, str) else _text(_blocks(result, f"{where}.content"))
                turns.append({"role": "tool", "tool_call_id": block.get("tool_use_id"), "content": text})
        calls = [
            {"id": b.get("id"), "type": "function", "function": {"name": b.get("name"), "arguments": b.get("input", {})}}
            for b in blocks if b["type"] == "tool_use"
        ]
        text = _text(blocks)
        if text or calls or not any(b["type"] == "tool_result" for b in blocks):
            turn: dict[str, Any] = {"role": message["role"], "content": text}
            if calls:
                turn["tool_calls"] = calls
            turns.append(turn)
    return turns


def _functions(tools: list[Any] | None) -> list[dict[str, Any]] | None:
    functions = []
    for i, tool in enumerate(tools or ()):
        if not isinstance(tool, dict) or not isinstance(tool.get("name"), str):
            raise APIError(400, f"tools[{i}]: expected {{'name', 'description', 'input_schema'}}", param="tools")
        functions.append({"type": "function", "function": {
            "name": tool["name"], "description": tool.get("description", ""),
            "parameters": tool.get("input_schema", {"type": "object"}),
        }})
    return functions or None


def prepare_messages(state: ServerState, body: MessagesRequest) -> Prepared:
    none = (body.tool_choice or {}).get("type") == "none"
    tools = None if none else _functions(body.tools)
    tokens = render_chat(state.tokenizer, template_turns(body), tools)
    sampling = dict(temperature=body.temperature, top_p=body.top_p, top_k=body.top_k, stop=body.stop_sequences)
    parse = bool(tools) and bool(getattr(state.tokenizer, "has_tool_calling", False))
    return Prepared(body.max_tokens, sampling, prompt_tokens=tokens, tools=tools, parse_tools=parse)


# ---- engine output -> Anthropic objects ----------------------------------------------


def stop_reason(outcome: Outcome) -> str:
    if outcome.finish_reason != "stop":
        return "max_tokens"  # max_tokens, the context's end, or cut short by a shutdown
    if outcome.num_tool_calls:
        return "tool_use"
    return "stop_sequence" if outcome.stop_sequence is not None else "end_turn"


def usage(outcome: Outcome) -> dict[str, int]:
    u = outcome.usage
    return {
        "input_tokens": u.prompt_tokens - u.cached_tokens,  # Anthropic counts cache reads apart
        "output_tokens": u.completion_tokens,
        "cache_read_input_tokens": u.cached_tokens,
        "cache_creation_input_tokens": 0,
    }


def _tool_block(call: ToolCall) -> dict[str, Any]:
    return {"type": "tool_use", "id": tool_call_id("toolu_"), "name": call.name, "input": call.arguments_object()}


class Shaper:
    def __init__(self, state: ServerState, gen: Generation, message_id: str, num_prompt_tokens: int) -> None:
        self.state = state
        self.gen = gen
        self.id = message_id
        self.num_prompt_tokens = num_prompt_tokens

    def _message(self, content: list[dict[str, Any]], outcome: Outcome | None) -> dict[str, Any]:
        return {
            "id": self.id, "type": "message", "role": "assistant", "model": self.state.model_id,
            "content": content,
            "stop_reason": stop_reason(outcome) if outcome else None,
            "stop_sequence": outcome.stop_sequence if outcome else None,
            "usage": usage(outcome) if outcome else {"input_tokens": self.num_prompt_tokens, "output_tokens": 0},
        }

    async def collect(self) -> dict[str, Any]:
        content: list[dict[str, Any]] = []
        async with contextlib.aclosing(self.gen.pieces()) as pieces:
            async for piece in pieces:
                if piece.text:
                    if content and content[-1]["type"] == "text":
                        content[-1]["text"] += piece.text
                    else:
                        content.append({"type": "text", "text": piece.text})
                content += [_tool_block(call) for call in piece.tool_calls]
        if self.gen.error is not None:
            raise self.gen.error
        return self._message(content or [{"type": "text", "text": ""}], self.gen.outcome)

    async def stream(self) -> AsyncIterator[bytes]:
        yield sse_event({"type": "message_start", "message": self._message([], None)}, "message_start")
        yield sse_event({"type": "ping"}, "ping")
        index, text_open = -1, False
        async with contextlib.aclosing(self.gen.pieces()) as pieces:
            async for piece in pieces:
                if piece.text:
                    if not text_open:
                        index, text_open = index + 1, True
                        yield _start(index, {"type": "text", "text": ""})
                    yield _delta(index, {"type": "text_delta", "text": piece.text})
                for call in piece.tool_calls:
                    if text_open:
                        yield _stop(index)
                        text_open = False
                    block = _tool_block(call)
                    index += 1
                    yield _start(index, block | {"input": {}})
                    yield _delta(index, {"type": "input_json_delta", "partial_json": msgspec.json.encode(block["input"]).decode()})
                    yield _stop(index)
        if self.gen.error is not None:
            yield sse_event(self.gen.error.anthropic_body(), "error")
            return
        if index < 0:  # nothing was said: one empty text block, as the API always has one
            index, text_open = 0, True
            yield _start(0, {"type": "text", "text": ""})
        if text_open:
            yield _stop(index)
        outcome = self.gen.outcome
        delta = {"stop_reason": stop_reason(outcome), "stop_sequence": outcome.stop_sequence}
        yield sse_event({"type": "message_delta", "delta": delta, "usage": usage(outcome)}, "message_delta")
        yield sse_event({"type": "message_stop"}, "message_stop")


def _start(index: int, block: dict[str, Any]) -> bytes:
    return sse_event({"type": "content_block_start", "index": index, "content_block": block}, "content_block_start")


def _delta(index: int, delta: dict[str, Any]) -> bytes:
    return sse_event({"type": "content_block_delta", "index": index, "delta": delta}, "content_block_delta")


def _stop(index: int) -> bytes:
    return sse_event({"type": "content_block_stop", "index": index}, "content_block_stop")
