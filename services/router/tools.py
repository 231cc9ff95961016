"""Tool calling on the OpenAI chat API: ``tools``, ``tool_choice`` and ``parallel_tool_calls`` in, the answer's
``tool_calls`` out, the same on native and vLLM instances (the router renders the prompt and reads the output;
what it asks of an engine is an ordinary structured-output constraint).

The request (``tools_from_body``): ``tools`` is a list of ``{"type": "function", "function": {"name",
"description", "parameters"}}`` (names of letters, digits, ``_ . -``, at most 64, unique; ``parameters`` a JSON
schema, ``{"type": "object"}`` when left out); ``tool_choice`` is ``"auto"`` (the default with tools),
``"none"``, ``"required"`` or ``{"type": "function", "function": {"name": ...}}``; ``parallel_tool_calls: false``
allows one call. A conversation carries earlier calls as an assistant message's ``tool_calls`` (``arguments`` a
JSON object as a string, OpenAI's form) and their results as ``tool`` messages.

The prompt (``for_template``): a chat template that reads ``tools`` (Qwen's, Llama's, Hermes') gets them as they
came and the messages' calls with their arguments as objects, which is what such templates expect. One that does
not (SmolLM2's) gets the offered tools described at the end of the system message, and earlier calls written into
the assistant's text, both in the router's call format (``tool_formats.py``: hermes unless
``router.tool_call_parser`` says otherwise), so the model sees what it is asked for. ``tool_choice: "none"``
offers no tool (a model cannot call what it is not shown).

The output, by ``tool_choice``:

- ``auto``: the model decides. Its text is read in the router's call format (``tool_formats.py``: picked from the
  chat template, or set by ``router.tool_call_parser``): hermes ``<tool_call>`` blocks, Llama 3's JSON, Mistral's
  ``[TOOL_CALLS]``, or a pythonic list. A call that parses and names an offered tool becomes a call; the text
  around hermes blocks is the message's content; what does not parse, or names no offered tool, stays in the
  content as the model wrote it.
- ``required``: the output is constrained to a JSON list of one or more ``{"name", "arguments"}`` calls, each
  ``name`` an offered tool's and its ``arguments`` valid under that tool's schema (one call with
  ``parallel_tool_calls: false``).
- a named function: the output is constrained to that function's arguments (its schema).

A response with calls finishes with ``finish_reason: "tool_calls"`` (where the model stopped by itself; a cut
by ``max_tokens`` stays ``length``). Streamed, content goes out as it comes, except what could still be a call's
start (a ``<tool_call>`` tag; the first characters of a whole-output format) held back until it is one or not; an
``auto`` or ``required`` call goes out whole in one ``tool_calls`` delta once its text is complete, a named
function's arguments as they are generated.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field, replace
from enum import StrEnum
from typing import Any, NamedTuple, Protocol

from kvmesh.contracts.sampling import SamplingParams, StructuredOutput

from services.router.errors import invalid
from services.router.reasoning import ThinkSplitter, split_whole
from services.router.structured import check_schema
from services.router.tool_formats import FORMATS, CallDelta, CallFormat, CallReader, Offered, call_id, json_call

NAME = re.compile(r"[A-Za-z0-9_.-]{1,64}")
HERMES = FORMATS["hermes"]
CONSTRAINT_FIELD = "tool_choice"  # what a constraint's errors name
ANY_OBJECT: dict[str, Any] = {"type": "object"}


class Choice(StrEnum):
    NONE = "none"
    AUTO = "auto"
    REQUIRED = "required"
    NAMED = "named"  # {"type": "function", "function": {"name": ...}}


MODES = (Choice.NONE, Choice.AUTO, Choice.REQUIRED)  # the tool_choice strings


@dataclass(frozen=True)
class Tool:
    name: str
    parameters: dict[str, Any] = field(repr=False)  # its arguments' JSON schema
    spec: dict[str, Any] = field(repr=False)        # {"type": "function", "function": {...}}, what a template reads


@dataclass(frozen=True)
class Tools:
    """The tools one request offers and what it asks of the model."""

    tools: tuple[Tool, ...]
    choice: Choice = Choice.AUTO
    named: str = ""        # the function ``tool_choice`` names
    parallel: bool = True  # more than one call allowed

    @property
    def offered(self) -> tuple[Tool, ...]:
        """The tools the prompt shows the model (none under ``tool_choice: "none"``)."""
        return () if self.choice == Choice.NONE else self.tools

    @property
    def forces_call(self) -> bool:
        """Whether the response is a call whatever the model would say (``required``, a named function)."""
        return self.choice in (Choice.REQUIRED, Choice.NAMED)

    @property
    def names(self) -> Offered:
        """The offered tools' names, with their parameters' schemas (what a text-valued call form reads by)."""
        return Offered({t.name: dict(t.parameters.get("properties") or {}) for t in self.offered})

    def constraint(self) -> StructuredOutput | None:
        """What the engine's output must be: a named function's arguments, ``required``'s list of calls."""
        if self.choice == Choice.NAMED:
            return StructuredOutput("json_schema", json.dumps(self._tool(self.named).parameters))
        if self.choice != Choice.REQUIRED:
            return None
        calls = [{"type": "object", "properties": {"name": {"const": t.name}, "arguments": _embedded(t, i)},
                  "required": ["name", "arguments"], "additionalProperties": False}
                 for i, t in enumerate(self.tools)]
        schema: dict[str, Any] = {"type": "array", "minItems": 1, "items": {"anyOf": calls}}
        if not self.parallel:
            schema["maxItems"] = 1
        defs = {f"tool{i}": _rebased(t.parameters, f"#/$defs/tool{i}") for i, t in enumerate(self.tools)
                if _refers(t.parameters)}
        if defs:
            schema["$defs"] = defs
        return StructuredOutput("json_schema", json.dumps(schema))

    def reader(self, fmt: CallFormat = HERMES) -> CallReader:
        """A reader of this request's output, chunk by chunk; ``fmt``: the model's form of a call, which
        ``auto`` reads."""
        if self.choice == Choice.NAMED:
            return NamedCall(self.named)
        if self.choice == Choice.REQUIRED:
            return CallList(self.names)
        return fmt.reader(self.names, self.parallel)

    def _tool(self, name: str) -> Tool:
        return next(t for t in self.tools if t.name == name)


