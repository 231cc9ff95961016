"""A router set to read another model family's tool calls (``router.tool_call_parser = "llama3_json"``) and a
reasoning model's thinking (``router.reasoning_parser = "qwen3"``), through a real stack (one role-both instance,
the default model): the tools are described to the model in Llama's form (SmolLM2's template renders none), an
output in that form comes back as ``tool_calls`` whole and streamed, an output that is no call comes back as
content, unchanged; ``<think>`` text comes back as ``reasoning`` (HTTP whole and streamed, gRPC), apart from the
content and the calls. The model's output is steered with a structured-output constraint so the test does not
depend on what a 135M model chooses to say."""

from __future__ import annotations

import json

import pytest
from kvmesh.model_source.resolve import resolve_model
from kvmesh.model_source.tokenizer import Tokenizer

from .conftest import start_stack
from .test_mesh import openai_client

pytestmark = pytest.mark.slow
MODEL = "SmolLM2-135M-Instruct"
CITY = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12}}, "required": ["city"]}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "The weather in a city now",
                                           "parameters": CITY}}]
ASK = [{"role": "user", "content": "What is the weather in Paris right now?"}]
LLAMA_CALL = {"type": "object", "properties": {"name": {"const": "get_weather"}, "parameters": CITY},
              "required": ["name", "parameters"], "additionalProperties": False}


@pytest.fixture(scope="module")
def llama_router(tmp_path_factory):
    stack = start_stack(tmp_path_factory, "parsers", prefill=0, decode=0, both=1,
                        settings={"router": {"tool_call_parser": "llama3_json", "reasoning_parser": "qwen3"}})
    yield stack
    stack.stop()


def test_calls_in_llamas_form_are_read_and_the_tools_described_in_it(llama_router):
    client = openai_client(llama_router)
    steer = {"response_format": {"type": "json_schema", "json_schema": {"name": "call", "schema": LLAMA_CALL}},
             "return_token_ids": True}
    out = client.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS, max_tokens=48, temperature=0,
                                         extra_body=steer)
    choice = out.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    (call,) = choice.message.tool_calls
    assert call.function.name == "get_weather" and call.id.startswith("call_")
    assert set(json.loads(call.function.arguments)) == {"city"}
    prompt = Tokenizer.from_dir(resolve_model(None).hf_dir).decode(out.model_extra["prompt_token_ids"])
    assert '"parameters": dictionary of argument name' in prompt and "<tool_call>" not in prompt

    chunks = list(client.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS, max_tokens=48,
                                                 temperature=0, stream=True, extra_body=steer))
    deltas = [d for c in chunks if c.choices for d in (c.choices[0].delta.tool_calls or [])]
    assert len(deltas) == 1 and deltas[0].function.name == "get_weather"
    assert deltas[0].function.arguments == call.function.arguments  # greedy: the same call, whole in one delta
    assert not "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert chunks[-1].choices[0].finish_reason == "tool_calls"


def test_an_answer_that_is_no_call_is_content_as_written(llama_router):
    client = openai_client(llama_router)
    steer = {"guided_regex": "(It is sunny|It rains) in Paris\\."}
    whole = client.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS, max_tokens=16, temperature=0,
                                           extra_body=steer)
    text = whole.choices[0].message.content
    assert text in ("It is sunny in Paris.", "It rains in Paris.") and not whole.choices[0].message.tool_calls
    assert whole.choices[0].finish_reason == "stop"
    chunks = list(client.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS, max_tokens=16,
                                                 temperature=0, stream=True, extra_body=steer))
    pieces = [c.choices[0].delta.content for c in chunks if c.choices and c.choices[0].delta.content]
    assert "".join(pieces) == text and len(pieces) > 1  # content streams once it cannot start a call


THINK = {"guided_regex": "<think>[a-z ]{4,40}</think>(Yes|No)\\."}


def test_thinking_comes_back_as_reasoning_apart_from_the_content(llama_router):
    client = openai_client(llama_router)
    whole = client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=40, temperature=0, extra_body=THINK)
    message = whole.choices[0].message
    reasoning = message.model_extra["reasoning"]
    assert message.content in ("Yes.", "No.") and reasoning and "<think>" not in reasoning + message.content
    chunks = list(client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=40, temperature=0,
                                                 stream=True, extra_body=THINK))
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    assert "".join((d.model_extra or {}).get("reasoning") or "" for d in deltas) == reasoning
    assert "".join(d.content or "" for d in deltas) == message.content
    hidden = client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=40, temperature=0,
                                            extra_body={**THINK, "include_reasoning": False})
    assert hidden.choices[0].message.content == message.content
    assert "reasoning" not in (hidden.choices[0].message.model_extra or {})
    # the turn goes back with its reasoning (the template is given it as reasoning_content) and is served
    again = client.chat.completions.create(model=MODEL, max_tokens=8, temperature=0, messages=[
        *ASK, {"role": "assistant", "content": message.content, "reasoning": reasoning},
        {"role": "user", "content": "And tomorrow?"}])
    assert again.choices[0].finish_reason in ("stop", "length")


