"""Structured output through the real stack and the default model: 20 JSON schemas of increasing difficulty, each
answer parsing and validating with jsonschema, greedy and sampled, over HTTP and gRPC, with PD (prefill samples
the first token under the mask, decode rebuilds the matcher) and with role both; regex and choice; bad
constraints refused 400 / INVALID_ARGUMENT naming the problem; constrained and free requests share prefix KV.

The 20 schemas go out together (one batch) per configuration; strings and arrays are bounded so every answer
fits max_tokens."""

from __future__ import annotations

import json
import re
from concurrent.futures import ThreadPoolExecutor

import jsonschema
import pytest

from .conftest import start_stack
from .test_mesh import post

pytestmark = pytest.mark.slow
MAX_TOKENS = 72

S = {"type": "string", "maxLength": 8}
SCHEMAS = [
    {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]},
    {"type": "object", "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 100}}, "required": ["n"]},
    {"type": "object", "properties": {"name": S}, "required": ["name"]},
    {"type": "object", "properties": {"color": {"enum": ["red", "green", "blue"]}}, "required": ["color"]},
    {"type": "object", "properties": {"name": S, "age": {"type": "integer", "minimum": 0, "maximum": 120}},
     "required": ["name", "age"]},
    {"type": "object", "properties": {"x": {"const": 1}, "y": {"type": "null"}}, "required": ["x", "y"]},
    {"type": "object", "properties": {"city": S, "zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
     "required": ["city", "zip"]},
    {"type": "object", "properties": {"tags": {"type": "array", "items": S, "minItems": 1, "maxItems": 3}},
     "required": ["tags"]},
    {"type": "object", "properties": {"name": S, "nick": S}, "required": ["name"]},  # optional field
    {"type": "object", "properties": {"code": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{2}$"}},
     "required": ["code"]},
    {"type": "object", "properties": {"p": {"type": "object", "properties": {"x": {"type": "integer", "minimum": 0,
                                                                                     "maximum": 9}},
                                             "required": ["x"]}}, "required": ["p"]},
    {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 9}, "minItems": 2, "maxItems": 4},
    {"type": "object", "properties": {"v": {"anyOf": [{"type": "integer", "minimum": 0, "maximum": 9},
                                                      {"type": "boolean"}]}}, "required": ["v"]},
    {"type": "object", "properties": {"items": {"type": "array", "minItems": 1, "maxItems": 2, "items": {
        "type": "object", "properties": {"id": {"type": "integer", "minimum": 0, "maximum": 99}, "label": S},
        "required": ["id", "label"]}}}, "required": ["items"]},
    {"type": "object", "properties": {"level": {"enum": ["low", "mid", "high"]}, "score": {
        "type": "integer", "minimum": 1, "maximum": 5}, "note": S}, "required": ["level", "score"]},
    {"type": "object", "properties": {"a": {"type": "object", "properties": {"b": {"type": "object", "properties": {
        "c": {"type": "boolean"}}, "required": ["c"]}}, "required": ["b"]}}, "required": ["a"]},
    {"type": "object", "$defs": {"pt": {"type": "object", "properties": {"x": {"type": "integer", "minimum": 0,
                                                                             "maximum": 9}}, "required": ["x"]}},
     "properties": {"from": {"$ref": "#/$defs/pt"}, "to": {"$ref": "#/$defs/pt"}}, "required": ["from", "to"]},
    {"type": "object", "properties": {"matrix": {"type": "array", "minItems": 2, "maxItems": 2, "items": {
        "type": "array", "minItems": 2, "maxItems": 2, "items": {"type": "integer", "minimum": 0, "maximum": 9}}}},
     "required": ["matrix"]},
    {"type": "object", "properties": {"user": {"type": "object", "properties": {"name": S, "role": {
        "enum": ["admin", "guest"]}}, "required": ["name", "role"]}, "active": {"type": "boolean"}},
     "required": ["user", "active"], "additionalProperties": False},
    {"type": "object", "properties": {"id": {"type": "string", "pattern": "^[a-f0-9]{4}$"}, "kind": {
        "enum": ["a", "b"]}, "vals": {"type": "array", "items": {"enum": [1, 2, 3]}, "minItems": 1, "maxItems": 3},
        "meta": {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]}},
     "required": ["id", "kind", "vals", "meta"]},
]


def messages(i: int) -> list[dict]:
    return [{"role": "user", "content": f"Reply with JSON only. Example {i}."}]


def http_json(stack, schema: dict, i: int, sampled: bool) -> tuple[str, str]:
    body = {"messages": messages(i), "max_tokens": MAX_TOKENS, "temperature": 0.8 if sampled else 0,
            "seed": i if sampled else None,
            "response_format": {"type": "json_schema", "json_schema": {"name": f"s{i}", "schema": schema}}}
    status, out, _ = post(stack, "/v1/chat/completions", body)
    assert status == 200, out
    return out["choices"][0]["message"]["content"], out["choices"][0]["finish_reason"]


