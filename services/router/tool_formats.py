"""How a model writes a tool call, per model family: reading calls out of its text (``tool_choice: "auto"``), and,
for a chat template that does not render tools itself, describing the tools and writing earlier calls into the
prompt in that same form. ``tools.py`` holds the request's side; ``required`` and a named function do not depend
on a format (their output is constrained JSON).

The formats (the names are vLLM's ``--tool-call-parser`` values for the same forms):

- ``hermes``: ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` blocks anywhere in the text, the text
  around them the content (Qwen 2.5 / 3, NousResearch Hermes, many fine-tunes).
- ``llama3_json``: the whole output is a call, ``{"name": ..., "parameters": {...}}`` (``arguments`` read too),
  several separated by ``;``, after an optional ``<|python_tag|>`` (Llama 3.1 / 3.2).
- ``mistral``: ``[TOOL_CALLS]`` and a JSON list of ``{"name", "arguments"}`` (tokenizers up to v7), or one
  ``name{arguments}`` / ``name[ARGS]{arguments}`` a call (v11 on). ``[TOOL_CALLS]`` is a special token that
  detokenizing drops, so the list or the ``name{`` at the start of the output is what is read.
- ``qwen3_coder``: ``<tool_call>`` blocks as hermes's, each holding ``<function=NAME>`` and its
  ``<parameter=KEY>value</parameter>`` elements (Qwen3-Coder, Qwen3.5 / 3.6). A value is text: it is read by the
  tool's schema for that parameter (a number, boolean, null, object or array where the schema says so and the text
  is one; a string otherwise), and without a schema as JSON when it is an object or array. A block holding JSON is
  read as hermes's.
- ``glm45``: ``<tool_call>NAME`` then ``<arg_key>KEY</arg_key><arg_value>value</arg_value>`` pairs and
  ``</tool_call>`` (GLM-4.5, 4.6, 4.7), each value text read by the tool's schema as qwen3_coder's.
- ``deepseek_v3`` / ``deepseek_v31``: a section ``<｜tool▁calls▁begin｜>`` .. ``<｜tool▁calls▁end｜>`` of calls
  ``<｜tool▁call▁begin｜>`` .. ``<｜tool▁call▁end｜>``, each ``function<｜tool▁sep｜>NAME`` and its arguments in a
  fenced JSON block (DeepSeek V3, R1-0528) or ``NAME<｜tool▁sep｜>{arguments}`` (V3.1, V3.2); either reader takes
  both, the name says which form the prompt shows. The text before the section is the content.
- ``kimi_k2``: a section ``<|tool_calls_section_begin|>`` .. ``<|tool_calls_section_end|>`` of calls
  ``<|tool_call_begin|>functions.NAME:INDEX<|tool_call_argument_begin|>{arguments}<|tool_call_end|>`` (Kimi K2,
  K2 Thinking); ``functions.NAME:INDEX`` is the call's id, kept as the call's id (Kimi's template writes it back
  into the next prompt). The markers are special tokens in Kimi's tokenizer.
- ``pythonic``: the whole output is a Python list of calls, ``[get_weather(city="Paris"), ...]``, arguments as
  literals (Llama 3.2's and Llama 4's pythonic templates, several small tool models).

A tagged form's markers may be special tokens of the model's tokenizer (Kimi K2's are; some fine-tunes mark
hermes's ``<tool_call>`` special), which the output text leaves out: then a request that offers tools and lets the
model choose (``tool_choice`` auto) asks the engine to keep special tokens in its text (``skip_special_tokens``
false; ``keeps_special_tokens``, decided once from the tokenizer; vLLM's hermes and kimi_k2 parsers ask for it
whenever tools are offered).

``auto`` (the router's default, ``router.tool_call_parser``) picks by the chat template: one that writes
``<|tool_calls_section_begin|>`` is kimi_k2, ``<｜tool▁call▁begin｜>`` deepseek_v3 (with a fenced ```` ```json ````
block) or deepseek_v31, ``<function=`` and ``<parameter=`` qwen3_coder, ``<arg_key>`` glm45, ``<tool_call>`` hermes,
``[TOOL_CALLS]`` mistral, ``<|python_tag|>`` or Llama's ``"parameters": dictionary`` instruction llama3_json; any
other template (SmolLM2's renders no tools) gets hermes, which the router then describes to the model in the system
message.

A whole-output format is decided by the output's first characters: while they could still start a call, the
reader holds them; once they cannot, the text streams as content. A call-shaped output is read when the output
ends; one that does not parse, or calls a tool that was not offered, is returned as the text the model wrote.
"""

