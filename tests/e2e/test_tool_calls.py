"""Tool calling through the real stack (1 prefill + 1 decode, the default model) with OpenAI's own client:
``tool_choice: "required"`` and a named function give calls whose arguments validate against the tool's schema,
whole and streamed (the streamed deltas add up to the whole answer's call); a conversation goes on after a call
with the tool's result, its tools' part of the prompt served from cache; a bad tool is a 400 naming it."""

from __future__ import annotations

import json

import grpc
import jsonschema
import pytest

from .test_mesh import openai_client

pytestmark = pytest.mark.slow
MODEL = "SmolLM2-135M-Instruct"
CITY = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 16}}, "required": ["city"]}
ZONE = {"type": "object", "properties": {"zone": {"enum": ["UTC", "CET", "PST"]}, "hour24": {"type": "boolean"}},
        "required": ["zone", "hour24"]}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "The weather in a city now",
                                           "parameters": CITY}},
         {"type": "function", "function": {"name": "get_time", "description": "The time in a zone",
                                           "parameters": ZONE}}]
SCHEMAS = {"get_weather": CITY, "get_time": ZONE}
ASK = [{"role": "user", "content": "What is the weather in Paris right now?"}]


def test_required_calls_validate_against_their_tools(mesh):
    client = openai_client(mesh)
    out = client.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS, tool_choice="required",
                                         max_tokens=64, temperature=0)
    choice = out.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    assert choice.message.tool_calls
    for call in choice.message.tool_calls:
        assert call.id.startswith("call_") and call.type == "function"
        jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])
    one = client.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS, tool_choice="required",
                                         parallel_tool_calls=False, max_tokens=64, temperature=0.9, seed=4)
    assert len(one.choices[0].message.tool_calls) == 1


def test_a_named_function_streams_the_same_call_it_answers_whole(mesh):
    client = openai_client(mesh)
    named = {"type": "function", "function": {"name": "get_time"}}
    whole = client.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS, tool_choice=named,
                                           max_tokens=48, temperature=0)
    call = whole.choices[0].message.tool_calls[0]
    assert call.function.name == "get_time" and whole.choices[0].finish_reason == "tool_calls"
    jsonschema.validate(json.loads(call.function.arguments), ZONE)
    chunks = list(client.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS, tool_choice=named,
                                                 max_tokens=48, temperature=0, stream=True))
    deltas = [d for c in chunks if c.choices for d in (c.choices[0].delta.tool_calls or [])]
    assert len(deltas) > 1, "the arguments stream as they are generated"
    assert deltas[0].function.name == "get_time" and deltas[0].id
    assert "".join(d.function.arguments or "" for d in deltas) == call.function.arguments
    assert chunks[-1].choices[0].finish_reason == "tool_calls"


def test_the_conversation_goes_on_after_a_call_with_the_tools_part_cached(mesh):
    client = openai_client(mesh)
    first = client.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS, tool_choice="required",
                                           max_tokens=64, temperature=0)
    call = first.choices[0].message.tool_calls[0]
    turn = [*ASK, {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
            {"role": "tool", "tool_call_id": call.id, "content": "18 C and sunny"}]
    after = client.chat.completions.create(model=MODEL, messages=turn, tools=TOOLS, tool_choice="none",
                                           max_tokens=16, temperature=0)
    assert after.choices[0].message.content and not after.choices[0].message.tool_calls
    again = client.chat.completions.create(model=MODEL, messages=turn, tools=TOOLS, max_tokens=16, temperature=0)
    # the offered tools (~200 tokens) and the question lead every turn's prompt: served from cache
    assert again.usage.prompt_tokens > first.usage.prompt_tokens
    assert again.usage.prompt_tokens_details.cached_tokens >= first.usage.prompt_tokens - 32, again.usage


def test_a_bad_tool_is_a_400_naming_it(mesh):
    import openai

    client = openai_client(mesh)
    with pytest.raises(openai.BadRequestError, match=r"tools\[1\].function.name must be"):
        client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=4, tools=[
            TOOLS[0], {"type": "function", "function": {"name": "two words"}}])
    with pytest.raises(openai.BadRequestError, match="names the function 'nope'"):
        client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=4, tools=TOOLS,
                                       tool_choice={"type": "function", "function": {"name": "nope"}})
    ok = client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=4, temperature=0)
    assert ok.choices[0].message.content


