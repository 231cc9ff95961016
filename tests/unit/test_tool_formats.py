"""The forms models write tool calls in (``services/router/tool_formats.py``): each read whole and chunk by chunk
the same, what is not a call returned as the model wrote it, each format's own written form read back as the same
calls, and the format picked from a chat template."""

from __future__ import annotations

import json
import random

import pytest
from kvmesh.settings.sections import RouterSettings

from services.router.intake import chat_messages
from services.router.sessions import ends_in_tool_call
from services.router.tool_formats import FORMATS, KIMI_ID, PARSERS, CallReader, detect, keeps_special_tokens, pick
from services.router.tools import Tools, for_template, read_whole, tools_from_body

NAMES = frozenset({"get_weather", "route"})
WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}}}}
ROUTE = {"type": "function", "function": {"name": "route", "parameters": {"type": "object"}}}
PARIS = ("get_weather", '{"city": "Paris"}')
LEG = ("route", '{"a": {"x": 1}, "b": [1, 2.5, null, true]}')

# (format, output, the calls it holds); [] = none: the output is content, as written
CASES = [
    ("llama3_json", '{"name": "get_weather", "parameters": {"city": "Paris"}}', [PARIS]),
    ("llama3_json", '<|python_tag|>{"name": "get_weather", "arguments": {"city": "Paris"}}', [PARIS]),
    ("llama3_json", (' {"name": "get_weather", "parameters": {"city": "Paris"}}; {"name": "route", "parameters": '
                    '{"a": {"x": 1}, "b": [1, 2.5, null, true]}}'), [PARIS, LEG]),
    ("llama3_json", '{"name": "get_weather", "parameters": "{\\"city\\": \\"Paris\\"}"}', [PARIS]),
    ("llama3_json", "It is sunny in Paris today.", []),
    ("llama3_json", '{"name": "nope", "parameters": {}}', []),
    ("llama3_json", '{"name": "get_weather", "parameters": {"city": "Par', []),  # cut short
    ("llama3_json", '{"name": "get_weather", "parameters": {"city": "Paris"}} and some words', []),
    ("mistral", '[{"name": "get_weather", "arguments": {"city": "Paris"}}]', [PARIS]),
    ("mistral", ('[TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Paris"}}, {"name": "route", '
                '"arguments": {"a": {"x": 1}, "b": [1, 2.5, null, true]}}]'), [PARIS, LEG]),
    ("mistral", 'get_weather{"city": "Paris"}', [PARIS]),
    ("mistral", ('get_weather[ARGS]{"city": "Paris"}[TOOL_CALLS]route[ARGS]{"a": {"x": 1}, "b": [1, 2.5, null, '
                'true]}'), [PARIS, LEG]),
    ("mistral", "[1] is the first reference.", []),
    ("mistral", "get_weather is a function I know.", []),
    ("pythonic", '[get_weather(city="Paris")]', [PARIS]),
    ("pythonic", "[get_weather(city='Paris'), route(a={'x': 1}, b=[1, 2.5, None, True])]", [PARIS, LEG]),
    ("pythonic", '<|python_tag|>[get_weather(city="Paris")]', [PARIS]),
    ("pythonic", '[get_weather("Paris")]', []),        # positional: no argument name to give it
    ("pythonic", "[get_weather(city=open('x'))]", []),  # not a literal: never evaluated
    ("pythonic", "[1, 2, 3] are numbers.", []),
    ("pythonic", "Paris is sunny.", []),
    ("hermes", 'Sure.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>', [PARIS]),
    ("qwen3_coder", ("<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n</function>\n"
                     "</tool_call>"), [PARIS]),
    ("qwen3_coder", ('Sure.\n<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n'
                     '</function>\n</tool_call>\n<tool_call>\n<function=route>\n<parameter=a>\n{"x": 1}\n'
                     '</parameter>\n<parameter=b>\n[1, 2.5, null, true]\n</parameter>\n</function>\n</tool_call>'),
     [PARIS, LEG]),
    ("qwen3_coder", '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>', [PARIS]),
    ("qwen3_coder", "<tool_call>\n<function=nope>\n</function>\n</tool_call>", []),
    ("qwen3_coder", "<tool_call>\n<function=get_weather>\nParis\n</function>\n</tool_call>", []),  # no parameter
    ("qwen3_coder", "<function=get_weather> is how I would call it.", []),
    ("hermes", '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n', [PARIS]),  # stopped before
    ("hermes", '<tool_call>\n{"name": "get_weather", "arguments": {"ci', []),  # cut short: text
    ("deepseek_v3", ("Sure.<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>get_weather\n```json\n"
                     '{"city": "Paris"}\n```<｜tool▁call▁end｜><｜tool▁calls▁end｜>'), [PARIS]),
    ("deepseek_v3", ("<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>get_weather\n```json\n"
                     '{"city": "Paris"}\n```<｜tool▁call▁end｜>\n<｜tool▁call▁begin｜>function<｜tool▁sep｜>route\n'
                     '```json\n{"a": {"x": 1}, "b": [1, 2.5, null, true]}\n```<｜tool▁call▁end｜><｜tool▁calls▁end｜>'),
     [PARIS, LEG]),
    ("deepseek_v31", ('<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>get_weather<｜tool▁sep｜>{"city": "Paris"}'
                      "<｜tool▁call▁end｜><｜tool▁calls▁end｜>"), [PARIS]),
    ("deepseek_v31", ('<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>get_weather<｜tool▁sep｜>{"city": "Paris"}'
                      '<｜tool▁call▁end｜><｜tool▁call▁begin｜>route<｜tool▁sep｜>{"a": {"x": 1}, "b": [1, 2.5, null, '
                      "true]}<｜tool▁call▁end｜>"), [PARIS, LEG]),  # the section's end tag never came
    ("deepseek_v31", ('<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>nope<｜tool▁sep｜>{}<｜tool▁call▁end｜>'
                      "<｜tool▁calls▁end｜>"), []),
    ("deepseek_v31", "Paris is sunny.", []),
    ("glm45", "Sure.\n<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>Paris</arg_value>\n</tool_call>",
     [PARIS]),
    ("glm45", ('<tool_call>get_weather<arg_key>city</arg_key><arg_value>Paris</arg_value></tool_call>\n<tool_call>'
               'route\n<arg_key>a</arg_key>\n<arg_value>{"x": 1}</arg_value>\n<arg_key>b</arg_key>\n'
               "<arg_value>[1, 2.5, null, true]</arg_value>\n</tool_call>"), [PARIS, LEG]),
    ("glm45", "<tool_call>route</tool_call>", [("route", "{}")]),  # no arguments
    ("glm45", "<tool_call>nope\n<arg_key>x</arg_key>\n<arg_value>1</arg_value>\n</tool_call>", []),
    ("glm45", "<tool_call>get_weather\nParis\n</tool_call>", []),  # text where the pairs go
    ("kimi_k2", ("Sure.<|tool_calls_section_begin|><|tool_call_begin|>functions.get_weather:0"
                 '<|tool_call_argument_begin|>{"city": "Paris"}<|tool_call_end|><|tool_calls_section_end|>'), [PARIS]),
    ("kimi_k2", ("<|tool_calls_section_begin|>\n<|tool_call_begin|>functions.get_weather:0\n"
                 '<|tool_call_argument_begin|>{"city": "Paris"}<|tool_call_end|>\n<|tool_call_begin|>route:1'
                 '<|tool_call_argument_begin|>{"a": {"x": 1}, "b": [1, 2.5, null, true]}<|tool_call_end|>'),
     [PARIS, LEG]),  # the second id without "functions.", and the section's end tag never came
    ("kimi_k2", ("<|tool_calls_section_begin|><|tool_call_begin|>functions.nope:0<|tool_call_argument_begin|>{}"
                 "<|tool_call_end|><|tool_calls_section_end|>"), []),  # not offered
    ("kimi_k2", ("<|tool_calls_section_begin|><|tool_call_begin|>functions.get_weather<|tool_call_argument_begin|>"
                 '{"city": "Paris"}<|tool_call_end|><|tool_calls_section_end|>'), []),  # an id without its index
    ("kimi_k2", "Paris is sunny.", []),
]