from __future__ import annotations

import ast
import json
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol, Self

from services.router.ids import random_hex

OPEN, CLOSE = "<tool_call>", "</tool_call>"
PYTHON_TAG, MISTRAL_CALLS, MISTRAL_ARGS = "<|python_tag|>", "[TOOL_CALLS]", "[ARGS]"
MISTRAL_NAME = re.compile(r"\s*(?:\[TOOL_CALLS\])?\s*([A-Za-z0-9_.-]+)\s*(?:\[ARGS\])?\s*")  # v11's call head


@dataclass
class CallDelta:
    """A piece of one call as a streamed ``tool_calls`` entry: the first piece has its id and name."""

    index: int
    id: str = ""
    name: str = ""
    arguments: str = ""

    def wire(self) -> dict[str, Any]:
        fn = ({"name": self.name} if self.name else {}) | {"arguments": self.arguments}
        return {"index": self.index, **({"id": self.id, "type": "function"} if self.id else {}), "function": fn}


class CallReader(Protocol):
    """Reads one response's text as it is generated: what of it is content, and the calls."""

    @property
    def called(self) -> bool: ...  # whether the text held a call so far

    def feed(self, text: str) -> tuple[str, list[CallDelta]]: ...
    def close(self) -> tuple[str, list[CallDelta]]: ...


def call_id() -> str:
    return f"call_{random_hex(24)}"


Call = tuple[str, str]  # a call's name and its arguments as JSON text


def checked(name: Any, args: Any, names: frozenset[str]) -> Call | None:
    """``(name, arguments as JSON text)`` when ``name`` is an offered tool's and ``args`` an object (or JSON text
    of one), else None."""
    if name not in names:
        return None
    if isinstance(args, str):
        try:
            args = json.loads(args) if args.strip() else {}
        except ValueError:
            return None
    if not isinstance(args, dict):
        return None
    return name, json.dumps(args, ensure_ascii=False)


def json_call(obj: Any, names: frozenset[str]) -> Call | None:
    """A ``{"name", "arguments"}`` (or ``"parameters"``) object as a call, or None."""
    if not isinstance(obj, dict):
        return None
    return checked(obj.get("name"), obj.get("arguments", obj.get("parameters", {})), names)


def held_back(text: str, tag: str) -> int:
    """How many characters at the end of ``text`` could be the start of ``tag``."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:n]):
            return n
    return 0


def _calls_text(calls: list[dict[str, Any]]) -> list[tuple[str, dict[str, Any]]]:
    """An assistant message's calls (OpenAI's form, arguments an object or its JSON text) as (name, arguments)."""
    out = []
    for c in calls:
        args = c["function"]["arguments"]
        out.append((c["function"]["name"], json.loads(args) if isinstance(args, str) else args))
    return out


def _listed(offered: list[dict[str, Any]]) -> str:
    return "\n".join(json.dumps(t, ensure_ascii=False) for t in offered)


# ---- hermes: tagged blocks within the text ------------------------------------------------------------------

class Offered(frozenset[str]):
    """The offered tools' names, with each one's parameters' schemas (``properties``): what a form that writes
    arguments as text (qwen3_coder) reads each value by."""

    properties: dict[str, dict[str, Any]]

    def __new__(cls, properties: dict[str, dict[str, Any]]) -> Self:
        out = super().__new__(cls, properties)
        out.properties = properties
        return out


def _schema_types(schema: Any) -> set[str]:
    """The JSON types a (sub)schema allows: its ``type`` (one or a list), and its ``anyOf`` / ``oneOf``'s."""
    if not isinstance(schema, dict):
        return set()
    t = schema.get("type")
    out = {t} if isinstance(t, str) else {x for x in t if isinstance(x, str)} if isinstance(t, list) else set()
    for key in ("anyOf", "oneOf"):
        for sub in schema.get(key) or ():
            out |= _schema_types(sub)
    if "enum" in schema and not out:
        out |= {"string" if isinstance(v, str) else "any" for v in schema["enum"]}
    return out