def test_the_grpc_sdk_calls_tools_and_goes_on_after_them(mesh):
    from kvmesh.client import InvalidRequest, KvmeshClient

    with KvmeshClient(f"127.0.0.1:{mesh.grpc_port}") as client:
        first = client.chat(ASK, tools=TOOLS, tool_choice="get_weather", max_tokens=48, temperature=0)
        assert first.finish_reason == "tool_calls" and first.text == ""
        (call,) = first.tool_calls
        assert call.name == "get_weather" and call.id.startswith("call_")
        jsonschema.validate(json.loads(call.arguments), CITY)
        turn = [*ASK, first.message(), {"role": "tool", "tool_call_id": call.id, "content": "18 C and sunny"}]
        after = client.chat(turn, tools=TOOLS, max_tokens=12, temperature=0)
        assert after.usage.prompt_tokens > first.usage.prompt_tokens  # the call and its result joined the prompt
        assert after.usage.cached_tokens >= first.usage.prompt_tokens - 32, after.usage
        required = client.chat(ASK, tools=TOOLS, tool_choice="required", max_tokens=64, temperature=0)
        assert required.tool_calls and {c.name for c in required.tool_calls} <= set(SCHEMAS)
        with pytest.raises(InvalidRequest, match="names the function 'nope'"):
            client.chat(ASK, tools=TOOLS, tool_choice="nope", max_tokens=4)
        with pytest.raises(grpc.RpcError) as e:
            client._stub.Chat(_bad_parameters())
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "tools[0].parameters is not valid JSON" in e.value.details()


def test_the_streaming_generate_rpc_calls_tools_as_chat_does(mesh):
    from kvmesh.client import KvmeshClient

    with KvmeshClient(f"127.0.0.1:{mesh.grpc_port}") as client:
        whole = client.chat(ASK, tools=TOOLS, tool_choice="get_time", max_tokens=48, temperature=0)
        chunks = list(client.generate(messages=ASK, tools=TOOLS, tool_choice="get_time", max_tokens=48,
                                      temperature=0))
        pieces = [c for chunk in chunks for c in chunk.tool_calls]
        assert len(pieces) > 1 and pieces[0].id and not pieces[1].id  # the arguments stream as generated
        assert not "".join(c.text for c in chunks) and chunks[-1].finish_reason == "tool_calls"
        streamed = client.complete(messages=ASK, tools=TOOLS, tool_choice="get_time", max_tokens=48, temperature=0)
        (call,) = streamed.tool_calls  # the SDK joins the pieces into the call
        assert (call.name, call.arguments) == (whole.tool_calls[0].name, whole.tool_calls[0].arguments)
        assert streamed.finish_reason == "tool_calls" and streamed.text == ""
        required = client.complete(messages=ASK, tools=TOOLS, tool_choice="required", max_tokens=64, temperature=0)
        assert required.tool_calls and {c.name for c in required.tool_calls} <= set(SCHEMAS)
        for c in required.tool_calls:
            jsonschema.validate(json.loads(c.arguments), SCHEMAS[c.name])
        with pytest.raises(grpc.RpcError) as e:
            next(client._stub.Generate(_tools_on_text()))
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "tools need messages" in e.value.details()
        with pytest.raises(ValueError, match="need messages"):
            client.complete("plain text", tools=TOOLS)


def _tools_on_text():
    from kvmesh.client.requests import generate_request

    req = generate_request("plain text", max_tokens=4)
    req.tools.extend(_bad_parameters().tools)
    return req


def _bad_parameters():
    from kvmesh.client.requests import chat_request

    req = chat_request(ASK, tools=TOOLS[:1], max_tokens=4)
    req.tools[0].parameters = "{not json"
    return req
