"""Tool calling at the router (``services/router/tools.py``): the request's tools and tool_choice checked with
errors that name the field, the constraint ``required`` and a named function give the engine, the prompt for
templates with and without tool support, and the output read back into calls, whole and chunk by chunk."""

from __future__ import annotations

import json
import random

import jsonschema
import pytest
from kvmesh.contracts.sampling import StructuredOutput

from services.router import openai_body
from services.router.errors import RequestError
from services.router.intake import chat_messages
from services.router.tool_formats import CLOSE, OPEN, CallDelta, TaggedCalls
from services.router.tools import (
    CallList,
    Choice,
    NamedCall,
    Tools,
    finish_reason,
    for_template,
    tools_from_body,
    whole_calls,
)

WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "a city's weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
ROUTE = {"type": "function", "function": {"name": "route", "parameters": {
    "$defs": {"pt": {"type": "object", "properties": {"x": {"type": "integer"}}, "required": ["x"]}},
    "type": "object", "properties": {"a": {"$ref": "#/$defs/pt"}, "b": {"$ref": "#/$defs/pt"}},
    "required": ["a", "b"]}}}
NAMES = frozenset({"get_weather", "route"})


def tools(choice=None, parallel=None, given=(WEATHER, ROUTE)) -> Tools:
    body = {"tools": list(given)}
    if choice is not None:
        body["tool_choice"] = choice
    if parallel is not None:
        body["parallel_tool_calls"] = parallel
    out = tools_from_body(body)
    assert out is not None
    return out


def refused(body: dict) -> str:
    with pytest.raises(RequestError) as e:
        tools_from_body(body)
    return e.value.message


# ---- the request ---------------------------------------------------------------------------------------------

def test_no_tools_is_none_and_choice_needs_tools():
    assert tools_from_body({}) is None and tools_from_body({"tools": [], "tool_choice": "none"}) is None
    assert "tool_choice needs tools" in refused({"tool_choice": "required"})


@pytest.mark.parametrize("body,words", [
    ({"tools": {"name": "x"}}, "tools must be a list"),
    ({"tools": [{"type": "retrieval"}]}, "tools[0] must be"),
    ({"tools": [{"type": "function", "function": {"name": "has space"}}]}, "tools[0].function.name must be"),
    ({"tools": [{"type": "function", "function": {"name": "x" * 65}}]}, "tools[0].function.name must be"),
    ({"tools": [WEATHER, WEATHER]}, "'get_weather' is given twice"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": []}}]},
     "tools[0].function.parameters must be a JSON schema"),
    ({"tools": [{"type": "function", "function": {"name": "f", "description": 3}}]},
     "tools[0].function.description must be a string"),
    ({"tools": [WEATHER], "tool_choice": "always"}, "tool_choice must be"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}},
     "names the function 'nope', which is not in tools (get_weather)"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function"}}, "tool_choice must be"),
    ({"tools": [WEATHER], "parallel_tool_calls": "yes"}, "parallel_tool_calls must be true or false"),
    ({"tools": [WEATHER, {"type": "function", "function": {"name": "g", "parameters": {"not": {}}}}],
      "tool_choice": "required"}, "tools[1].function.parameters: keyword 'not'"),
])
def test_bad_tools_name_the_field(body, words):
    assert words in refused(body)


def test_auto_takes_a_schema_no_engine_could_enforce():
    """``auto`` constrains nothing: a schema keyword structured output lacks is only shown to the model."""
    t = tools(given=[WEATHER, {"type": "function", "function": {"name": "g", "parameters": {"not": {}}}}])
    assert t.choice == Choice.AUTO and t.constraint() is None


def test_choices():
    assert tools().choice == Choice.AUTO and tools("none").offered == () and tools("auto").names == NAMES
    named = tools({"type": "function", "function": {"name": "route"}})
    assert (named.choice, named.named) == (Choice.NAMED, "route")
    assert tools(parallel=False).parallel is False and tools().parallel is True


def test_named_constraint_is_the_functions_arguments():
    c = tools({"type": "function", "function": {"name": "get_weather"}}).constraint()
    assert c == StructuredOutput("json_schema", json.dumps(WEATHER["function"]["parameters"]))


def test_required_constraint_takes_calls_of_offered_tools_only():
    schema = json.loads(tools("required").constraint().spec)
    ok = [{"name": "get_weather", "arguments": {"city": "Paris"}},
          {"name": "route", "arguments": {"a": {"x": 1}, "b": {"x": 2}}}]
    jsonschema.validate(ok, schema)
    for bad in ([], [{"name": "other", "arguments": {}}], [{"name": "get_weather", "arguments": {}}],
                [{"name": "route", "arguments": {"a": {"x": "1"}, "b": {"x": 2}}}],  # through the moved $ref
                [{"name": "get_weather", "arguments": {"city": "x"}, "extra": 1}]):
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(bad, schema)
    one = json.loads(tools("required", parallel=False).constraint().spec)
    jsonschema.validate(ok[:1], one)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(ok, one)