def typed(value: str, schema: Any) -> Any:
    """A parameter written as text, read as its schema says: a string where the schema allows one (or says
    nothing of its type), else the JSON value the text is when it is one the schema allows; a JSON object or
    array when there is no schema at all; the text itself when nothing fits."""
    types = _schema_types(schema)
    if not types:
        if schema is None and value.lstrip()[:1] in ("{", "["):
            try:
                return json.loads(value)
            except ValueError:
                return value
        return value
    if "string" in types:
        return value
    t = value.strip()
    if "boolean" in types and t.lower() in ("true", "false"):
        return t.lower() == "true"
    if "null" in types and t.lower() in ("null", "none"):
        return None
    try:
        parsed = json.loads(t)
    except ValueError:
        return value
    kinds = {bool: "boolean", int: "integer", float: "number", dict: "object", list: "array", type(None): "null"}
    kind = kinds.get(type(parsed), "")
    if kind in types or "any" in types or (kind == "integer" and "number" in types):
        return parsed
    if kind == "number" and "integer" in types and float(parsed).is_integer():
        return int(parsed)
    return value


Body = Callable[[str, frozenset[str]], list[Call] | None]  # a block's inside as its calls (None: not calls)


class TaggedCalls:
    """Blocks between ``open`` and ``close`` (hermes's ``<tool_call>``) out of the text, the rest is content;
    ``body`` reads a block's inside as its calls. A block the output ends inside (the model stopped before the
    closing tag) is read as one too; what does not read stays text, as written."""

    def __init__(self, names: frozenset[str], parallel: bool = True, body: Body | None = None,
                 tags: tuple[str, str] = (OPEN, CLOSE)) -> None:
        self.names, self.parallel = names, parallel
        self.body = body or _json_block
        self.open, self.close_tag = tags
        self.buf, self.inside, self.count = "", False, 0

    @property
    def called(self) -> bool:
        return self.count > 0

    def feed(self, text: str) -> tuple[str, list[CallDelta]]:
        self.buf += text
        content: list[str] = []
        calls: list[CallDelta] = []
        while True:
            if not self.inside:
                i = self.buf.find(self.open)
                if i < 0:
                    cut = len(self.buf) - held_back(self.buf, self.open)
                    content.append(self.buf[:cut])
                    self.buf = self.buf[cut:]
                    break
                content.append(self.buf[:i])
                self.buf, self.inside = self.buf[i + len(self.open):], True
            else:
                j = self.buf.find(self.close_tag)
                if j < 0:
                    break
                raw, self.buf, self.inside = self.buf[:j], self.buf[j + len(self.close_tag):], False
                said, found = self._block(raw, self.close_tag)
                content.append(said)
                calls += found
        return "".join(content), calls

    def _block(self, raw: str, closing: str) -> tuple[str, list[CallDelta]]:
        """One block's calls, or the block as written (not calls, or a call past the first with parallel off)."""
        found = self._calls(raw) if self.parallel or not self.count else None
        if not found:
            return self.open + raw + closing, []
        if not self.parallel:
            found = found[:1]
        out = [CallDelta(self.count + i, cid, *c) for i, (cid, c) in enumerate(found)]
        self.count += len(out)
        return "", out

    def _calls(self, raw: str) -> list[tuple[str, Call]] | None:
        """A block's calls, each with its id (a new one: these forms write none)."""
        found = self.body(raw, self.names)
        return [(call_id(), c) for c in found] if found else None

    def close(self) -> tuple[str, list[CallDelta]]:
        raw, inside = self.buf, self.inside
        self.buf, self.inside = "", False
        return self._block(raw, "") if inside else (raw, [])


def _json_block(raw: str, names: frozenset[str]) -> list[Call] | None:
    """A hermes block's inside: ``{"name", "arguments"}``."""
    try:
        call = json_call(json.loads(raw), names)
    except ValueError:
        return None
    return [call] if call is not None else None


XML_FUNCTION = re.compile(r"\s*<function=([^>\n]+)>(.*?)(?:</function>\s*)?\Z", re.DOTALL)
XML_PARAMETER = re.compile(r"<parameter=([^>\n]+)>(.*?)</parameter>", re.DOTALL)


