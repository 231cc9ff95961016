"""Structured output at the router: a constraint's validation before anything is routed, so engines never see a
bad grammar (the fields that ask for one: ``openai_body`` for HTTP, the sampling oneof for gRPC).

The engines compile with xgrammar, which imports torch, so the router validates without it: a JSON schema must
be a valid schema (``jsonschema``'s meta-schema check) that uses only the keywords xgrammar enforces (it ignores
the others silently: an output could then break the schema), and a regex (``regex``, or a schema's ``pattern``)
must compile with Python's ``re`` and use no construct xgrammar lacks (lookaround, backreferences, word
boundaries, inline flags). EBNF grammars are checked by the engine's compiler (a client fault: 400 all the
same). Every message names the field and, inside a schema, where (a JSON pointer).
"""

from __future__ import annotations

import json
import re
from collections import OrderedDict
from collections.abc import Collection, Iterable
from typing import Any

from kvmesh.contracts.sampling import StructuredOutput

from services.router.errors import invalid

# the keywords xgrammar's JSON-schema converter enforces, and annotations that constrain nothing
SUPPORTED = {
    "type", "properties", "required", "additionalProperties", "items", "prefixItems", "minItems", "maxItems",
    "enum", "const", "anyOf", "oneOf", "allOf", "$ref", "$defs", "definitions", "minimum", "maximum",
    "exclusiveMinimum", "exclusiveMaximum", "minLength", "maxLength", "pattern", "format", "minProperties",
    "maxProperties",
}
ANNOTATIONS = {"title", "description", "$schema", "$id", "$comment", "default", "examples", "deprecated",
               "readOnly", "writeOnly", "$anchor"}
SCHEMA_MAPS = ("properties", "$defs", "definitions")    # name -> subschema
SCHEMA_LISTS = ("anyOf", "oneOf", "allOf", "prefixItems")  # list of subschemas
MAX_CHOICES = 1024
_checked: OrderedDict[str, None] = OrderedDict()  # canonical keys already validated


def check_structured(spec: StructuredOutput, field: str) -> None:
    """RequestError('invalid') naming ``field`` (and where inside it) when ``spec`` cannot be served."""
    try:
        key = spec.key
    except ValueError as e:
        raise invalid(f"{field} is not valid JSON: {e}") from None
    if key in _checked:
        _checked.move_to_end(key)
        return
    if spec.kind == "json_schema":
        check_schema(json.loads(spec.spec), field)
    elif spec.kind == "regex":
        check_regex(spec.spec, field)
    elif spec.kind == "choice":
        options = spec.options
        if not options or len(options) > MAX_CHOICES:
            raise invalid(f"{field} must list 1 to {MAX_CHOICES} strings, not {len(options)}")
    elif spec.kind == "grammar" and "::=" not in spec.spec:
        raise invalid(f"{field} must be an EBNF grammar with rules like 'root ::= ...'")
    _checked[key] = None
    while len(_checked) > 1024:
        _checked.popitem(last=False)


def check_schema(schema: Any, field: str) -> None:
    import jsonschema

    try:
        jsonschema.validators.validator_for(schema).check_schema(schema)
    except jsonschema.SchemaError as e:
        raise invalid(f"{field} is not a valid JSON schema: at {_pointer(e.path)}: "
                                      f"{e.message}") from None
    _check_keywords(schema, field, [])


def _check_keywords(schema: Any, field: str, path: list) -> None:
    if isinstance(schema, bool):
        return
    if not isinstance(schema, dict):
        raise invalid(f"{field} at {_pointer(path)}: a schema must be an object or a boolean")
    for k, v in schema.items():
        where = _pointer([*path, k])
        if k not in SUPPORTED and k not in ANNOTATIONS:
            raise invalid(f"{field}: keyword {k!r} at {where} is not supported by structured "
                                          f"output (supported: {', '.join(sorted(SUPPORTED))})")
        if k == "$ref" and not (isinstance(v, str) and (v == "#" or v.startswith("#/"))):
            raise invalid(f"{field}: $ref {v!r} at {where} must point inside the schema "
                                          "('#/$defs/...')")
        if k == "allOf" and len(v) > 1:
            raise invalid(f"{field}: allOf with {len(v)} schemas at {where} is not supported "
                                          "(merge them into one)")
        if k == "pattern":
            check_regex(v, f"{field} at {where}")
        if k in SCHEMA_MAPS:
            for name, sub in v.items():
                _check_keywords(sub, field, [*path, k, name])
        elif k in SCHEMA_LISTS:
            for i, sub in enumerate(v):
                _check_keywords(sub, field, [*path, k, i])
        elif k in ("items", "additionalProperties") and isinstance(v, (dict, bool)):
            _check_keywords(v, field, [*path, k])


def check_regex(pattern: str, field: str) -> None:
    try:
        parsed = re._parser.parse(pattern)  # type: ignore[attr-defined]
    except re.error as e:
        raise invalid(f"{field}: the regex does not compile: {e}") from None
    if parsed.state.flags & ~(re.UNICODE | re.ASCII):
        raise invalid(f"{field}: inline flags such as (?i) are not supported in the regex")
    problem = "a named group (?P<name>...)" if parsed.state.groupdict else _unsupported(parsed)
    if problem:
        raise invalid(f"{field}: {problem} is not supported in the regex")


_UNSUPPORTED = {"ASSERT": "lookahead/lookbehind", "ASSERT_NOT": "negative lookahead/lookbehind",
                "GROUPREF": "a backreference", "GROUPREF_EXISTS": "a conditional group"}


def _unsupported(items: Iterable[tuple[Any, Any]]) -> str | None:
    """The first construct of a parsed regex xgrammar cannot compile, in words."""
    from re import _constants as c  # type: ignore[attr-defined]

    for op, arg in items:
        name = str(op)
        if name in _UNSUPPORTED:
            return _UNSUPPORTED[name]
        if op is c.AT and arg in (c.AT_BOUNDARY, c.AT_NON_BOUNDARY):
            return r"a word boundary (\b, \B)"
        if op is c.SUBPATTERN:
            if arg[1] or arg[2]:  # (?i:...) flags
                return "an inline flag group"
            sub = [arg[3]]
        elif op in (c.MAX_REPEAT, c.MIN_REPEAT, c.POSSESSIVE_REPEAT):
            sub = [arg[2]]
        elif op is c.BRANCH:
            sub = arg[1]
        elif op is c.ATOMIC_GROUP:
            return "an atomic group"
        else:
            continue
        for s in sub:
            if problem := _unsupported(s):
                return problem
    return None


def _pointer(path: Collection[str | int]) -> str:
    return "/" + "/".join(str(p).replace("~", "~0").replace("/", "~1") for p in path) if path else "the root"