def grpc_json(stack, schema: dict, i: int, sampled: bool) -> tuple[str, str]:
    from kvmesh.client import KvmeshClient

    with KvmeshClient(f"127.0.0.1:{stack.grpc_port}") as client:
        c = client.complete(messages=messages(i), max_tokens=MAX_TOKENS, json_schema=schema,
                            temperature=0.8 if sampled else 0.0, seed=i if sampled else None)
    return c.text, c.finish_reason


@pytest.fixture(scope="module")
def both(tmp_path_factory):
    stack = start_stack(tmp_path_factory, "structboth", prefill=0, decode=0, both=1)
    yield stack
    stack.stop()


# each schema is served four ways: {PD, both} x {HTTP, gRPC}, greedy and sampled alternating
@pytest.mark.parametrize("where,api,sampled", [("mesh", http_json, False), ("mesh", grpc_json, True),
                                               ("both", grpc_json, False), ("both", http_json, True)],
                         ids=["pd-http-greedy", "pd-grpc-sampled", "both-grpc-greedy", "both-http-sampled"])
def test_twenty_schemas_validate(request, where, api, sampled):
    stack = request.getfixturevalue(where)
    with ThreadPoolExecutor(len(SCHEMAS)) as pool:
        results = list(pool.map(lambda a: api(stack, *a, sampled), [(s, i) for i, s in enumerate(SCHEMAS)]))
    for i, ((text, reason), schema) in enumerate(zip(results, SCHEMAS)):
        assert reason == "stop", f"schema {i}: {reason} after {text!r}"
        jsonschema.validate(json.loads(text), schema)


def test_regex_and_choice(mesh):
    status, out, _ = post(mesh, "/v1/completions", {"prompt": "Phone number:", "max_tokens": 16, "temperature": 0,
                                                    "guided_regex": r"\d{3}-\d{4}"})
    assert status == 200 and re.fullmatch(r"\d{3}-\d{4}", out["choices"][0]["text"]), out
    assert out["choices"][0]["finish_reason"] == "stop"
    status, out, _ = post(mesh, "/v1/chat/completions", {
        "messages": [{"role": "user", "content": "Is the sky blue?"}], "max_tokens": 8,
        "structured_outputs": {"choice": ["yes", "no"]}})
    assert status == 200 and out["choices"][0]["message"]["content"] in ("yes", "no"), out
    from kvmesh.client import KvmeshClient

    with KvmeshClient(f"127.0.0.1:{mesh.grpc_port}") as client:
        c = client.chat([{"role": "user", "content": "Pick a color."}], max_tokens=8,
                        choice=["red", "green", "blue"])
    assert c.text in ("red", "green", "blue") and c.finish_reason == "stop"


def test_max_tokens_cut_says_length(mesh):
    status, out, _ = post(mesh, "/v1/completions", {"prompt": "Letters:", "max_tokens": 3, "temperature": 0,
                                                    "guided_regex": "[a-z]{40}"})
    assert status == 200 and out["choices"][0]["finish_reason"] == "length" and out["usage"][
        "completion_tokens"] == 3


@pytest.mark.parametrize("body,words", [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "strng"}}}},
     "not a valid JSON schema: at /type"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {
        "type": "array", "uniqueItems": True}}}}, "'uniqueItems' at /uniqueItems is not supported"),
    ({"guided_regex": "([a-z]"}, "the regex does not compile"),
    ({"guided_grammar": "root ::= undefined_rule"}, "undefined_rule"),  # refused by the engine's compiler
])
def test_bad_constraints_are_400_naming_the_problem(mesh, body, words):
    status, out, _ = post(mesh, "/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}],
                                                          "max_tokens": 4, **body})
    assert status == 400 and words in out["error"]["message"], out


def test_bad_constraint_over_grpc_is_invalid_argument(mesh):
    from kvmesh.client import InvalidRequest, KvmeshClient

    with KvmeshClient(f"127.0.0.1:{mesh.grpc_port}") as client:
        with pytest.raises(InvalidRequest, match="sampling.regex: the regex does not compile"):
            client.complete("hi", max_tokens=2, regex="(unclosed")
        with pytest.raises(InvalidRequest, match="keyword 'not'"):
            client.complete("hi", max_tokens=2, json_schema={"not": {"type": "string"}})


def test_constrained_and_free_share_prefix_kv(mesh):
    prompt = "Describe a person as JSON with a name and an age. " * 6
    free = {"prompt": prompt, "max_tokens": 2, "temperature": 0}
    status, _, _ = post(mesh, "/v1/completions", free)
    assert status == 200
    status, out, _ = post(mesh, "/v1/completions", {**free, "max_tokens": 24, "response_format": {
        "type": "json_schema", "json_schema": {"name": "p", "schema": SCHEMAS[4]}}})
    assert status == 200 and out["usage"]["prompt_tokens_details"]["cached_tokens"] >= 32, out["usage"]