def _text_args(name: str, pairs: str, element: re.Pattern[str], names: frozenset[str],
               trim: bool = False) -> list[Call] | None:
    """``name``'s call from ``pairs``: ``element``'s (key, value) matches one after the other, nothing but white
    space between them, each value read by the tool's schema for its key (``trim``: without one leading and one
    trailing newline, the template's)."""
    schemas = getattr(names, "properties", {}).get(name)
    args: dict[str, Any] = {}
    at = 0
    for m in element.finditer(pairs):
        if pairs[at:m.start()].strip():
            return None
        key, value = m.group(1).strip(), m.group(2)
        if trim:
            value = value.removeprefix("\n").removesuffix("\n")
        args[key] = typed(value, schemas.get(key) if isinstance(schemas, dict) else None)
        at = m.end()
    if pairs[at:].strip():
        return None
    try:
        call = checked(name, args, names)
    except (TypeError, ValueError):
        return None
    return [call] if call is not None else None


def _xml_block(raw: str, names: frozenset[str]) -> list[Call] | None:
    """A qwen3_coder block's inside: ``<function=NAME>`` with its ``<parameter=KEY>value</parameter>`` elements;
    a JSON inside is read as hermes's."""
    m = XML_FUNCTION.match(raw)
    if m is None:
        return _json_block(raw, names)
    return _text_args(m.group(1).strip(), m.group(2), XML_PARAMETER, names, trim=True)


GLM_ARG = re.compile(r"<arg_key>(.*?)</arg_key>\s*<arg_value>(.*?)</arg_value>", re.DOTALL)


def _glm_block(raw: str, names: frozenset[str]) -> list[Call] | None:
    """A glm45 block's inside: the function's name, then its ``<arg_key>`` / ``<arg_value>`` pairs."""
    i = raw.find("<arg_key>")
    name, pairs = (raw, "") if i < 0 else (raw[:i], raw[i:])
    name = name.strip()
    if not name or "<" in name:
        return None
    return _text_args(name, pairs, GLM_ARG, names)


def _xml_value(v: Any) -> str:
    return v if isinstance(v, str) else json.dumps(v, ensure_ascii=False)


class Hermes:
    name = "hermes"
    tags: tuple[str, str] = (OPEN, CLOSE)  # what a block (a section) of calls opens and closes with
    markers: tuple[str, ...] = tags  # what the reader must see in the text to find a call

    def reader(self, names: frozenset[str], parallel: bool) -> CallReader:
        return TaggedCalls(names, parallel)

    def describe(self, offered: list[dict[str, Any]]) -> str:
        return ("# Tools\n\nYou can call the functions described (as JSON schemas) in <tools></tools>, when one helps "
                f"to answer:\n<tools>\n{_listed(offered)}\n</tools>\n\nTo call one, write a JSON object with the "
                f"function's name and its arguments between {OPEN} and {CLOSE}, one call a block:\n{OPEN}\n"
                '{"name": "<function name>", "arguments": {<the arguments>}}\n' + CLOSE)

    def written(self, calls: list[dict[str, Any]]) -> str:
        return "\n".join(f"{OPEN}\n{json.dumps({'name': n, 'arguments': a}, ensure_ascii=False)}\n{CLOSE}"
                         for n, a in _calls_text(calls))

    def looks_like_call(self, text: str) -> bool:
        t, (opening, closing) = text.strip(), self.tags
        return t.endswith(closing) or t.rfind(opening) > t.rfind(closing)


class TextArgs(Hermes):
    """A tagged form whose arguments are text elements, each read by the tool's schema (``body``). A call is
    written as ``head``, one ``element`` per argument and ``tail`` between the tags (``str.format`` templates of
    ``name``, and of ``key`` and ``value``), which ``describe`` shows the model as the form to follow."""

    def __init__(self, name: str, body: Body, head: str, element: str, tail: str) -> None:
        self.name, self.body, self.head, self.element, self.tail = name, body, head, element, tail

    def call(self, name: str, args: dict[str, Any]) -> str:
        elements = "".join(self.element.format(key=k, value=_xml_value(v)) for k, v in args.items())
        return OPEN + self.head.format(name=name) + elements + self.tail + CLOSE

    def reader(self, names: frozenset[str], parallel: bool) -> CallReader:
        return TaggedCalls(names, parallel, self.body)

    def describe(self, offered: list[dict[str, Any]]) -> str:
        return ("# Tools\n\nYou have access to the following functions:\n\n<tools>\n"
                f"{_listed(offered)}\n</tools>\n\nIf you choose to call a function, reply in the following format:"
                f"\n\n{self.call('example_function_name', {'example_parameter_1': 'value_1'})}")

    def written(self, calls: list[dict[str, Any]]) -> str:
        return "\n".join(self.call(n, a) for n, a in _calls_text(calls))