def read(reader: CallReader, pieces: list[str]) -> tuple[str, list[tuple[str, str]]]:
    text, deltas = "", []
    for p in pieces:
        said, calls = reader.feed(p)
        text, deltas = text + said, deltas + calls
    said, calls = reader.close()
    text, deltas = text + said, deltas + calls
    assert all(d.id.startswith("call_") or KIMI_ID.fullmatch(d.id) for d in deltas if d.name)  # kimi_k2: its own
    return text, [(d.name, d.arguments) for d in deltas]


@pytest.mark.parametrize(("fmt", "output", "calls"), CASES)
def test_each_format_reads_its_calls_and_leaves_the_rest_as_written(fmt, output, calls):
    text, got = read(FORMATS[fmt].reader(NAMES, True), [output])
    assert [(n, json.loads(a)) for n, a in got] == [(n, json.loads(a)) for n, a in calls]
    if calls:
        assert text.strip() in ("", "Sure.")
    else:
        assert text == output  # nothing lost, nothing rewritten


@pytest.mark.parametrize(("fmt", "output", "calls"), CASES)
def test_every_cut_of_the_stream_reads_the_same(fmt, output, calls):
    whole = read(FORMATS[fmt].reader(NAMES, True), [output])
    rng = random.Random(7)
    for _ in range(20):
        cuts = sorted(rng.sample(range(1, len(output)), min(4, len(output) - 1)))
        pieces = [output[i:j] for i, j in zip([0, *cuts], [*cuts, len(output)], strict=True)]
        got = read(FORMATS[fmt].reader(NAMES, True), pieces)
        assert got[0] == whole[0] and [n for n, _ in got[1]] == [n for n, _ in whole[1]]
    assert read(FORMATS[fmt].reader(NAMES, True), list(output))[1] == whole[1]  # a character at a time