def test_a_tool_choice_constraint_is_the_requests_one_constraint():
    body = {"messages": [{"role": "user", "content": "hi"}], "tools": [WEATHER], "tool_choice": "required"}
    draft = openai_body.draft(body, True, {})
    assert draft.structured_field == "tool_choice" and draft.sampling.structured.kind == "json_schema"
    assert openai_body.draft({**body, "tool_choice": "auto"}, True, {}).sampling.structured is None
    with pytest.raises(RequestError, match="cannot take response_format too"):
        openai_body.draft({**body, "response_format": {"type": "json_object"}}, True, {})
    with pytest.raises(RequestError, match="tools are for /v1/chat/completions"):
        openai_body.draft({"prompt": "hi", "tools": [WEATHER]}, False, {})


@pytest.mark.parametrize(("keeps", "choice", "kept"), [
    (True, "auto", True), (True, None, True), (True, "none", False), (True, "required", False), (False, "auto", False)])
def test_special_tokens_stay_in_the_text_while_the_model_may_write_a_call_in_them(keeps, choice, kept):
    """When the markers of the model's calls are special tokens (``Router.tool_keeps_special``), a request that
    lets the model call (``auto``) keeps them in its text; ``required`` and a named function are constrained
    JSON, ``none`` offers no tool."""
    from types import SimpleNamespace

    from services.router.intake import Intake

    intake = Intake.__new__(Intake)
    intake.router = SimpleNamespace(tool_keeps_special=keeps)
    body = {"messages": [{"role": "user", "content": "hi"}], "tools": [WEATHER]}
    if choice is not None:
        body["tool_choice"] = choice
    assert intake.sampling(openai_body.draft(body, True, {})).skip_special_tokens is not kept
    without = openai_body.draft({"messages": body["messages"]}, True, {})
    assert intake.sampling(without).skip_special_tokens  # no tools: the client's choice (default skip)


# ---- the prompt ----------------------------------------------------------------------------------------------

class Template:
    def __init__(self, tools: bool, calls: bool) -> None:
        self.takes_tools, self.takes_tool_calls = tools, calls