def _refers(schema: Any) -> bool:
    """Whether a schema has a ``$ref`` (then it is kept whole under ``$defs`` and its refs point into it)."""
    if isinstance(schema, dict):
        return "$ref" in schema or any(_refers(v) for v in schema.values())
    if isinstance(schema, list):
        return any(_refers(v) for v in schema)
    return False


def _embedded(tool: Tool, i: int) -> dict[str, Any]:
    """``tool``'s arguments schema as a part of ``required``'s list schema: as is, or, when it has refs (which
    point from its own root), a ref to its copy under the list's ``$defs`` with every ref moved there."""
    if not _refers(tool.parameters):
        return tool.parameters
    return {"$ref": f"#/$defs/tool{i}"}


def _rebased(schema: Any, base: str) -> Any:
    """``schema`` with every ref (``#...``, from its own root) pointing under ``base`` instead."""
    if isinstance(schema, dict):
        return {k: (base + v[1:] if k == "$ref" and isinstance(v, str) and v.startswith("#") else _rebased(v, base))
                for k, v in schema.items()}
    if isinstance(schema, list):
        return [_rebased(v, base) for v in schema]
    return schema


def tools_from_body(body: dict) -> Tools | None:
    """The body's ``tools`` / ``tool_choice`` / ``parallel_tool_calls`` (None: no tools); the error names the
    field to fix."""
    given, choice = body.get("tools"), body.get("tool_choice")
    if given is None or given == []:
        if choice not in (None, "none"):
            raise invalid("tool_choice needs tools: list the functions the model may call in tools")
        return None
    if not isinstance(given, list):
        raise invalid('tools must be a list of {"type": "function", "function": {"name": ..., "parameters": '
                      "{...}}}")
    tools = tuple(_tool(t, f"tools[{i}]") for i, t in enumerate(given))
    names = [t.name for t in tools]
    if len(set(names)) < len(names):
        dup = next(n for n in names if names.count(n) > 1)
        raise invalid(f"tools: the name {dup!r} is given twice; each function needs a name of its own")
    parallel = body.get("parallel_tool_calls")
    if parallel is not None and not isinstance(parallel, bool):
        raise invalid("parallel_tool_calls must be true or false")
    out = Tools(tools, *_choice(choice, names), parallel is not False)
    if out.choice == Choice.REQUIRED:
        for i, t in enumerate(tools):  # every one is part of the constraint
            check_schema(t.parameters, f"tools[{i}].function.parameters")
    elif out.choice == Choice.NAMED:
        i = names.index(out.named)
        check_schema(tools[i].parameters, f"tools[{i}].function.parameters")
    return out


