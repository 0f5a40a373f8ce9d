"""Tool calls through `unikern serve`: a model whose chat template declares tools (mlx-lm
picks its `json_tools` parser for it) and whose reply is always one call."""

from __future__ import annotations

import json

import openai
import pytest

from tests.conftest import SMALL_KV
from tests.http_support import build_tool_model, running_server
from unikern.engine import Engine

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest.fixture(scope="module")
def served(tiny_llama, tmp_path_factory):
    model = build_tool_model(tiny_llama, tmp_path_factory.mktemp("tool_model") / "model")
    with running_server(lambda: Engine.from_pipeline("generate", model=str(model), overrides=SMALL_KV)) as running:
        yield running


@pytest.fixture(scope="module")
def oa(served) -> openai.OpenAI:
    return served.openai()


def test_tool_calls_come_back_as_tool_calls(oa) -> None:
    reply = oa.chat.completions.create(model="m", messages=ASK, tools=[WEATHER], max_tokens=8, temperature=0)
    choice = reply.choices[0]
    assert choice.finish_reason == "tool_calls" and not choice.message.content
    (call,) = choice.message.tool_calls
    assert call.type == "function" and call.id.startswith("call_") and call.function.name == "get_weather"
    assert json.loads(call.function.arguments) == {"city": "Paris"}


def test_the_tools_reach_the_template_and_only_offered_tools_are_parsed(oa) -> None:
    offered = oa.chat.completions.create(model="m", messages=ASK, tools=[WEATHER], max_tokens=8, temperature=0)
    plain = oa.chat.completions.create(model="m", messages=ASK, max_tokens=8, temperature=0)
    assert offered.usage.prompt_tokens > plain.usage.prompt_tokens + 20  # the template rendered the tool
    assert plain.choices[0].finish_reason == "stop" and plain.choices[0].message.tool_calls is None
    assert plain.choices[0].message.content.startswith('<tool_call>{"name":"get_weather"')
    declined = oa.chat.completions.create(
        model="m", messages=ASK, tools=[WEATHER], tool_choice="none", max_tokens=8, temperature=0
    )
    assert declined.choices[0].message.tool_calls is None


def test_streamed_tool_calls(oa) -> None:
    chunks = list(oa.chat.completions.create(model="m", messages=ASK, tools=[WEATHER], max_tokens=8, temperature=0, stream=True))
    calls = [call for c in chunks if c.choices and c.choices[0].delta.tool_calls for call in c.choices[0].delta.tool_calls]
    assert [(c.index, c.function.name, json.loads(c.function.arguments)) for c in calls] == [(0, "get_weather", {"city": "Paris"})]
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == ""
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "tool_calls"


def test_a_conversation_with_a_tool_result_renders(oa) -> None:
    call = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}
    turns = [*ASK, {"role": "assistant", "content": None, "tool_calls": [call]},
             {"role": "tool", "tool_call_id": "call_1", "content": "sunny, 21 C"}]
    reply = oa.chat.completions.create(model="m", messages=turns, tools=[WEATHER], max_tokens=8, temperature=0)
    assert reply.usage.prompt_tokens > 0 and reply.choices[0].message.tool_calls[0].function.name == "get_weather"


def test_anthropic_tool_use(served) -> None:
    client = served.anthropic()
    tool = {"name": "get_weather", "description": "The weather in a city", "input_schema": WEATHER["function"]["parameters"]}
    reply = client.messages.create(model="m", max_tokens=8, messages=ASK, tools=[tool])
    assert reply.stop_reason == "tool_use"
    (block,) = reply.content
    assert block.type == "tool_use" and block.name == "get_weather" and block.input == {"city": "Paris"}
    with client.messages.stream(model="m", max_tokens=8, messages=ASK, tools=[tool]) as stream:
        final = stream.get_final_message()
    assert final.stop_reason == "tool_use" and final.content[0].input == {"city": "Paris"}
    follow_up = [*ASK, {"role": "assistant", "content": [{"type": "tool_use", "id": block.id, "name": block.name, "input": block.input}]},
                 {"role": "user", "content": [{"type": "tool_result", "tool_use_id": block.id, "content": "sunny"}]}]
    assert client.messages.create(model="m", max_tokens=8, messages=follow_up, tools=[tool]).stop_reason == "tool_use"


# ---- the splitter alone: markers split across tokens ---------------------------------------


def splitter():
    from types import SimpleNamespace

    from mlx_lm.tool_parsers import json_tools

    from unikern.frontends.http.chat import ToolCallSplitter

    tokenizer = SimpleNamespace(tool_call_start=json_tools.tool_call_start, tool_call_end=json_tools.tool_call_end,
                                tool_parser=json_tools.parse_tool_call)
    return ToolCallSplitter(tokenizer, [WEATHER])


def test_markers_split_across_tokens_are_held_back_then_parsed() -> None:
    split = splitter()
    pieces = ["Let me check <", "tool_", 'call>{"name": "get_weather", ', '"arguments": {"city": "Paris"}}</tool', "_call> done <", "b>"]
    shown, calls = [], []
    for piece in pieces:
        text, found = split.feed(piece)
        shown.append(text)
        calls += found
    text, found = split.finish()
    shown.append(text)
    assert shown == ["Let me check ", "", "", "", " done ", "<b>", ""]
    assert [(c.name, c.arguments) for c in calls] == [("get_weather", {"city": "Paris"})] and split.num_calls == 1


def test_a_call_the_parser_refuses_stays_text() -> None:
    split = splitter()
    assert split.feed("<tool_call>not json</tool_call>") == ("<tool_call>not json</tool_call>", [])
    text, calls = splitter().feed('<tool_call>{"name": "get_weather", "arguments": {}}')
    assert (text, calls) == ("", [])
    unterminated = splitter()
    unterminated.feed('<tool_call>{"name": "get_weather", "arguments": {}}')
    assert [c.name for c in unterminated.finish()[1]] == ["get_weather"]