QWEN3_CODER = TextArgs("qwen3_coder", _xml_block, "\n<function={name}>\n",
                       "<parameter={key}>\n{value}\n</parameter>\n", "</function>\n")
GLM45 = TextArgs("glm45", _glm_block, "{name}\n", "<arg_key>{key}</arg_key>\n<arg_value>{value}</arg_value>\n", "")


# ---- deepseek: a section of calls, each between its own tags ----------------------------------------------

DS_CALLS = ("<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>")
DS_CALL_BEGIN, DS_CALL_END, DS_SEP = "<｜tool▁call▁begin｜>", "<｜tool▁call▁end｜>", "<｜tool▁sep｜>"
DS_CALL = re.compile(re.escape(DS_CALL_BEGIN) + r"(.*?)" + re.escape(DS_SEP) + r"(.*?)(?:" + re.escape(DS_CALL_END)
                     + r"|\Z)", re.DOTALL)
DS_FENCED = re.compile(r"\s*([^\n]+?)\s*\n```(?:json)?\s*\n(.*?)\n?```\s*\Z", re.DOTALL)


def _deepseek_section(raw: str, names: frozenset[str]) -> list[Call] | None:
    """A DeepSeek calls section's inside: its calls one after the other (white space between), each V3's
    ``function<｜tool▁sep｜>NAME`` + a fenced JSON block or V3.1's ``NAME<｜tool▁sep｜>{arguments}``; the last may
    lack its end tag (the output ended there)."""
    calls: list[Call | None] = []
    at = 0
    for m in DS_CALL.finditer(raw):
        if raw[at:m.start()].strip():
            return None
        head, rest = m.group(1).strip(), m.group(2)
        fenced = DS_FENCED.match(rest) if head == "function" else None
        name, args = (fenced.group(1), fenced.group(2)) if fenced else (head, rest)
        calls.append(checked(name, args, names))
        at = m.end()
    if raw[at:].strip():
        return None
    return _all(calls)


class Sectioned(Hermes):
    """A form whose calls come in one section (between its ``tags``), described to the model as such."""

    def describe(self, offered: list[dict[str, Any]]) -> str:
        example = self.written([{"function": {"name": "<function name>", "arguments": {"<argument>": "<value>"}}}])
        return ("# Tools\n\nYou can call these functions (JSON schemas), when one helps to answer:\n"
                f"{_listed(offered)}\n\nTo call, write the calls in this form, one or more in the section:\n"
                f"{example}")


class DeepSeekV3(Sectioned):
    name = "deepseek_v3"
    tags = DS_CALLS
    markers = (*DS_CALLS, DS_CALL_BEGIN, DS_CALL_END, DS_SEP)
    fenced = True

    def reader(self, names: frozenset[str], parallel: bool) -> CallReader:
        return TaggedCalls(names, parallel, _deepseek_section, self.tags)

    def written(self, calls: list[dict[str, Any]]) -> str:
        def one(n: str, a: dict[str, Any]) -> str:
            args = json.dumps(a, ensure_ascii=False)
            body = f"function{DS_SEP}{n}\n```json\n{args}\n```" if self.fenced else f"{n}{DS_SEP}{args}"
            return DS_CALL_BEGIN + body + DS_CALL_END
        return DS_CALLS[0] + "".join(one(n, a) for n, a in _calls_text(calls)) + DS_CALLS[1]


class DeepSeekV31(DeepSeekV3):
    name = "deepseek_v31"
    fenced = False


# ---- kimi_k2: a section of calls in special tokens, each named by its id ------------------------------------

KIMI_CALLS = ("<|tool_calls_section_begin|>", "<|tool_calls_section_end|>")
KIMI_BEGIN, KIMI_ARGS, KIMI_END = "<|tool_call_begin|>", "<|tool_call_argument_begin|>", "<|tool_call_end|>"
KIMI_CALL = re.compile(re.escape(KIMI_BEGIN) + r"(.*?)" + re.escape(KIMI_ARGS) + r"(.*?)(?:" + re.escape(KIMI_END)
                       + r"|\Z)", re.DOTALL)
