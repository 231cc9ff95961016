"""The router's structured-output fields (OpenAI response_format, vLLM guided_* / structured_outputs) and their
validation without torch (the intake's constraint step): each bad constraint is refused naming the field and
where inside it."""

from __future__ import annotations

import json

import pytest
from kvmesh.contracts.sampling import SamplingParams, StructuredOutput, sampling_from_proto, sampling_to_proto

from services.router import openai_body
from services.router.errors import ErrorKind, RequestError
from services.router.intake import check_constraint
from services.router.structured import check_structured

SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}


@pytest.mark.parametrize("body,want", [
    ({}, None),
    ({"response_format": {"type": "text"}}, None),
    ({"response_format": {"type": "json_object"}}, StructuredOutput("json_object")),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "n", "schema": SCHEMA, "strict": True}}},
     StructuredOutput("json_schema", json.dumps(SCHEMA))),
    ({"guided_json": SCHEMA}, StructuredOutput("json_schema", json.dumps(SCHEMA))),
    ({"guided_json": json.dumps(SCHEMA)}, StructuredOutput("json_schema", json.dumps(SCHEMA))),
    ({"guided_regex": "[0-9]+"}, StructuredOutput("regex", "[0-9]+")),
    ({"guided_choice": ["yes", "no"]}, StructuredOutput.choice(["yes", "no"])),
    ({"guided_grammar": 'root ::= "a"'}, StructuredOutput("grammar", 'root ::= "a"')),
    ({"structured_outputs": {"regex": "a+"}}, StructuredOutput("regex", "a+")),
    ({"structured_outputs": {"choice": ["x"]}}, StructuredOutput.choice(["x"])),
    ({"structured_outputs": {"json": SCHEMA}}, StructuredOutput("json_schema", json.dumps(SCHEMA))),
])
def test_fields_map_to_one_constraint(body, want):
    p, _ = openai_body.sampling_from_body(body)
    assert p.structured == want
    assert sampling_from_proto(sampling_to_proto(p)) == p  # the same travels to prefill and decode


@pytest.mark.parametrize("body,words", [
    ({"response_format": "json"}, "response_format must be an object"),
    ({"response_format": {"type": "xml"}}, "response_format.type"),
    ({"response_format": {"type": "json_schema"}}, "response_format.json_schema must be an object"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "n"}}}, "schema is required"),
    ({"response_format": {"type": "json_schema", "json_schema": {"schema": {"type": "strng"}}}},
     "response_format.json_schema.schema is not a valid JSON schema: at /type"),
    ({"response_format": {"type": "json_schema", "json_schema": {"schema": {
        "type": "object", "properties": {"tags": {"type": "array", "uniqueItems": True}}}}}},
     "keyword 'uniqueItems' at /properties/tags/uniqueItems is not supported"),
    ({"guided_json": {"type": "object", "patternProperties": {"^a": {}}}}, "'patternProperties' at /patternProperties"),
    ({"guided_json": {"$ref": "https://example.com/s.json"}}, "must point inside the schema"),
    ({"guided_json": {"type": "string", "pattern": "(a"}}, "guided_json is not a valid JSON schema: at /pattern"),
    ({"guided_json": {"type": "string", "pattern": "(?=a)a"}}, "guided_json at /pattern: lookahead"),
    ({"guided_json": "{not json"}, "guided_json is not valid JSON"),
    ({"guided_regex": "(ab"}, "guided_regex: the regex does not compile: missing )"),
    ({"guided_regex": r"(\w)\1"}, "backreference is not supported"),
    ({"guided_regex": r"(?=x)x"}, "lookahead"),
    ({"guided_regex": r"\bword"}, "word boundary"),
    ({"guided_regex": ""}, "guided_regex must be a non-empty string"),
    ({"guided_choice": []}, "guided_choice must be a non-empty list of strings"),
    ({"guided_choice": ["a", 1]}, "guided_choice must be a non-empty list of strings"),
    ({"guided_grammar": "just text"}, "EBNF grammar"),
    ({"structured_outputs": "regex"}, "structured_outputs must be an object"),
    ({"guided_regex": "a", "response_format": {"type": "json_object"}}, "one structured-output constraint, not 2"),
])
def test_bad_constraint_is_refused_naming_it(body, words):
    with pytest.raises(RequestError) as e:
        check_constraint(openai_body.draft({"prompt": "Hi", **body}, chat=False, headers={}))
    assert e.value.kind == ErrorKind.INVALID and words in e.value.message


def test_grpc_constraints_are_checked_too():
    """gRPC's oneof arrives as SamplingParams.structured; the intake runs the same validation."""
    with pytest.raises(RequestError, match="sampling.regex: the regex does not compile"):
        check_structured(StructuredOutput("regex", "[a-"), "sampling.regex")
    with pytest.raises(RequestError, match="keyword 'not'"):
        check_structured(StructuredOutput("json_schema", '{"not": {"type": "string"}}'), "sampling.json_schema")
    check_structured(SamplingParams(structured=StructuredOutput("json_object")).structured, "sampling.json_object")


@pytest.mark.parametrize("kw,want", [
    ({"json_schema": SCHEMA}, StructuredOutput("json_schema", json.dumps(SCHEMA))),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "n", "schema": SCHEMA}}},
     StructuredOutput("json_schema", json.dumps(SCHEMA))),
    ({"response_format": {"type": "json_object"}}, StructuredOutput("json_object")),
    ({"regex": "[a-z]+"}, StructuredOutput("regex", "[a-z]+")),
    ({"choice": ["yes", "no"]}, StructuredOutput.choice(["yes", "no"])),
    ({"grammar": 'root ::= "a"'}, StructuredOutput("grammar", 'root ::= "a"')),
])
def test_sdk_arguments_set_the_oneof(kw, want):
    from kvmesh.client.requests import chat_request, generate_request

    assert sampling_from_proto(generate_request("hi", **kw).sampling).structured == want
    assert sampling_from_proto(chat_request([{"role": "user", "content": "hi"}], **kw).sampling).structured == want


def test_sdk_refuses_two_constraints():
    from kvmesh.client.requests import generate_request

    with pytest.raises(ValueError, match="at most one structured-output argument, not regex, choice"):
        generate_request("hi", regex="a", choice=["b"])
