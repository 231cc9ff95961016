"""An OpenAI request body as the intake's ``Draft``: the JSON itself, each field's type, the sampling fields
(OpenAI's ``presence_penalty``, ``frequency_penalty``, ``logit_bias``; vLLM's extensions: ``top_k``, ``min_p``,
``repetition_penalty``, ``min_tokens``, ``seed``, ``ignore_eos``, ``stop_token_ids``, ``skip_special_tokens``; a
field kvmesh does not serve, ``best_of``, ``suffix`` or the legacy ``functions``, refused unless it says "off"),
the log-probabilities
asked for (completions: ``logprobs: N``; chat: ``logprobs: true`` with ``top_logprobs: N``; N in [0, 20], checked
here because the field to name differs by endpoint), the prompt's (vLLM's ``prompt_logprobs: N``; a completion's
``echo`` with ``logprobs``, whose text and logprobs begin with its prompt's) and the structured-output fields.
Otherwise only the wire's shape is checked here; what the values may be is the intake's business.

Structured output (OpenAI and vLLM): ``response_format`` ``{"type": "json_object"}`` or ``{"type":
"json_schema", "json_schema": {"name", "schema", "strict"}}``; vLLM's ``guided_json``, ``guided_regex``,
``guided_choice``, ``guided_grammar`` and ``structured_outputs: {"json" | "regex" | "choice" | "grammar" |
"json_object"}``; at most one of them. Tool calling (``tools``, ``tool_choice``, ``parallel_tool_calls``, chat
only): ``services/router/tools.py``; a ``tool_choice`` that constrains the output is that one constraint.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from typing import Any, NamedTuple, overload

import orjson
from kvmesh.contracts.sampling import DEFAULT_MAX_TOKENS, MAX_LOGPROBS, SamplingParams, StructuredOutput
from kvmesh.model_source.tokenizer import RESERVED_TEMPLATE_NAMES

from services.router.errors import RequestError, invalid
from services.router.intake import Draft, TemplateArgs, message_cache_control, session_fields, slo_from_headers
from services.router.tools import constrained, tools_from_body


def parse(raw: bytes) -> dict:
    """The body as a JSON object of valid Unicode strings."""
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise invalid(f"the request body is not valid UTF-8 (byte {e.start}): send UTF-8 JSON") from None
    body = _fast_json(text)  # orjson: a 4k-token id list in 66 against json's 191 us ...
    if body is None:  # ... what it refuses, or reads as json does not, read as json reads it: the same answers
        try:
            body = json.loads(text, parse_constant=_reject_constant)
        except ValueError as e:
            raise invalid(f"the request body must be JSON: {e}") from None
        except RecursionError:
            raise invalid("the request body is nested too deeply") from None
    if not isinstance(body, dict):
        raise invalid(f"the request body must be a JSON object, not {_kind(body)}")
    if SURROGATE_ESCAPE.search(text):  # the only way a lone surrogate gets in (the text is valid UTF-8)
        _check_strings(body)
    return body


def draft(body: dict, chat: bool, headers: Mapping[str, str], answer: Shape | None = None) -> Draft:
    """A chat (``messages``) or completions (``prompt``: text or token ids) body as the intake's input. The
    routing overrides come from the headers ``x-kvmesh-policy`` (or the body's ``kvmesh_policy``) and
    ``x-kvmesh-disaggregate``; the session and its agent hints from the body's ``session_id``,
    ``parent_session_id``, ``session_end``, ``session_pause_s``, ``session_retention`` or their headers
    (``intake.SESSION_HEADERS``; a header and a field must agree), and ``cache_control``; the latency targets
    from the body's ``kvmesh_slo``
    (``{"ttft_s": 6, "itl_s": 0.15}``) or the headers ``x-kvmesh-slo-ttft-s`` / ``x-kvmesh-slo-itl-s`` (which
    win). ``answer``: the body's ``shape`` when the caller read it already (else it is read here, for ``n``)."""
    sampling, structured_field = sampling_from_body(body, chat)
    tools = None
    template = None
    more: list[dict[str, Any]] = []  # a batch's prompts past the first
    if chat:
        if "messages" not in body:
            raise invalid("messages is required: a list of {role, content} objects")
        prompt = {"messages": body["messages"]}
        tools = tools_from_body(body)
        template = template_args(body, body["messages"])
        sampling, structured_field = constrained(sampling, structured_field, tools)
    else:
        if body.get("tools"):
            raise invalid("tools are for /v1/chat/completions; /v1/completions takes a prompt alone")
        prompt, *more = _prompts(body.get("prompt"))
    sessions = session_fields({"session_id": str_field(body, "session_id"),
                               "session_end": bool_field(body, "session_end"),
                               "parent_session_id": str_field(body, "parent_session_id"),
                               "session_pause_s": _num(body, "session_pause_s", 0.0),
                               "session_retention": str_field(body, "session_retention")}, headers)
    control = body.get("cache_control")
    if more and sessions.get("session_id"):
        raise invalid("a session's request is one turn: send one prompt with session_id, not a batch")
    return Draft(sampling, **prompt, model=str_field(body, "model"),
                 cache_salt=str_field(body, "cache_salt") or str_field(body, "user"), structured_field=structured_field,
                 policy=headers.get("x-kvmesh-policy") or str_field(body, "kvmesh_policy") or None,
                 disaggregate=headers.get("x-kvmesh-disaggregate") or None, **sessions,
                 cache_control=None if control is None else message_cache_control(control, "cache_control"),
                 slo=slo_from_headers(headers, _slo(body)), tools=tools, choices=(answer or shape(body)).n,
                 more=tuple(more), template=template, truncate=_truncation(body))


def _truncation(body: dict) -> int:
    """vLLM's ``truncate_prompt_tokens`` (-1: the model's context) and ``truncation_side`` as one number: keep
    the prompt's last N tokens (> 0), its first N (< 0: ``truncation_side: "right"``), or all of it (0)."""
    n = _int(body, "truncate_prompt_tokens", None)
    side = body.get("truncation_side") or "left"
    if side not in ("left", "right"):
        raise invalid(f'truncation_side must be "left" (keep the last tokens) or "right" (the first), not {side!r}')
    if n is None:
        return 0
    if n < -1 or n == 0:
        raise invalid(f"truncate_prompt_tokens must be a number of tokens >= 1 (or -1: the model's context), not {n}")
    n = MAX_TRUNCATION if n == -1 else n
    return n if side == "left" else -n


MAX_TRUNCATION = 2**62  # -1: as many as the context holds (the intake caps it)


REASONING_EFFORTS = ("none", "minimal", "low", "medium", "high", "xhigh", "max")


def template_args(body: dict, messages: Any) -> TemplateArgs | None:
    """A chat's ``add_generation_prompt``, ``continue_final_message`` and ``chat_template_kwargs`` (vLLM's
    fields, with ``documents`` and ``reasoning_effort`` as template variables; None: all defaults).
    ``continue_final_message`` needs the last message to be an assistant's, and leaves the turn unopened unless
    ``add_generation_prompt`` is also set, which is refused."""
    given = body.get("add_generation_prompt")
    cont = bool_field(body, "continue_final_message")
    generation = bool_field(body, "add_generation_prompt", not cont)
    kwargs = body.get("chat_template_kwargs") or {}
    if not isinstance(kwargs, dict):
        raise invalid('chat_template_kwargs must be an object of template variables, like {"enable_thinking": false}')
    documents = body.get("documents")
    if documents is not None:  # vLLM's: a RAG template's documents, as the template variable ``documents``
        if not isinstance(documents, list) or not all(isinstance(d, dict) for d in documents):
            raise invalid('documents must be a list of objects, like [{"title": ..., "text": ...}]')
        kwargs = {**kwargs, "documents": documents}
    effort = body.get("reasoning_effort")
    if effort is not None:  # OpenAI's, read as vLLM reads it: a template variable, and thinking on unless "none"
        if effort not in REASONING_EFFORTS:
            raise invalid(f"reasoning_effort must be one of {', '.join(REASONING_EFFORTS)}, not {effort!r}")
        kwargs = {"enable_thinking": effort != "none", **kwargs, "reasoning_effort": effort}
    for k in kwargs:
        if not k.isidentifier() or k in RESERVED_TEMPLATE_NAMES:
            raise invalid(f"chat_template_kwargs: {k!r} cannot be set: a variable name, and not one the router sets "
                          f"({', '.join(sorted(RESERVED_TEMPLATE_NAMES))})")
    if cont:
        if given is True:
            raise invalid("continue_final_message and add_generation_prompt cannot both be true: continue the last "
                          "message, or open a new turn")
        last = messages[-1] if isinstance(messages, list) and messages else None
        if not isinstance(last, dict) or last.get("role") != "assistant" or not str(last.get("content") or "").strip():
            raise invalid("continue_final_message needs the last message to be an assistant's, with the text to "
                          "continue")
    if generation and not cont and not kwargs:
        return None
    return TemplateArgs(generation, cont, tuple(sorted(kwargs.items())))


def _slo(body: dict) -> tuple[float, float]:
    """``kvmesh_slo``: an object of numbers of seconds, ``ttft_s`` and ``itl_s`` (either may be left out)."""
    slo = body.get("kvmesh_slo")
    if slo is None:
        return 0.0, 0.0
    if not isinstance(slo, dict) or set(slo) - {"ttft_s", "itl_s"}:
        raise invalid('kvmesh_slo must be an object like {"ttft_s": 6, "itl_s": 0.15} (seconds; either may be '
                      "left out)")
    return _num(slo, "ttft_s", 0.0, "kvmesh_slo."), _num(slo, "itl_s", 0.0, "kvmesh_slo.")


class Shape(NamedTuple):
    """What a body asks of its answer's shape: ``stream``, ``stream_options.include_usage``, vLLM's
    ``return_token_ids`` (the prompt's and the completion's token ids beside the text), and ``n``, how many
    choices (``choices.py``)."""

    stream: bool
    include_usage: bool
    token_ids: bool
    n: int = 1
    include_reasoning: bool = True  # a reasoning model's thinking in the answer (``reasoning.py``; vLLM's field)
    ids_as_tokens: bool = False  # vLLM's return_tokens_as_token_ids: logprobs name tokens "token_id:<id>"
    continuous_usage: bool = False  # stream_options.continuous_usage_stats: every chunk carries its choice's usage
    echo: bool = False  # a completion's text (and logprobs) begin with its prompt's; a chat's message with the last
    # message's content when that is the assistant's (vLLM's rule: continue_final_message's answer, whole)
    echo_only: bool = False  # echo with max_tokens 0: the prompt alone (the engine generates one token, not shown)
    prompt_logprobs: bool = False  # the body set prompt_logprobs: the answer carries vLLM's prompt_logprobs field


MAX_CHOICES = 16  # the most choices one request may ask for


def shape(body: dict) -> Shape:
    options = body.get("stream_options") or {}
    if not isinstance(options, dict):
        raise invalid("stream_options must be an object like {\"include_usage\": true}")
    n = _int(body, "n", 1)
    if not 1 <= n <= MAX_CHOICES:
        raise invalid(f"n must be an integer in [1, {MAX_CHOICES}] (the choices to generate), not {n}")
    reasoning = body.get("include_reasoning", True)
    if not isinstance(reasoning, bool):
        raise invalid("include_reasoning must be true or false")
    echo = bool_field(body, "echo")
    return Shape(bool_field(body, "stream"), bool_field(options, "include_usage"), bool_field(body, "return_token_ids"),
                 n, reasoning, bool_field(body, "return_tokens_as_token_ids"),
                 bool_field(options, "include_usage") and bool_field(options, "continuous_usage_stats"),
                 echo, echo and body.get("max_tokens") == 0, body.get("prompt_logprobs") is not None)


def sampling_from_body(body: dict, chat: bool = False) -> tuple[SamplingParams, str]:
    """The request's sampling parameters (``chat``: a chat body's, whose logprobs fields differ), and the field
    its structured-output constraint came from ("" = none); the error names the field that is wrong and how."""
    for name, off, why in UNSERVED:
        if body.get(name) not in off:
            raise invalid(f"{name} is not supported: {why}")
    stop = body.get("stop") or ()
    stop = (stop,) if isinstance(stop, str) else stop
    if not isinstance(stop, (list, tuple)) or not all(isinstance(s, str) for s in stop):
        raise invalid("stop must be a string or a list of strings")
    stop_ids = body.get("stop_token_ids") or []
    if not isinstance(stop_ids, list) or not all(type(t) is int for t in stop_ids):
        raise invalid("stop_token_ids must be a list of integers")
    max_tokens = _int(body, "max_completion_tokens", None)
    if max_tokens is None:
        max_tokens = _int(body, "max_tokens", DEFAULT_MAX_TOKENS)
    echo = bool_field(body, "echo") and not chat  # a chat's echo repeats its last message, scoring nothing
    if echo and max_tokens == 0:  # the prompt alone: one token is generated and not shown (vLLM's rule)
        max_tokens = 1
    top_k = _int(body, "top_k", 0) or 0
    if top_k < -1:
        raise invalid(f"top_k must be >= 0 (-1 or 0 turn it off), not {top_k}")
    field, structured = structured_from_body(body) or ("", None)
    logprobs = logprobs_from_body(body, chat)
    prompt_logprobs = prompt_logprobs_from_body(body, logprobs if echo else None)
    try:
        return SamplingParams(max_tokens=max_tokens, temperature=_num(body, "temperature", 1.0),
                              top_k=max(0, top_k), top_p=_num(body, "top_p", 1.0),
                              seed=_int(body, "seed", None), stop=tuple(stop), stop_token_ids=tuple(stop_ids),
                              ignore_eos=bool_field(body, "ignore_eos"), structured=structured,
                              logprobs=logprobs, prompt_logprobs=prompt_logprobs,
                              presence_penalty=_num(body, "presence_penalty", 0.0),
                              frequency_penalty=_num(body, "frequency_penalty", 0.0),
                              repetition_penalty=_num(body, "repetition_penalty", 1.0),
                              min_p=_num(body, "min_p", 0.0), min_tokens=_int(body, "min_tokens", 0),
                              logit_bias=_logit_bias(body.get("logit_bias")),
                              skip_special_tokens=bool_field(body, "skip_special_tokens", True)), field
    except ValueError as e:
        raise invalid(str(e)) from None


# what a body may say only as "off" (any value in the tuple), and why anything else is refused
UNSERVED: tuple[tuple[str, tuple[Any, ...], str], ...] = (
    ("best_of", (None, 1), "one sample is drawn per request (send the request again for another)"),
    ("suffix", (None, ""), "there is no insertion mode; send the text before the gap as the prompt"),
    ("functions", (None, []), "use tools (the legacy functions field is not read)"),
    ("function_call", (None, "none"), "use tool_choice (the legacy function_call field is not read)"),
    # vLLM's extensions the engines do not serve: refused rather than ignored, so no answer silently differs
    ("logprob_token_ids", (None, []), "logprobs reports the N most likely tokens (top_logprobs), not chosen ones"),
    ("allowed_token_ids", (None, []), "restrict the output with a structured-output choice, regex or grammar"),
    ("bad_words", (None, []), "use logit_bias against the words' tokens, or a structured-output constraint"),
    ("use_beam_search", (None, False), "sampling only (beam search is not served)"),
    ("length_penalty", (None, 1, 1.0), "it applies to beam search, which is not served"),
    ("include_stop_str_in_output", (None, False), "the engines cut a stop string off the output"),
    ("spaces_between_special_tokens", (None, True), ("special tokens kept in the text (skip_special_tokens: false) "
                                                    "are joined as the tokenizer decodes them")),
    ("chat_template", (None, ""), ("the router renders chats with the model's own template (a template is code: "
                                  "the operator's to choose); chat_template_kwargs sets its variables")),
    ("thinking_token_budget", (None,), "the reasoning is not capped apart from max_tokens"),
    ("priority", (None, 0), ("requests are scheduled by their latency targets: kvmesh_slo, or the tenant's SLO "
                            "class")),
    ("kv_transfer_params", (None, {}), "kvmesh moves the KV itself (the router picks where it goes)"),
    ("ec_transfer_params", (None, {}), "kvmesh serves text models"),
    ("vllm_xargs", (None, {}), "the engines take no engine-specific arguments from a request"),
    ("repetition_detection", (None, False, {}), "use repetition_penalty or frequency_penalty"),
    ("prompt_embeds", (None, "", []), "send the prompt as text or token ids"),
    ("mm_processor_kwargs", (None, {}), "kvmesh serves text models"),
    ("media_io_kwargs", (None, {}), "kvmesh serves text models"),
    ("return_token_offsets", (None, False), "logprobs' text_offset (completions) gives where each token starts"),
    ("return_prompt_text", (None, False), "the prompt is the request's; /tokenize renders a chat's"),
    ("routed_experts_prompt_start", (None,), "kvmesh serves dense models"),
    ("watermarking", (None, False, {}), "no watermark is applied"),
)


def _logit_bias(value: Any) -> tuple[tuple[int, float], ...]:
    """OpenAI's ``logit_bias``: ``{"<token id>": bias}`` (ids as strings, as JSON keys are), ids ascending."""
    if value is None:
        return ()
    if not isinstance(value, dict):
        raise invalid('logit_bias must be an object of token ids to biases, like {"50256": -100}')
    out = []
    for k, v in value.items():
        if not k.isdigit() or isinstance(v, bool) or not isinstance(v, (int, float)):
            raise invalid(f"logit_bias: {k!r}: {v!r} must be a token id (digits) and a number in [-100, 100]")
        out.append((int(k), float(v)))
    return tuple(sorted(out))


def logprobs_from_body(body: dict, chat: bool) -> int | None:
    """How many most likely tokens to report beside each generated one (None: no logprobs). Completions:
    ``logprobs: N``. Chat: ``logprobs: true``, with ``top_logprobs: N`` (default 0), which asks for nothing
    without it (vLLM's rule: ``top_logprobs`` > 0 without ``logprobs: true`` is refused)."""
    field = "top_logprobs" if chat else "logprobs"
    n = _int(body, field, None)
    if n is not None and not 0 <= n <= MAX_LOGPROBS:
        raise invalid(f"{field} must be an integer in [0, {MAX_LOGPROBS}], not {n}")
    if not chat:
        return n
    if not bool_field(body, "logprobs"):
        if n:
            raise invalid("top_logprobs needs \"logprobs\": true (it says how many alternatives to report beside "
                          "each token's logprob)")
        return None
    return n or 0


def prompt_logprobs_from_body(body: dict, echoed: int | None) -> int | None:
    """How many most likely tokens to report beside each prompt token's logprob (None: none): vLLM's
    ``prompt_logprobs: N``, or a completion's ``logprobs`` when it echoes its prompt (``echoed``). Returned whole:
    refused with ``stream``, as vLLM does (an echoed prompt's stream with its first chunk)."""
    n = _int(body, "prompt_logprobs", None)
    if n is None:
        return echoed
    if n == -1:
        raise invalid(f"prompt_logprobs -1 (the whole vocabulary at every prompt token) is not served: ask for at "
                      f"most {MAX_LOGPROBS}")
    if not 0 <= n <= MAX_LOGPROBS:
        raise invalid(f"prompt_logprobs must be an integer in [0, {MAX_LOGPROBS}], not {n}")
    if bool_field(body, "stream"):
        raise invalid("prompt_logprobs come with a whole answer, not a stream: send stream false (a completion "
                      "with echo and logprobs streams its prompt's logprobs first)")
    return n


def structured_from_body(body: dict) -> tuple[str, StructuredOutput] | None:
    """The one constraint the body asks for, and the field that asked; the error names the field."""
    found: list[tuple[str, StructuredOutput]] = []
    rf = body.get("response_format")
    if rf is not None:
        if not isinstance(rf, dict) or not isinstance(rf.get("type"), str):
            raise invalid('response_format must be an object like {"type": "json_object"}')
        kind = rf["type"]
        if kind == "json_object":
            found.append(("response_format", StructuredOutput("json_object")))
        elif kind == "json_schema":
            js = rf.get("json_schema")
            if not isinstance(js, dict):
                raise invalid('response_format.json_schema must be an object {"name": ..., "schema": {...}}')
            if "name" in js and not isinstance(js["name"], str):
                raise invalid("response_format.json_schema.name must be a string")
            if "strict" in js and js["strict"] is not None and not isinstance(js["strict"], bool):
                raise invalid("response_format.json_schema.strict must be true or false")
            if "schema" not in js:
                raise invalid("response_format.json_schema.schema is required (the JSON schema the output must "
                              "validate against)")
            found.append(("response_format.json_schema.schema",
                          _json_schema(js["schema"], "response_format.json_schema.schema")))
        elif kind != "text":
            raise invalid(f"response_format.type must be text, json_object or json_schema, not {kind!r}")
    vllm = [(f"guided_{k}", body.get(f"guided_{k}")) for k in ("json", "regex", "choice", "grammar")]
    so = body.get("structured_outputs")
    if so is not None:
        if not isinstance(so, dict):
            raise invalid('structured_outputs must be an object like {"regex": "..."}')
        vllm += [(f"structured_outputs.{k}", so.get(k)) for k in ("json", "regex", "choice", "grammar")]
        if so.get("json_object"):
            found.append(("structured_outputs.json_object", StructuredOutput("json_object")))
    for field, value in vllm:
        if value is None:
            continue
        kind = field.rsplit("_" if field.startswith("guided") else ".", 1)[1]
        found.append((field, _constraint(kind, value, field)))
    if len(found) > 1:
        raise invalid(f"give one structured-output constraint, not {len(found)}: {', '.join(f for f, _ in found)}")
    return found[0] if found else None


def _constraint(kind: str, value: Any, field: str) -> StructuredOutput:
    if kind == "json":
        return _json_schema(value, field)
    if kind == "choice":
        if not isinstance(value, list) or not value or not all(isinstance(c, str) for c in value):
            raise invalid(f"{field} must be a non-empty list of strings")
        return StructuredOutput.choice(value)
    if not isinstance(value, str) or not value:
        raise invalid(f"{field} must be a non-empty string")
    return StructuredOutput(kind, value)


def _json_schema(value: Any, field: str) -> StructuredOutput:
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except ValueError as e:
            raise invalid(f"{field} is not valid JSON: {e}") from None
    if not isinstance(value, (dict, bool)):
        raise invalid(f"{field} must be a JSON schema (an object)")
    return StructuredOutput("json_schema", json.dumps(value))


MAX_PROMPTS = 256  # the most prompts one completions request may batch


def _prompts(prompt: Any) -> list[dict[str, Any]]:
    """A completions ``prompt``: text, token ids, or a list of several of either (a batch: one answer each)."""
    if isinstance(prompt, list) and prompt:
        if (ids := _ids(prompt)) is not None:  # one list of ids is the common case
            return [{"token_ids": ids}]
        if len(prompt) > MAX_PROMPTS:
            raise invalid(f"prompt holds {len(prompt)} prompts; a request may batch at most {MAX_PROMPTS}")
        out = []
        for i, p in enumerate(prompt):
            try:
                out.append(_prompt(p))
            except RequestError:
                raise invalid(f"prompt[{i}] must be a string or a list of token ids (a batch holds prompts)") from None
        return out
    return [_prompt(prompt)]


def _prompt(prompt: Any) -> dict[str, Any]:
    """One completions prompt: text or token ids."""
    if isinstance(prompt, str):
        return {"text": prompt}
    if isinstance(prompt, list) and prompt and (ids := _ids(prompt)) is not None:
        return {"token_ids": ids}
    raise invalid("prompt must be a string, a list of token ids, or a list of several of either (a batch)")


def _ids(prompt: list) -> tuple[int, ...] | None:
    """``prompt`` as token ids when it is a list of integers (None: something else, such as a batch); its types
    read once, in C (a Python loop over 4k ids cost ~0.3 ms). JSON's true and false are not ids: the intake
    packs and range-checks integers alone."""
    types = set(map(type, prompt))
    if not types <= {int, bool}:
        return None
    if bool in types:
        raise invalid("prompt token ids must be integers, not true or false")
    return tuple(prompt)


# ---- one field of a type -------------------------------------------------------------------------------------

@overload
def _int(body: dict, name: str, default: int) -> int: ...
@overload
def _int(body: dict, name: str, default: None) -> int | None: ...
def _int(body: dict, name: str, default: int | None) -> int | None:
    v = body.get(name)
    if v is None:
        return default
    if not isinstance(v, int) or isinstance(v, bool):
        raise invalid(f"{name} must be an integer, not {_kind(v)}")
    return v


def _num(body: dict, name: str, default: float, prefix: str = "") -> float:
    v = body.get(name)
    if v is None:
        return default
    if not isinstance(v, (int, float)) or isinstance(v, bool):
        raise invalid(f"{prefix}{name} must be a number, not {_kind(v)}")
    try:
        return float(v)
    except OverflowError:
        raise invalid(f"{prefix}{name} is out of range") from None


def bool_field(body: dict, name: str, default: bool = False) -> bool:
    v = body.get(name)
    if v is not None and not isinstance(v, bool):
        raise invalid(f"{name} must be true or false, not {_kind(v)}")
    return default if v is None else v


def str_field(body: dict, name: str) -> str:
    v = body.get(name)
    if v is not None and not isinstance(v, str):
        raise invalid(f"{name} must be a string, not {_kind(v)}")
    return v or ""



def _kind(v: Any) -> str:
    return {dict: "an object", list: "a list", str: "a string", bool: "a boolean", int: "an integer",
            float: "a number"}.get(type(v), type(v).__name__)


def json_bytes(obj: Any) -> bytes:
    """``obj`` written as JSON: by orjson (a response's 4k prompt ids in ~10 us against json's ~100), or by json
    where orjson refuses (an integer past 64 bits, a type it does not know). orjson writes no spaces, and NaN as
    null where json writes NaN, which is no JSON."""
    try:
        return orjson.dumps(obj, option=orjson.OPT_NON_STR_KEYS)
    except TypeError:
        return json.dumps(obj).encode()


def _fast_json(text: str) -> dict | None:
    """``text`` as orjson reads it, when that is a JSON object as json would read it; None otherwise: orjson
    refused it (no JSON, NaN, nesting past 1,024), it is no object, or a field's integer past 64 bits became a
    float."""
    try:
        body = orjson.loads(text)
    except orjson.JSONDecodeError:
        return None
    if not isinstance(body, dict) or any(type(v) is float and abs(v) >= 2.0 ** 64 for v in body.values()):
        return None
    return body


def _reject_constant(name: str) -> Any:
    raise ValueError(f"{name} is not a JSON number")


SURROGATE_ESCAPE = re.compile(r"\\u[dD][89a-fA-F]")  # a JSON escape of U+D800-U+DFFF, paired or not


def _check_strings(body: Any) -> None:
    """Every string in the body must be encodable: JSON escapes can smuggle in lone UTF-16 surrogates."""
    stack = [body]
    while stack:
        v = stack.pop()
        if isinstance(v, str):
            try:
                v.encode()
            except UnicodeEncodeError:
                raise invalid("the request body has a lone UTF-16 surrogate escape (e.g. \\ud800): strings must "
                              "be valid Unicode") from None
        elif isinstance(v, dict):
            stack += v.keys()
            stack += v.values()
        elif isinstance(v, list):
            stack += v