def test_text_values_are_read_by_the_tools_schema():
    tools = tools_from_body({"tools": [{"type": "function", "function": {"name": "book", "parameters": {
        "type": "object", "properties": {"n": {"type": "integer"}, "price": {"type": "number"},
                                         "ok": {"type": "boolean"}, "zip": {"type": "string"},
                                         "tags": {"type": "array"}, "when": {"anyOf": [{"type": "null"},
                                                                                       {"type": "integer"}]}}}}}]})
    params = "".join(f"<parameter={k}>\n{v}\n</parameter>\n" for k, v in (
        ("n", "3"), ("price", "2.5"), ("ok", "True"), ("zip", "01234"), ("tags", '["a", 1]'), ("when", "null"),
        ("extra", "7")))
    _, got = read(FORMATS["qwen3_coder"].reader(tools.names, True),
                  [f"<tool_call>\n<function=book>\n{params}</function>\n</tool_call>"])
    assert [(n, json.loads(a)) for n, a in got] == [("book", {"n": 3, "price": 2.5, "ok": True, "zip": "01234",
                                                               "tags": ["a", 1], "when": None, "extra": "7"})]
    _, bad = read(FORMATS["qwen3_coder"].reader(tools.names, True),
                  ["<tool_call>\n<function=book>\n<parameter=n>\nthree\n</parameter>\n</function>\n</tool_call>"])
    assert json.loads(bad[0][1]) == {"n": "three"}  # not an integer: the text as written, for the tool to refuse
    _, glm = read(FORMATS["glm45"].reader(tools.names, True),
                  [("<tool_call>book\n<arg_key>n</arg_key>\n<arg_value>3</arg_value>\n<arg_key>zip</arg_key>\n"
                    "<arg_value>01234</arg_value>\n</tool_call>")])
    assert [(n, json.loads(a)) for n, a in glm] == [("book", {"n": 3, "zip": "01234"})]  # glm45's values alike


def test_content_streams_once_it_cannot_start_a_call():
    reader = FORMATS["llama3_json"].reader(NAMES, True)
    assert reader.feed("  ") == ("", [])                 # white space: undecided
    assert reader.feed("It") == ("  It", [])             # not a call's start: out at once
    assert reader.feed(" rains.") == (" rains.", [])
    reader = FORMATS["mistral"].reader(NAMES, True)
    assert reader.feed("get_wea") == ("", [])            # could be get_weather{...}
    assert reader.feed("ther is") == ("get_weather is", [])
    reader = FORMATS["pythonic"].reader(NAMES, True)
    assert reader.feed("[rou") == ("", [])
    assert reader.feed("nd") == ("[round", [])


def test_one_call_when_parallel_calls_are_off():
    for fmt, output, calls in CASES:
        if len(calls) > 1 and fmt != "hermes":
            assert read(FORMATS[fmt].reader(NAMES, False), [output])[1] == [calls[0]], fmt


