"""Chat prompts through the model's chat template (with tools), and tool calls out of the
generated text with mlx-lm's own parser for the model (`TokenizerWrapper.tool_parser`)."""

from __future__ import annotations

import json
import uuid
from collections.abc import Sequence
from typing import Any

from unikern.errors import RequestError
from unikern.frontends.http.errors import APIError
from unikern.stages.tokenize import chat_prompt_tokens

ROLES = ("system", "user", "assistant", "tool")


def _text_of(content: Any, where: str) -> str:
    """String content, or a list of text parts (OpenAI `{"type": "text", "text"}`)."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        pieces = []
        for i, part in enumerate(content):
            if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                kind = part.get("type") if isinstance(part, dict) else type(part).__name__
                raise APIError(400, f"{where}[{i}]: only text content is supported, got {kind!r}", param=where)
            pieces.append(part["text"])
        return "".join(pieces)
    raise APIError(400, f"{where}: expected a string or a list of text parts", param=where)


def openai_messages(messages: Sequence[Any]) -> list[dict[str, Any]]:
    """OpenAI chat messages as the chat template expects them (arguments as objects)."""
    if not messages:
        raise APIError(400, "messages: give at least one message", param="messages")
    turns = []
    for i, message in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(message, dict) or message.get("role") not in ROLES:
            got = message.get("role") if isinstance(message, dict) else message
            raise APIError(400, f"{where}.role: expected one of {', '.join(ROLES)}, got {got!r}", param="messages")
        turn: dict[str, Any] = {"role": message["role"], "content": _text_of(message.get("content"), f"{where}.content")}
        for key in ("name", "tool_call_id"):
            if isinstance(message.get(key), str):
                turn[key] = message[key]
        if message.get("tool_calls"):
            turn["tool_calls"] = [_template_call(call, f"{where}.tool_calls") for call in message["tool_calls"]]
        turns.append(turn)
    return turns


def _template_call(call: Any, where: str) -> dict[str, Any]:
    function = call.get("function") if isinstance(call, dict) else None
    if not isinstance(function, dict) or not isinstance(function.get("name"), str):
        raise APIError(400, f"{where}: expected {{'type': 'function', 'function': {{'name', 'arguments'}}}}", param="messages")
    arguments = function.get("arguments", {})
    if isinstance(arguments, str):  # templates render the arguments object themselves
        try:
            arguments = json.loads(arguments) if arguments.strip() else {}
        except ValueError:
            raise APIError(400, f"{where}: function.arguments is not valid JSON", param="messages") from None
    return {"id": call.get("id"), "type": "function", "function": {"name": function["name"], "arguments": arguments}}


def render_chat(tokenizer: Any, turns: list[dict[str, Any]], tools: list[dict[str, Any]] | None) -> list[int]:
    """Prompt token ids of a conversation, ready for the assistant's turn."""
    if getattr(tokenizer, "chat_template", None) is None:
        raise APIError(400, "this model has no chat template: use /v1/completions with a prompt")
    try:
        return chat_prompt_tokens(tokenizer, turns, tools)
    except RequestError as exc:
        raise APIError(400, str(exc), param="messages") from None


def tool_call_id(prefix: str = "call_") -> str:
    return f"{prefix}{uuid.uuid4().hex[:24]}"


class ToolCall:
    __slots__ = ("id", "name", "arguments")

    def __init__(self, name: str, arguments: Any) -> None:
        self.id = tool_call_id()
        self.name = name
        self.arguments = arguments  # a mapping, or the model's own string

    def arguments_json(self) -> str:
        return self.arguments if isinstance(self.arguments, str) else json.dumps(self.arguments, ensure_ascii=False)

    def arguments_object(self) -> Any:
        if not isinstance(self.arguments, str):
            return self.arguments
        try:
            return json.loads(self.arguments)
        except ValueError:
            return {"arguments": self.arguments}


class ToolCallSplitter:
    """Splits streamed text into plain text and tool calls between the model's markers.

    Text that may still turn into a start marker is held back until it cannot. A call
    the parser refuses comes out as the text it was, markers included."""

    def __init__(self, tokenizer: Any, tools: list[dict[str, Any]] | None) -> None:
        self.start: str = tokenizer.tool_call_start
        self.end: str = tokenizer.tool_call_end
        self.parse = tokenizer.tool_parser
        self.tools = tools
        self.buffer = ""
        self.in_call = False
        self.num_calls = 0

    def feed(self, text: str) -> tuple[str, list[ToolCall]]:
        """Text now safe to show, and the calls completed by this piece."""
        self.buffer += text
        shown, calls = [], []
        while True:
            if self.in_call:
                cut = self.buffer.find(self.end)
                if cut < 0:
                    break
                body, self.buffer = self.buffer[:cut], self.buffer[cut + len(self.end):]
                self.in_call = False
                parsed = self._parse(body)
                if parsed is None:
                    shown.append(self.start + body + self.end)
                calls += parsed or []
            else:
                cut = self.buffer.find(self.start)
                if cut < 0:
                    keep = _partial_suffix(self.buffer, self.start)
                    shown.append(self.buffer[: len(self.buffer) - keep])
                    self.buffer = self.buffer[len(self.buffer) - keep:]
                    break
                shown.append(self.buffer[:cut])
                self.buffer = self.buffer[cut + len(self.start):]
                self.in_call = True
        self.num_calls += len(calls)
        return "".join(shown), calls

    def finish(self) -> tuple[str, list[ToolCall]]:
        """At the end of generation: an unterminated call is parsed if it can be."""
        rest, self.buffer = self.buffer, ""
        if not self.in_call:
            return rest, []
        self.in_call = False
        calls = self._parse(rest)
        self.num_calls += len(calls or [])
        return ("", calls) if calls else (self.start + rest, [])

    def _parse(self, body: str) -> list[ToolCall] | None:
        try:
            parsed = self.parse(body, self.tools)
        except Exception:  # a parser's refusal: ValueError, JSONDecodeError, KeyError, ...
            return None
        found = parsed if isinstance(parsed, list) else [parsed]
        if not all(isinstance(c, dict) and isinstance(c.get("name"), str) for c in found):
            return None
        return [ToolCall(c["name"], c.get("arguments", {})) for c in found]


def _partial_suffix(text: str, marker: str) -> int:
    """Length of the longest end of `text` that is a proper start of `marker`."""
    for size in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-size:]):
            return size
    return 0