def test_a_call_after_thinking_is_read_from_the_content(llama_router):
    client = openai_client(llama_router)
    steer = {"guided_regex": '<think>[a-z ]{4,30}</think>\\{"name": "get_weather", "parameters": '
                             '\\{"city": "[A-Z][a-z]{2,8}"\\}\\}'}
    out = client.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS, max_tokens=64, temperature=0,
                                         extra_body=steer)
    message = out.choices[0].message
    assert out.choices[0].finish_reason == "tool_calls" and message.model_extra["reasoning"]
    assert message.tool_calls[0].function.name == "get_weather" and not message.content


def test_the_grpc_sdk_gets_the_reasoning_apart(llama_router):
    from kvmesh.client import KvmeshClient

    with KvmeshClient(f"127.0.0.1:{llama_router.grpc_port}") as client:
        done = client.chat(ASK, max_tokens=40, temperature=0, regex=THINK["guided_regex"])
    assert done.text in ("Yes.", "No.") and done.reasoning and "<think>" not in done.reasoning
    assert done.message()["reasoning"] == done.reasoning


def test_the_streaming_generate_rpc_splits_reasoning_and_reads_calls(llama_router):
    from kvmesh.client import KvmeshClient

    steer = '<think>[a-z ]{4,30}</think>\\{"name": "get_weather", "parameters": \\{"city": "[A-Z][a-z]{2,8}"\\}\\}'
    with KvmeshClient(f"127.0.0.1:{llama_router.grpc_port}") as client:
        chunks = list(client.generate(messages=ASK, tools=TOOLS, max_tokens=64, temperature=0, regex=steer))
        done = client.complete(messages=ASK, tools=TOOLS, max_tokens=64, temperature=0, regex=steer)
    assert "".join(c.reasoning for c in chunks) == done.reasoning and done.reasoning
    assert not "".join(c.text for c in chunks) and done.text == ""
    (call,) = done.tool_calls
    assert call.name == "get_weather" and set(json.loads(call.arguments)) == {"city"}
    assert done.finish_reason == "tool_calls" and chunks[-1].finish_reason == "tool_calls"


@pytest.fixture(scope="module")
def kimi_router(tmp_path_factory):
    stack = start_stack(tmp_path_factory, "kimi", prefill=0, decode=0, both=1,
                        settings={"router": {"tool_call_parser": "kimi_k2"}})
    yield stack
    stack.stop()


def test_calls_in_kimis_form_keep_the_models_ids(kimi_router):
    """Kimi K2's section, read through a real stack (the markers are plain text in SmolLM2's vocabulary: the
    regex steers the output into them); the call's id is the one the model wrote, whole and streamed, and the
    call goes back into the next prompt under it (Kimi's template writes it back)."""
    client = openai_client(kimi_router)
    steer = {"guided_regex": ('Sure\\.<\\|tool_calls_section_begin\\|><\\|tool_call_begin\\|>functions\\.get_weather:0'
                              '<\\|tool_call_argument_begin\\|>\\{"city": "[A-Z][a-z]{2,8}"\\}<\\|tool_call_end\\|>'
                              '<\\|tool_calls_section_end\\|>')}
    out = client.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS, max_tokens=96, temperature=0,
                                         extra_body=steer)
    choice = out.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content == "Sure.", choice
    (call,) = choice.message.tool_calls
    assert call.id == "functions.get_weather:0" and call.function.name == "get_weather"
    assert set(json.loads(call.function.arguments)) == {"city"}
    chunks = list(client.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS, max_tokens=96,
                                                 temperature=0, stream=True, extra_body=steer))
    deltas = [d for c in chunks if c.choices for d in (c.choices[0].delta.tool_calls or [])]
    assert [(d.id, d.function.name) for d in deltas if d.id] == [(call.id, "get_weather")]
    again = client.chat.completions.create(model=MODEL, max_tokens=8, temperature=0, tools=TOOLS, messages=[
        *ASK, choice.message.model_dump(exclude_none=True),
        {"role": "tool", "tool_call_id": call.id, "content": "sunny"}], extra_body={"return_token_ids": True})
    prompt = Tokenizer.from_dir(resolve_model(None).hf_dir).decode(again.model_extra["prompt_token_ids"])
    assert "<|tool_call_begin|>functions.get_weather:0<|tool_call_argument_begin|>" in prompt