@pytest.mark.parametrize("fmt", sorted(FORMATS))
def test_a_format_reads_back_the_calls_it_writes(fmt):
    """What the prompt shows of earlier calls is the form the reader takes: a model that copies it is read."""
    calls = [{"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Oslo"}}},
             {"id": "call_2", "type": "function", "function": {"name": "route", "arguments": '{"a": {"x": [1, "y"]}}'}}]
    written = FORMATS[fmt].written(calls)
    _, got = read(FORMATS[fmt].reader(NAMES, True), [written])
    assert [(n, json.loads(a)) for n, a in got] == [("get_weather", {"city": "Oslo"}),
                                                    ("route", {"a": {"x": [1, "y"]}})]
    assert FORMATS[fmt].looks_like_call(written)


class Template:
    def __init__(self, tools: bool, calls: bool) -> None:
        self.takes_tools, self.takes_tool_calls = tools, calls


def test_a_template_without_tools_gets_them_described_in_the_configured_form():
    body = {"tools": [WEATHER, ROUTE]}
    tools = tools_from_body(body)
    called = [{"role": "user", "content": "Weather?"},
              {"role": "assistant", "content": "", "tool_calls": [
                  {"id": "call_1", "type": "function", "function": {"name": "get_weather",
                                                                    "arguments": '{"city": "Oslo"}'}}]},
              {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}]
    chat, offered = for_template(chat_messages(called), tools, Template(False, False), FORMATS["pythonic"])
    assert offered is None and "Python list of calls" in chat[0]["content"] and '"get_weather"' in chat[0]["content"]
    assert chat[2]["content"] == "[get_weather(city='Oslo')]"
    chat, _ = for_template(chat_messages(called), tools, Template(False, False), FORMATS["llama3_json"])
    assert '"parameters": dictionary of argument name' in chat[0]["content"]
    assert json.loads(chat[2]["content"]) == {"name": "get_weather", "parameters": {"city": "Oslo"}}


def test_read_whole_uses_the_format_under_auto_only():
    tools = tools_from_body({"tools": [WEATHER]})
    assert isinstance(tools, Tools)
    out = read_whole(tools, '[get_weather(city="Paris")]', "stop", FORMATS["pythonic"])
    assert out.content is None and out.finish_reason == "tool_calls"
    assert out.calls[0]["function"] == {"name": "get_weather", "arguments": '{"city": "Paris"}'}
    assert read_whole(tools, '[get_weather(city="Paris")]', "stop").calls == []  # hermes reads no such call
    required = tools_from_body({"tools": [WEATHER], "tool_choice": "required"})
    assert required is not None
    listed = '[{"name": "get_weather", "arguments": {"city": "Rome"}}]'
    assert read_whole(required, listed, "stop", FORMATS["pythonic"]).calls[0]["function"]["name"] == "get_weather"


def test_the_format_is_picked_from_the_chat_template():
    assert detect(None).name == "hermes" and detect("{{ messages }}").name == "hermes"
    assert detect("{% if tools %}<tool_call>{% endif %}").name == "hermes"
    assert detect("<tool_call>\n<function={{ name }}>\n<parameter={{ k }}>").name == "qwen3_coder"
    assert detect("<tool_call>{{ name }}\n<arg_key>{{ k }}</arg_key>").name == "glm45"
    v3 = "'<｜tool▁call▁begin｜>' + tool['type'] + '<｜tool▁sep｜>' + tool['function']['name'] + '\\n' + '```json'"
    assert detect(v3).name == "deepseek_v3"
    assert detect("'<｜tool▁call▁begin｜>' + tool['function']['name'] + '<｜tool▁sep｜>'").name == "deepseek_v31"
    assert detect("{{ '[TOOL_CALLS]' + tool_calls | tojson }}").name == "mistral"
    assert detect("{%- if message['tool_calls'] -%}<|tool_calls_section_begin|>{%- for tool_call in "
                  "message['tool_calls'] -%}<|tool_call_begin|>{{ tool_call['id'] }}").name == "kimi_k2"
    assert detect("{{- '<|python_tag|>' + tool_call.name }}").name == "llama3_json"
    assert detect('Respond in the format {"name": function name, "parameters": dictionary of argument name and '
                  'its value}.').name == "llama3_json"
    assert pick("pythonic", "<tool_call>").name == "pythonic"  # configured wins
    assert pick("auto", "[TOOL_CALLS]").name == "mistral"
    with pytest.raises(ValueError, match="tool_call_parser must be one of auto, hermes"):
        pick("qwen", None)
    assert RouterSettings.choices_of("tool_call_parser") == PARSERS


