"""adapters/tool_calls.py alone: tool choices to constraints, calls parsed out of outputs, and streamed
deltas that assemble (as the openai client does) into exactly the calls of the whole output."""

from __future__ import annotations

import json

import pytest

from pagedcore.adapters.tool_calls import ToolCallStream, ToolChoiceError, parse_tool_calls, tool_request

WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
ADD = {"type": "function", "function": {"name": "add", "parameters": {
    "type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}}}}
CALLS = '[{"name": "get_weather", "arguments": {"city": "Pa\\"ris, {FR}"}}, {"name": "add", "arguments": {"a": 1, "b": -2}}]'


def assemble(deltas: list[dict]) -> tuple[str, list[tuple[str, str]]]:
    """What openai's stream helper builds from the deltas: content, and (name, arguments) per index."""
    content, calls = "", {}
    for d in deltas:
        content += d.get("content", "")
        for tc in d.get("tool_calls", []):
            call = calls.setdefault(tc["index"], ["", ""])
            if "id" in tc:
                assert tc["type"] == "function" and call == ["", ""], "id and name come once, first"
                call[0] = tc["function"]["name"]
            call[1] += tc["function"]["arguments"]
    return content, [tuple(calls[i]) for i in sorted(calls)]


def stream(text: str, req, step: int) -> list[dict]:
    s = ToolCallStream(req)
    pieces = [text[i:i + step] for i in range(0, len(text), step)]
    return [s.feed(p, i == len(pieces) - 1) for i, p in enumerate(pieces)]


@pytest.mark.parametrize("step", [1, 2, 3, 7, 1000])
def test_streamed_calls_assemble_into_the_parsed_calls_at_any_split(step):
    req = tool_request({"tools": [WEATHER, ADD], "tool_choice": "required"})
    content, calls = parse_tool_calls(CALLS, req)
    assert content is None
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls] == \
           [("get_weather", {"city": 'Pa"ris, {FR}'}), ("add", {"a": 1, "b": -2})]
    assert assemble(stream(CALLS, req, step)) == ("", [(c["function"]["name"], c["function"]["arguments"])
                                                       for c in calls])


@pytest.mark.parametrize("step", [1, 4, 1000])
def test_auto_reads_a_tool_call_block_and_leaves_other_text_as_content(step):
    req = tool_request({"tools": [WEATHER, ADD]})
    text = '<tool_call>{"name": "add", "arguments": {"a": 2, "b": 3}}</tool_call>'
    content, calls = parse_tool_calls(text, req)
    assert content is None and [c["function"]["arguments"] for c in calls] == ['{"a": 2, "b": 3}']
    assert assemble(stream(text, req, step)) == ("", [("add", '{"a": 2, "b": 3}')])
    for plain in ("<tool is not a call", "The answer is 5.", '<tool_call>{"name": "unknown", "arguments": {}}'):
        assert parse_tool_calls(plain, req) == (plain, [])
    assert assemble(stream("<tool is not a call", req, step)) == ("<tool is not a call", [])


def test_choices_become_constraints_and_bad_ones_are_named():
    named = tool_request({"tools": [WEATHER, ADD], "tool_choice": {"type": "function", "function": {"name": "add"}}})
    schema = named.structured_outputs()["json"]
    assert schema["properties"]["name"] == {"const": "add"} and schema["properties"]["arguments"] == \
           ADD["function"]["parameters"]
    required = tool_request({"tools": [WEATHER, ADD], "tool_choice": "required", "parallel_tool_calls": False})
    array = required.structured_outputs()["json"]
    assert array["minItems"] == 1 and array["maxItems"] == 1 and len(array["items"]["anyOf"]) == 2
    assert tool_request({"tools": [WEATHER], "tool_choice": "none"}) is None
    assert tool_request({"tools": [WEATHER]}).structured_outputs() is None  # auto: unconstrained
    for body, param in [({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "x"}}},
                         "tool_choice"),
                        ({"tools": [{"type": "retrieval"}]}, "tools"),
                        ({"tool_choice": "required"}, "tool_choice")]:
        with pytest.raises(ToolChoiceError) as e:
            tool_request(body)
        assert e.value.param == param