def _tool(t: Any, where: str) -> Tool:
    if not isinstance(t, dict) or t.get("type") != "function" or not isinstance(t.get("function"), dict):
        raise invalid(f'{where} must be {{"type": "function", "function": {{"name": ..., "parameters": {{...}}}}}}')
    fn = t["function"]
    name = fn.get("name")
    if not isinstance(name, str) or not NAME.fullmatch(name):
        raise invalid(f"{where}.function.name must be 1 to 64 letters, digits, '_', '.' or '-', not {name!r}")
    if fn.get("description") is not None and not isinstance(fn["description"], str):
        raise invalid(f"{where}.function.description must be a string")
    parameters = fn.get("parameters")
    if parameters is None:
        parameters = ANY_OBJECT
    if not isinstance(parameters, dict):
        raise invalid(f"{where}.function.parameters must be a JSON schema (an object)")
    return Tool(name, parameters, {"type": "function", "function": {**fn, "parameters": parameters}})


def _choice(choice: Any, names: list[str]) -> tuple[Choice, str]:
    if choice is None:
        return Choice.AUTO, ""
    if isinstance(choice, str):
        if choice not in MODES:
            raise invalid(f'tool_choice must be "none", "auto", "required" or {{"type": "function", "function": '
                          f'{{"name": ...}}}}, not {choice!r}')
        return Choice(choice), ""
    fn = choice.get("function") if isinstance(choice, dict) and choice.get("type") == "function" else None
    name = fn.get("name") if isinstance(fn, dict) else None
    if not isinstance(name, str):
        raise invalid('tool_choice must be "none", "auto", "required" or {"type": "function", "function": '
                      '{"name": ...}}')
    if name not in names:
        raise invalid(f"tool_choice names the function {name!r}, which is not in tools ({', '.join(names)})")
    return Choice.NAMED, name


# ---- the prompt ----------------------------------------------------------------------------------------------

class Template(Protocol):
    """What ``for_template`` needs to know of a tokenizer's chat template."""

    @property
    def takes_tools(self) -> bool: ...
    @property
    def takes_tool_calls(self) -> bool: ...


def for_template(chat: list[dict[str, Any]], tools: Tools | None, template: Template,
                 fmt: CallFormat = HERMES) -> tuple[list[dict[str, Any]], list[dict[str, Any]] | None]:
    """The messages and the ``tools`` argument to render ``chat`` with (see the module's docstring); ``fmt``:
    the form calls are described and written in where the template does not render them."""
    offered = [t.spec for t in tools.offered] if tools is not None else []
    if not template.takes_tool_calls:
        chat = [_written(m, fmt) for m in chat]
    if not offered:
        return chat, None
    if template.takes_tools:
        return chat, offered
    described = fmt.describe(offered)
    if chat and chat[0]["role"] == "system":
        return [{**chat[0], "content": f"{chat[0]['content']}\n\n{described}"}, *chat[1:]], None
    return [{"role": "system", "content": described}, *chat], None


def _written(m: dict[str, Any], fmt: CallFormat) -> dict[str, Any]:
    """An assistant message's calls written into its text in ``fmt`` (for a template that does not render
    calls)."""
    calls = m.get("tool_calls")
    if not calls:
        return m
    written = fmt.written(calls)
    text = f"{m['content']}\n{written}" if m["content"] else written
    return {k: v for k, v in m.items() if k != "tool_calls"} | {"content": text}