KIMI_ID = re.compile(r"(?:functions\.)?([^:]+):\d+")  # functions.NAME:INDEX, the call's id


def _kimi_section(raw: str, names: frozenset[str]) -> list[tuple[str, Call]] | None:
    """A Kimi calls section's inside: ``<|tool_call_begin|>ID<|tool_call_argument_begin|>{arguments}
    <|tool_call_end|>`` one after the other (white space between; the last may lack its end, the output ended
    there), each call's id ``functions.NAME:INDEX`` kept as the call's id (the template writes it back)."""
    calls: list[tuple[str, Call] | None] = []
    at = 0
    for m in KIMI_CALL.finditer(raw):
        if raw[at:m.start()].strip():
            return None
        cid = m.group(1).strip()
        named = KIMI_ID.fullmatch(cid)
        call = checked(named.group(1), m.group(2), names) if named else None
        calls.append((cid, call) if call is not None else None)
        at = m.end()
    if raw[at:].strip() or not calls or None in calls:
        return None
    return [c for c in calls if c is not None]


class KimiCalls(TaggedCalls):
    """Kimi K2's section: the calls keep the ids the model wrote."""

    def __init__(self, names: frozenset[str], parallel: bool) -> None:
        super().__init__(names, parallel, tags=KIMI_CALLS)

    def _calls(self, raw: str) -> list[tuple[str, Call]] | None:
        return _kimi_section(raw, self.names)


class KimiK2(Sectioned):
    """Kimi K2 (and K2 Thinking): its markers are special tokens in Kimi's tokenizer."""

    name = "kimi_k2"
    tags = KIMI_CALLS
    markers = (*KIMI_CALLS, KIMI_BEGIN, KIMI_ARGS, KIMI_END)

    def reader(self, names: frozenset[str], parallel: bool) -> CallReader:
        return KimiCalls(names, parallel)

    def written(self, calls: list[dict[str, Any]]) -> str:
        def one(i: int, c: dict[str, Any]) -> str:
            name, args = _calls_text([c])[0]
            cid = c.get("id") or ""
            if not KIMI_ID.fullmatch(cid):
                cid = f"functions.{name}:{i}"
            return f"{KIMI_BEGIN}{cid}{KIMI_ARGS}{json.dumps(args, ensure_ascii=False)}{KIMI_END}"
        return KIMI_CALLS[0] + "".join(one(i, c) for i, c in enumerate(calls)) + KIMI_CALLS[1]


# ---- the whole output is the calls: llama3_json, mistral, pythonic ------------------------------------------

Parse = Callable[[str, frozenset[str]], list[Call] | None]


class LeadingCalls:
    """A format whose calls are the whole output: held while its start could still be a call (``starts``), then
    content as it comes, or read whole at the end."""

    def __init__(self, names: frozenset[str], parallel: bool, starts: tuple[str, ...], parse: Parse) -> None:
        self.names, self.parallel, self.starts, self.parse = names, parallel, starts, parse
        self.buf, self.state, self.called = "", "", False  # state: "" undecided, "text", "calls"

    def feed(self, text: str) -> tuple[str, list[CallDelta]]:
        if self.state == "text":
            return text, []
        self.buf += text
        if self.state == "":
            compact = re.sub(r"\s+", "", self.buf[:256])
            if any(compact.startswith(s) for s in self.starts):
                self.state = "calls"
            elif not compact or any(s.startswith(compact) for s in self.starts):
                return "", []  # could still be a call's start
            else:
                self.state, out, self.buf = "text", self.buf, ""
                return out, []
        return "", []

    def close(self) -> tuple[str, list[CallDelta]]:
        text, self.buf = self.buf, ""
        calls = self.parse(text, self.names) if self.state == "calls" else None
        if not calls:  # not a call after all (or cut short): the text as the model wrote it
            return text, []
        self.called = True
        if not self.parallel and len(calls) > 1:
            calls = calls[:1]
        return "", [CallDelta(i, call_id(), *c) for i, c in enumerate(calls)]


def _json_values(text: str, separators: str) -> list[Any] | None:
    """The JSON values ``text`` is made of, one after the other with ``separators`` or white space between
    them; None when something else is in it."""
    decoder, i = json.JSONDecoder(), 0
    out: list[Any] = []
    while True:
        while i < len(text) and (text[i].isspace() or text[i] in separators):
            i += 1
        if i == len(text):
            return out
        try:
            value, i = decoder.raw_decode(text, i)
        except ValueError:
            return None
        out.append(value)