def test_a_session_pauses_on_a_call_in_the_routers_form():
    assert ends_in_tool_call('[get_weather(city="Paris")]', "stop", FORMATS["pythonic"])
    assert not ends_in_tool_call('[get_weather(city="Paris")]', "stop")
    assert ends_in_tool_call('{"name": "x", "parameters": {}}', "stop")  # a JSON call, whatever the form
    assert ends_in_tool_call('[{"name": "x", "arguments": {}}]', "stop", FORMATS["mistral"])
    assert not ends_in_tool_call("[1, 2] are numbers", "stop", FORMATS["pythonic"])


def test_a_resumed_generate_stream_reads_a_call_that_crosses_the_cut():
    from kvmesh.proto.v1 import api_pb2

    from services.router.grpc_api import StreamReader
    from services.router.reasoning import ThinkSplitter

    text = '<think>plan</think>Sure.<tool_call>{"name": "get_weather", "arguments": {"city": "Oslo"}}</tool_call>'
    cut = text.index('"arguments"')
    reader = StreamReader(FORMATS["hermes"].reader(NAMES, True), ThinkSplitter(False))
    reader.skip(text[:cut])  # what the stream delivered before its router died
    msg = api_pb2.GenerateChunk(text=text[cut:], finished=True, finish_reason="stop")
    reader.read(msg, True)
    assert msg.text == "" and msg.reasoning == "" and msg.finish_reason == "tool_calls"
    assert [(c.name, json.loads(c.arguments)) for c in msg.tool_calls] == [("get_weather", {"city": "Oslo"})]


def test_kimi_calls_keep_the_ids_the_model_wrote_and_ask_for_special_tokens():
    out = ("<|tool_calls_section_begin|><|tool_call_begin|>functions.get_weather:3<|tool_call_argument_begin|>"
           '{"city": "Paris"}<|tool_call_end|><|tool_call_begin|>route:4<|tool_call_argument_begin|>{}'
           "<|tool_call_end|><|tool_calls_section_end|>")
    reader = FORMATS["kimi_k2"].reader(NAMES, True)
    said, calls = reader.feed(out)
    assert said == "" and [(c.index, c.id, c.name) for c in calls] == [(0, "functions.get_weather:3", "get_weather"),
                                                                       (1, "route:4", "route")]
    # written back into a prompt: an id of Kimi's form kept, any other replaced by one
    written = FORMATS["kimi_k2"].written([
        {"id": "functions.get_weather:3", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}},
        {"id": "call_abc", "function": {"name": "route", "arguments": {}}}])
    assert "<|tool_call_begin|>functions.get_weather:3<|tool_call_argument_begin|>" in written
    assert "<|tool_call_begin|>functions.route:1<|tool_call_argument_begin|>" in written


def test_special_tokens_are_kept_where_a_readers_markers_are_special_in_the_tokenizer(tmp_path):
    """Decided from the model's tokenizer: Kimi's markers are special in Kimi's; hermes's ``<tool_call>`` is
    special in some fine-tunes' (then the text must keep it) and plain in others'; a whole-output form is read
    without its tags, whatever they are."""
    from kvmesh.model_source.tokenizer import Tokenizer
    from tokenizers import AddedToken, models
    from tokenizers import Tokenizer as RawTokenizer

    kimi = frozenset({"<|tool_calls_section_begin|>", "<|tool_call_begin|>", "<|im_end|>"})
    assert keeps_special_tokens(FORMATS["kimi_k2"], kimi)
    assert not keeps_special_tokens(FORMATS["hermes"], kimi)
    assert keeps_special_tokens(FORMATS["hermes"], frozenset({"<tool_call>", "</tool_call>"}))
    assert keeps_special_tokens(FORMATS["qwen3_coder"], frozenset({"<tool_call>"}))  # the same tags
    assert not keeps_special_tokens(FORMATS["mistral"], frozenset({"[TOOL_CALLS]"}))
    assert not keeps_special_tokens(FORMATS["llama3_json"], frozenset({"<|python_tag|>"}))
    raw = RawTokenizer(models.WordLevel({"a": 0, "[UNK]": 1}, unk_token="[UNK]"))
    raw.add_special_tokens(["<|im_end|>", "<tool_call>"])
    raw.add_tokens([AddedToken("</tool_call>", special=False)])
    assert Tokenizer(raw, "fp").special_texts == {"<|im_end|>", "<tool_call>"}