CALLED = [{"role": "user", "content": "weather?"},
          {"role": "assistant", "content": None, "tool_calls": [
              {"id": "call_1", "type": "function",
               "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}]},
          {"role": "tool", "tool_call_id": "call_1", "content": "3 C"}]


def test_a_template_without_tools_gets_them_described_and_calls_written():
    chat, offered = for_template(chat_messages(CALLED), tools(), Template(False, False))
    assert offered is None and chat[0]["role"] == "system"
    assert "get_weather" in chat[0]["content"] and OPEN in chat[0]["content"] and "route" in chat[0]["content"]
    assert "tool_calls" not in chat[2] and json.loads(chat[2]["content"].removeprefix(OPEN).removesuffix(CLOSE)) == {
        "name": "get_weather", "arguments": {"city": "Oslo"}}
    assert chat[3] == {"role": "tool", "content": "3 C", "tool_call_id": "call_1"}
    system = [{"role": "system", "content": "Be brief."}, *CALLED]
    chat, _ = for_template(chat_messages(system), tools(), Template(False, False))
    assert chat[0]["content"].startswith("Be brief.\n\n# Tools") and len(chat) == 4


def test_a_template_with_tools_gets_them_as_they_came():
    chat, offered = for_template(chat_messages(CALLED), tools(), Template(True, True))
    assert offered == [WEATHER, ROUTE] and chat[0]["role"] == "user"
    assert chat[1]["tool_calls"][0]["function"] == {"name": "get_weather", "arguments": {"city": "Oslo"}}
    assert for_template(chat_messages(CALLED), tools("none"), Template(True, True))[1] is None
    assert for_template(chat_messages(CALLED), None, Template(False, True))[0][1]["tool_calls"]


def test_tokenizer_says_whether_its_template_takes_tools(tmp_path):
    from kvmesh.model_source.tokenizer import Tokenizer, save_byte_tokenizer

    tok = Tokenizer.from_dir(save_byte_tokenizer(tmp_path / "tok"))
    assert not tok.takes_tools
    tok.chat_template = ("{% if tools %}{% for t in tools %}{{ t.function.name }};{% endfor %}{% endif %}"
                         "{% for m in messages %}{{ m.content }}{% endfor %}")
    assert tok.takes_tools and not tok.takes_tool_calls
    assert tok.apply_chat_template([{"role": "user", "content": "hi"}], tools=[WEATHER]) == tok.encode("get_weather;hi")


@pytest.mark.parametrize("message,words", [
    ({"role": "assistant", "content": None, "tool_calls": {"id": "x"}}, "messages[0].tool_calls must be a list"),
    ({"role": "assistant", "content": None, "tool_calls": [{"function": {"arguments": "{}"}}]},
     "messages[0].tool_calls[0] must be"),
    ({"role": "assistant", "content": None, "tool_calls": [{"function": {"name": "f", "arguments": "{oops"}}]},
     "messages[0].tool_calls[0].function.arguments is not valid JSON"),
    ({"role": "assistant", "content": None, "tool_calls": [{"function": {"name": "f", "arguments": "[1]"}}]},
     "must be a JSON object"),
    ({"role": "user", "content": None}, "messages[0].content must be a string"),
])
def test_bad_calls_in_messages_name_the_field(message, words):
    with pytest.raises(RequestError) as e:
        chat_messages([message, {"role": "user", "content": "hi"}])
    assert words in e.value.message


# ---- the output ----------------------------------------------------------------------------------------------

def read(reader, pieces: list[str]) -> tuple[str, list[dict], bool]:
    text, deltas = "", []
    for p in pieces:
        said, calls = reader.feed(p)
        text, deltas = text + said, deltas + calls
    said, calls = reader.close()
    calls = whole_calls(deltas + calls)
    for c in calls:
        assert c["id"].startswith("call_") and c["type"] == "function"
    return text + said, [c["function"] for c in calls], reader.called


TEXT = (f'Let me look. {OPEN}\n{{"name": "get_weather", "arguments": {{"city": "Paris"}}}}\n{CLOSE}\n'
        f'{OPEN}{{"name": "route", "parameters": {{"a": {{"x": 1}}, "b": {{"x": 2}}}}}}{CLOSE} <b>done</b>')


def test_tagged_calls_out_of_text():
    text, calls, called = read(TaggedCalls(NAMES), [TEXT])
    assert called and text == "Let me look. \n <b>done</b>"
    assert calls == [{"name": "get_weather", "arguments": '{"city": "Paris"}'},
                     {"name": "route", "arguments": '{"a": {"x": 1}, "b": {"x": 2}}'}]


def test_tagged_calls_the_same_however_the_text_is_cut():
    whole = read(TaggedCalls(NAMES), [TEXT])
    rng = random.Random(3)
    for _ in range(200):
        cuts = sorted(rng.sample(range(1, len(TEXT)), rng.randrange(1, 12)))
        pieces = [TEXT[a:b] for a, b in zip([0, *cuts], [*cuts, len(TEXT)])]
        assert read(TaggedCalls(NAMES), pieces) == whole
    assert read(TaggedCalls(NAMES), list(TEXT)) == whole  # a character at a time


@pytest.mark.parametrize("block", ['{"name": "unknown", "arguments": {}}', "{not json", '["get_weather"]',
                                   '{"name": "get_weather", "arguments": "[1]"}'])
def test_a_block_that_is_not_a_call_stays_text(block):
    text = f"a {OPEN}{block}{CLOSE} b"
    assert read(TaggedCalls(NAMES), [text]) == (text, [], False)


def test_an_unfinished_block_and_a_lone_bracket_stay_text():
    assert read(TaggedCalls(NAMES), ["x <tool_c", 'all>{"name": "get_weather"']) == (
        'x <tool_call>{"name": "get_weather"', [], False)
    assert read(TaggedCalls(NAMES), ["a <", "tool", "s> b"]) == ("a <tools> b", [], False)
    reader = TaggedCalls(NAMES)
    assert reader.feed("a <tool")[0] == "a "  # held back while it could still be a tag


def test_one_call_when_parallel_calls_are_off():
    text, calls, _ = read(TaggedCalls(NAMES, parallel=False), [TEXT])
    assert [c["name"] for c in calls] == ["get_weather"] and "route" in text


def test_required_list_and_a_cut_one():
    out = json.dumps([{"name": "get_weather", "arguments": {"city": "Rome"}}, {"name": "route", "arguments": {}}])
    text, calls, called = read(CallList(NAMES), [out[:7], out[7:]])
    assert called and text == "" and [c["name"] for c in calls] == ["get_weather", "route"]
    assert read(CallList(NAMES), [out[:20]]) == (out[:20], [], False)


def test_named_call_streams_its_arguments():
    reader = NamedCall("get_weather")
    first = reader.feed('{"ci')[1]
    assert first[0].name == "get_weather" and first[0].id and first[0].arguments == '{"ci'
    rest = reader.feed('ty": "Oslo"}')[1]
    assert rest[0].wire() == {"index": 0, "function": {"arguments": 'ty": "Oslo"}'}}
    assert whole_calls(first + rest)[0]["function"] == {"name": "get_weather", "arguments": '{"city": "Oslo"}'}
    assert read(NamedCall("f"), []) == ("", [{"name": "f", "arguments": ""}], True)


def test_finish_reason():
    assert finish_reason("stop", True) == "tool_calls"
    assert finish_reason("length", True) == "length" and finish_reason("stop", False) == "stop"
    assert CallDelta(1, "call_x", "f", "{}").wire() == {"index": 1, "id": "call_x", "type": "function",
                                                        "function": {"name": "f", "arguments": "{}"}}