def message_calls(calls: Any, where: str) -> list[dict[str, Any]]:
    """An assistant message's ``tool_calls`` for the template: each ``{"id", "type": "function", "function":
    {"name", "arguments"}}`` with the arguments (OpenAI's JSON text) as an object."""
    if not isinstance(calls, list):
        raise invalid(f"{where} must be a list of {{id, type: function, function: {{name, arguments}}}}")
    out = []
    for j, c in enumerate(calls):
        fn = c.get("function") if isinstance(c, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
            raise invalid(f"{where}[{j}] must be {{id, type: function, function: {{name, arguments}}}}")
        args = fn.get("arguments", "{}")
        if isinstance(args, str):
            try:
                args = json.loads(args) if args.strip() else {}
            except ValueError as e:
                raise invalid(f"{where}[{j}].function.arguments is not valid JSON: {e}") from None
        if not isinstance(args, dict):
            raise invalid(f"{where}[{j}].function.arguments must be a JSON object (as a string)")
        out.append({"id": str(c.get("id") or ""), "type": "function",
                    "function": {"name": fn["name"], "arguments": args}})
    return out


# ---- the output ----------------------------------------------------------------------------------------------

class CallList:
    """``required``: the whole output is a JSON list of calls (the constraint makes it one, unless cut)."""

    def __init__(self, names: frozenset[str]) -> None:
        self.names, self.text, self.called = names, "", False

    def feed(self, text: str) -> tuple[str, list[CallDelta]]:
        self.text += text
        return "", []

    def close(self) -> tuple[str, list[CallDelta]]:
        try:
            items = json.loads(self.text)
        except ValueError:
            items = None
        calls = [json_call(c, self.names) for c in (items if isinstance(items, list) else [None])]
        if not calls or None in calls:  # cut short by max_tokens: the text as it came
            return self.text, []
        self.called = True
        return "", [CallDelta(i, call_id(), *c) for i, c in enumerate(calls) if c is not None]


class NamedCall:
    """A named function: the whole output is its arguments, streamed as they come."""

    def __init__(self, name: str) -> None:
        self.name, self.called = name, False

    def feed(self, text: str) -> tuple[str, list[CallDelta]]:
        if not self.called:
            self.called = True
            return "", [CallDelta(0, call_id(), self.name, text)]
        return "", [CallDelta(0, arguments=text)] if text else []

    def close(self) -> tuple[str, list[CallDelta]]:
        if self.called:
            return "", []
        self.called = True  # nothing was generated: a call with empty arguments all the same
        return "", [CallDelta(0, call_id(), self.name, "")]


def constrained(sampling: SamplingParams, field: str, tools: Tools | None) -> tuple[SamplingParams, str]:
    """The request's sampling with ``tools``' constraint (``required``, a named function) as its one
    structured-output constraint, and the field that constraint's errors name; a request that also has one of
    its own (from ``field``) is refused."""
    constraint = tools.constraint() if tools is not None else None
    if tools is None or constraint is None:
        return sampling, field
    if sampling.structured is not None:
        raise invalid(f"tool_choice {tools.choice.value} constrains the output to tool calls; it cannot take "
                      f"{field} too: drop one")
    return replace(sampling, structured=constraint), CONSTRAINT_FIELD


class Read(NamedTuple):
    """A whole response as its tools read it: the content (None: only calls), the calls, the finish reason."""

    content: str | None
    calls: list[dict[str, Any]]
    finish_reason: str


def read_whole(tools: Tools, text: str, reason: str, fmt: CallFormat = HERMES) -> Read:
    """A whole response's text read for calls (``auto`` in ``fmt``); without any, the text unchanged."""
    reader = tools.reader(fmt)
    said, calls = reader.feed(text)
    rest, more = reader.close()
    if not reader.called:
        return Read(text, [], reason)
    return Read((said + rest).strip() or None, whole_calls(calls + more), finish_reason(reason, True))


class ChatRead(NamedTuple):
    """A whole chat response read: the reasoning split out (None: none, or not split), the content (None: only
    calls), the calls, the finish reason."""

    reasoning: str | None
    content: str | None
    calls: list[dict[str, Any]]
    finish_reason: str


def read_chat(text: str, reason: str, tools: Tools | None, fmt: CallFormat, think: bool | None) -> ChatRead:
    """A whole chat response as HTTP and gRPC answer it: a reasoning model's thinking split out first (``think``:
    whether the output begins inside it; None: not split), the rest read for ``tools``' calls."""
    reasoning, content = split_whole(text, think) if think is not None else (None, text)
    if tools is None:
        return ChatRead(reasoning, content, [], reason)
    read = read_whole(tools, content, reason, fmt)
    return ChatRead(reasoning, read.content, read.calls, read.finish_reason)


class ChatOutput:
    """One chat response's text read as it streams, the same for HTTP's chunks and gRPC's: a reasoning model's
    thinking split out first (``thinking``), the rest read for calls (``calls``); either may be None."""

    def __init__(self, calls: CallReader | None, thinking: ThinkSplitter | None) -> None:
        self.calls, self.thinking = calls, thinking

    @property
    def called(self) -> bool:
        return self.calls is not None and self.calls.called

    def feed(self, text: str, last: bool = False) -> tuple[str, str, list[CallDelta]]:
        """``text``'s (reasoning, content, call pieces); ``last``: the response's end, where whatever was held
        back goes out."""
        thought = ""
        if self.thinking is not None:
            thought, text = self.thinking.feed(text)
            if last:
                more, rest = self.thinking.close()
                thought, text = thought + more, text + rest
        if self.calls is None:
            return thought, text, []
        said, deltas = self.calls.feed(text)
        if last:
            rest, more_calls = self.calls.close()
            said, deltas = said + rest, deltas + more_calls
        return thought, said, deltas


def whole_calls(deltas: list[CallDelta]) -> list[dict[str, Any]]:
    """A whole response's ``tool_calls`` from its deltas."""
    calls: dict[int, dict[str, Any]] = {}
    for d in deltas:
        c = calls.setdefault(d.index, {"id": d.id, "type": "function", "function": {"name": d.name, "arguments": ""}})
        c["function"]["arguments"] += d.arguments
    return [calls[i] for i in sorted(calls)]


def finish_reason(reason: str, called: bool) -> str:
    """A response with calls that stopped by itself finished with ``tool_calls``."""
    return "tool_calls" if called and reason == "stop" else reason