def _all(calls: list[Call | None]) -> list[Call] | None:
    return [c for c in calls if c is not None] if calls and None not in calls else None


def parse_llama3_json(text: str, names: frozenset[str]) -> list[Call] | None:
    values = _json_values(text.strip().removeprefix(PYTHON_TAG), ";")
    return None if values is None else _all([json_call(v, names) for v in values])


def parse_mistral(text: str, names: frozenset[str]) -> list[Call] | None:
    body = text.strip().removeprefix(MISTRAL_CALLS).strip()
    if body.startswith("["):  # the JSON list form
        values = _json_values(body, "")
        if values is None or len(values) != 1 or not isinstance(values[0], list):
            return None
        return _all([json_call(v, names) for v in values[0]])
    calls: list[Call | None] = []  # name{args} / name[ARGS]{args}, maybe [TOOL_CALLS] again between calls
    decoder, i = json.JSONDecoder(), 0
    while i < len(body):
        m = MISTRAL_NAME.match(body, i)
        if m is None or m.end() == len(body):
            return None
        try:
            args, i = decoder.raw_decode(body, m.end())
        except ValueError:
            return None
        calls.append(checked(m.group(1), args, names))
        while i < len(body) and body[i].isspace():
            i += 1
    return _all(calls)


def parse_pythonic(text: str, names: frozenset[str]) -> list[Call] | None:
    body = text.strip().removeprefix(PYTHON_TAG).strip()
    try:
        tree = ast.parse(body, mode="eval").body
    except (SyntaxError, ValueError):
        return None
    if not isinstance(tree, ast.List):
        return None
    calls: list[Call | None] = []
    for node in tree.elts:
        if not isinstance(node, ast.Call) or node.args or not isinstance(node.func, (ast.Name, ast.Attribute)):
            return None
        try:
            args = {kw.arg: ast.literal_eval(kw.value) for kw in node.keywords if kw.arg is not None}
        except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError):
            return None
        if len(args) != len(node.keywords):
            return None  # **kwargs
        try:
            calls.append(checked(ast.unparse(node.func), args, names))
        except (TypeError, ValueError):  # a literal JSON cannot write (a set, bytes, a complex number)
            return None
    return _all(calls)


def _pythonic_value(v: Any) -> str:
    return repr(v) if not isinstance(v, (dict, list)) else (
        "{" + ", ".join(f"{k!r}: {_pythonic_value(x)}" for k, x in v.items()) + "}" if isinstance(v, dict)
        else "[" + ", ".join(_pythonic_value(x) for x in v) + "]")


class Llama3Json:
    name = "llama3_json"
    markers: tuple[str, ...] = ()  # a whole-output form: read without its tags

    def reader(self, names: frozenset[str], parallel: bool) -> CallReader:
        return LeadingCalls(names, parallel, ("{", PYTHON_TAG), parse_llama3_json)

    def describe(self, offered: list[dict[str, Any]]) -> str:
        return ("# Tools\n\nYou can call these functions (JSON schemas), when one helps to answer:\n"
                f"{_listed(offered)}\n\nTo call one, respond with only a JSON object in the format "
                '{"name": function name, "parameters": dictionary of argument name and its value}; '
                "several calls are separated by ';'. Do not use variables.")

    def written(self, calls: list[dict[str, Any]]) -> str:
        return "; ".join(json.dumps({"name": n, "parameters": a}, ensure_ascii=False) for n, a in _calls_text(calls))

    def looks_like_call(self, text: str) -> bool:
        return _looks(parse_llama3_json, text)


