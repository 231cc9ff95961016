"""A router set to read another model family's tool calls (``router.tool_call_parser = "llama3_json"``), through a
real stack (one role-both instance, the default model): the tools are described to the model in Llama's form
(SmolLM2's template renders none), an output in that form comes back as ``tool_calls`` whole and streamed, and an
output that is no call comes back as content, unchanged. The model's output is steered with a structured-output
constraint so the test does not depend on what a 135M model chooses to say."""

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
    stack = start_stack(tmp_path_factory, "toolfmt", prefill=0, decode=0, both=1,
                        settings={"router": {"tool_call_parser": "llama3_json"}})
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