class Mistral:
    name = "mistral"
    markers: tuple[str, ...] = ()  # a whole-output form: read without its tags

    def reader(self, names: frozenset[str], parallel: bool) -> CallReader:
        starts = (MISTRAL_CALLS, "[{", *(f"{n}{{" for n in names), *(f"{n}{MISTRAL_ARGS}" for n in names))
        return LeadingCalls(names, parallel, starts, parse_mistral)

    def describe(self, offered: list[dict[str, Any]]) -> str:
        return ("# Tools\n\nYou can call these functions (JSON schemas), when one helps to answer:\n"
                f"[AVAILABLE_TOOLS]{json.dumps(offered, ensure_ascii=False)}[/AVAILABLE_TOOLS]\n\nTo call, respond "
                f'with only {MISTRAL_CALLS} and a JSON list of calls: {MISTRAL_CALLS}[{{"name": "<function name>", '
                '"arguments": {<the arguments>}}]')

    def written(self, calls: list[dict[str, Any]]) -> str:
        return MISTRAL_CALLS + json.dumps([{"name": n, "arguments": a} for n, a in _calls_text(calls)],
                                          ensure_ascii=False)

    def looks_like_call(self, text: str) -> bool:
        return _looks(parse_mistral, text)


class Pythonic:
    name = "pythonic"
    markers: tuple[str, ...] = ()  # a whole-output form: read without its tags

    def reader(self, names: frozenset[str], parallel: bool) -> CallReader:
        return LeadingCalls(names, parallel, (*(f"[{n}(" for n in names), *(f"{PYTHON_TAG}[{n}(" for n in names)),
                            parse_pythonic)

    def describe(self, offered: list[dict[str, Any]]) -> str:
        return ("# Tools\n\nYou can call these functions (JSON schemas), when one helps to answer:\n"
                f"{_listed(offered)}\n\nTo call, respond with only a Python list of calls with keyword arguments, "
                "like [func_name1(param_name1=value1, param_name2=value2), func_name2(param=value)].")

    def written(self, calls: list[dict[str, Any]]) -> str:
        return "[" + ", ".join(f"{n}(" + ", ".join(f"{k}={_pythonic_value(v)}" for k, v in a.items()) + ")"
                               for n, a in _calls_text(calls)) + "]"

    def looks_like_call(self, text: str) -> bool:
        return _looks(parse_pythonic, text)


class AnyName(frozenset[str]):
    """Every name: what a session's end is read with when the request listed no tools (a harness that renders
    tools itself)."""

    def __contains__(self, item: object) -> bool:
        return isinstance(item, str) and bool(item)


def _looks(parse: Parse, text: str) -> bool:
    return bool(parse(text, AnyName()))


class CallFormat(Protocol):
    name: str
    markers: tuple[str, ...]

    def reader(self, names: frozenset[str], parallel: bool) -> CallReader: ...
    def describe(self, offered: list[dict[str, Any]]) -> str: ...
    def written(self, calls: list[dict[str, Any]]) -> str: ...
    def looks_like_call(self, text: str) -> bool: ...


FORMATS: dict[str, CallFormat] = {f.name: f for f in (Hermes(), QWEN3_CODER, GLM45, DeepSeekV3(), DeepSeekV31(),
                                                      KimiK2(), Llama3Json(), Mistral(), Pythonic())}
PARSERS = ("auto", *FORMATS)  # router.tool_call_parser's values


def detect(template: str | None) -> CallFormat:
    """The format a chat template's model writes calls in (hermes when the template says nothing of one)."""
    t = template or ""
    if KIMI_CALLS[0] in t:
        return FORMATS["kimi_k2"]
    if DS_CALL_BEGIN in t:
        return FORMATS["deepseek_v3" if "```json" in t else "deepseek_v31"]
    if "<function=" in t and "<parameter=" in t:
        return FORMATS["qwen3_coder"]
    if "<arg_key>" in t:
        return FORMATS["glm45"]
    if OPEN in t:
        return FORMATS["hermes"]
    if MISTRAL_CALLS in t:
        return FORMATS["mistral"]
    if PYTHON_TAG in t or '"parameters": dictionary of argument name' in t:
        return FORMATS["llama3_json"]
    return FORMATS["hermes"]


def keeps_special_tokens(fmt: CallFormat, special: frozenset[str]) -> bool:
    """Whether ``fmt``'s reader needs special tokens kept in the text: some of the markers it finds calls by are
    special tokens of the model's tokenizer (``special``), which the text would otherwise leave out."""
    return not special.isdisjoint(fmt.markers)


def pick(parser: str, template: str | None) -> CallFormat:
    """``router.tool_call_parser``'s format: ``auto`` detects it from the chat template."""
    if parser == "auto":
        return detect(template)
    if parser not in FORMATS:
        raise ValueError(f"tool_call_parser must be one of {', '.join(PARSERS)}, not {parser!r}")
    return FORMATS[parser]
