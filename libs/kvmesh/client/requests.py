"""Building protocol requests from keyword arguments, with errors that say what to change."""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any, TypedDict, Unpack

from kvmesh.contracts.sampling import SamplingParams, logits_to_proto
from kvmesh.contracts.sessions import check_pause, check_retention_hint
from kvmesh.proto.v1 import api_pb2, common_pb2

Message = Mapping[str, Any]         # {"role": "user", "content": "...", "cache_control": {"ttl": 300}}


class SamplingOptions(TypedDict, total=False):
    """Keyword arguments of ``sampling_params`` (defaults there)."""

    max_tokens: int
    temperature: float
    top_k: int
    top_p: float
    seed: int | None
    stop: Sequence[str]
    stop_token_ids: Sequence[int]
    ignore_eos: bool
    logprobs: int | None  # each generated token's logprob and this many most likely tokens (0-20); None: off
    # each prompt token's logprob after the first, its rank and this many most likely there (0-20); None: off.
    # The whole prompt is computed (no cached prefix is reused for it)
    prompt_logprobs: int | None
    presence_penalty: float    # [-2, 2]: subtracted from a token's logit once it was generated
    frequency_penalty: float   # [-2, 2]: ... times the number of times it was generated
    repetition_penalty: float  # (0, 10], 1 = off: a prompt or output token's logit / r if > 0, else * r
    min_p: float               # [0, 1]: drop tokens less likely than min_p x the most likely one
    min_tokens: int            # no EOS, stop token or stop string before this many tokens
    logit_bias: Mapping[int, float] | None  # token id -> bias in [-100, 100] added to its logit
    skip_special_tokens: bool  # False: the text keeps special tokens (the one that stops the output never shows)
    # structured output, at most one (the router refuses a bad one with INVALID_ARGUMENT naming it)
    response_format: Mapping[str, Any] | None  # OpenAI's: {"type": "json_object"} or {"type": "json_schema", ...}
    json_schema: Mapping[str, Any] | str | None
    regex: str | None
    choice: Sequence[str] | None
    grammar: str | None


class RequestOptions(SamplingOptions, total=False):
    """Keyword arguments of ``generate``, ``complete`` and ``chat`` (defaults: ``sampling_params``, "" for
    the strings, 0 = no target for the latency targets: ``ttft_s`` to the first token, ``itl_s`` the p99 of the
    gaps between tokens, in seconds)."""

    cache_salt: str
    request_id: str
    model: str
    session_id: str           # the conversation / agent task it belongs to (the caches keep its KV)
    session_end: bool         # its last request: what the session holds may go first
    parent_session_id: str    # the session it was forked from (a sub-agent: it starts where its parent's KV is)
    session_pause_s: float    # a pause of about this long follows (a tool call): its KV is back before then
    session_retention: str    # through that pause: "retain" (default), "demote" (may move down the tiers), "release"
    cache_control: Mapping[str, Any] | None  # {"ttl": seconds, "priority": 0-100}: keep the prompt cached
    ttft_s: float
    itl_s: float


class ChatOptions(RequestOptions, total=False):
    """``chat``'s keyword arguments: ``RequestOptions`` and tool calling, as OpenAI's chat API has it."""

    tools: Sequence[Mapping[str, Any]]  # [{"type": "function", "function": {"name", "description", "parameters"}}]
    tool_choice: str | Mapping[str, Any]  # "auto" (default), "none", "required", a function's name or OpenAI's dict
    parallel_tool_calls: bool | None      # None: the server's default (more than one call allowed)
    chat_template_kwargs: Mapping[str, Any] | None  # more template variables, e.g. {"enable_thinking": False}
    continue_final_message: bool          # the prompt ends inside the last (assistant's) message: the model goes on
    add_generation_prompt: bool | None    # open the assistant's turn after the messages (None: yes unless continuing)


def cache_control(value: Mapping[str, Any] | None, field: str = "cache_control") -> common_pb2.CacheControl | None:
    """``{"ttl": seconds, "priority": 0-100}`` (both optional) as the protocol's ``CacheControl``."""
    if value is None:
        return None
    if not isinstance(value, Mapping):
        raise ValueError(  # noqa: TRY004 - the SDK answers every bad argument with ValueError
            f'{field} must be a mapping like {{"ttl": 300, "priority": 50}}, not {value!r}')
    ttl, priority = value.get("ttl", 0), value.get("priority")
    if isinstance(ttl, bool) or not isinstance(ttl, (int, float)) or ttl < 0:
        raise ValueError(f"{field}.ttl must be a number of seconds >= 0 (0 = the default), not {ttl!r}")
    if priority is not None and (isinstance(priority, bool) or not isinstance(priority, int) or priority < 0):
        raise ValueError(f"{field}.priority must be an integer in [0, 100], not {priority!r}")
    return common_pb2.CacheControl(ttl_s=float(ttl), priority=priority)


def _session(req: api_pb2.GenerateRequest | api_pb2.ChatRequest, session_id: str, session_end: bool,
             control: Mapping[str, Any] | None, hints: AgentHints) -> None:
    for name, value in (("session_end", session_end), *hints.items()):
        if value and not session_id:
            raise ValueError(f"{name} needs a session_id (the session it is about)")
    pause = check_pause(hints.get("session_pause_s", 0.0))  # the router's own checks, before the call
    retention = hints.get("session_retention", "")
    check_retention_hint(retention)
    req.session_id, req.session_end = session_id, session_end
    req.parent_session_id, req.session_pause_s = hints.get("parent_session_id", ""), pause
    req.session_retention = retention
    if (cc := cache_control(control)) is not None:
        req.cache_control.CopyFrom(cc)


class AgentHints(TypedDict, total=False):
    """The agent hints of a request (README, "Sessions"), beside its ``session_id``."""

    parent_session_id: str
    session_pause_s: float
    session_retention: str


def slo(ttft_s: float = 0.0, itl_s: float = 0.0) -> common_pb2.SLO:
    """The latency targets (0 = none: the router's and the engine's defaults apply)."""
    for name, value in (("ttft_s", ttft_s), ("itl_s", itl_s)):
        if not 0 <= value <= 3600:
            raise ValueError(f"{name} must be a number of seconds in [0, 3600] (0 = no target), got {value}")
    return common_pb2.SLO(ttft_s=ttft_s, itl_s=itl_s)


def sampling_params(max_tokens: int = 64, temperature: float = 0.0, top_k: int = 0, top_p: float = 1.0,
                    seed: int | None = None, stop: Sequence[str] = (), stop_token_ids: Sequence[int] = (),
                    ignore_eos: bool = False, logprobs: int | None = None, prompt_logprobs: int | None = None,
                    response_format: Mapping[str, Any] | None = None,
                    json_schema: Mapping[str, Any] | str | None = None, regex: str | None = None,
                    choice: Sequence[str] | None = None, grammar: str | None = None, presence_penalty: float = 0.0,
                    frequency_penalty: float = 0.0, repetition_penalty: float = 1.0, min_p: float = 0.0,
                    min_tokens: int = 0, logit_bias: Mapping[int, float] | None = None,
                    skip_special_tokens: bool = True) -> common_pb2.SamplingParams:
    if max_tokens < 1:
        raise ValueError(f"max_tokens must be at least 1, got {max_tokens}")
    if temperature < 0:
        raise ValueError(f"temperature must be >= 0 (0 = greedy), got {temperature}")
    if top_k < 0:
        raise ValueError(f"top_k must be >= 0 (0 = off), got {top_k}")
    if not 0 < top_p <= 1:
        raise ValueError(f"top_p must be in (0, 1], got {top_p}")
    if seed is not None and seed < 0:
        raise ValueError(f"seed must be >= 0, got {seed}")
    if logprobs is not None and not 0 <= logprobs <= 20:
        raise ValueError(f"logprobs must be in [0, 20] (the most likely tokens reported beside each one), got "
                         f"{logprobs}")
    if prompt_logprobs is not None and not 0 <= prompt_logprobs <= 20:
        raise ValueError(f"prompt_logprobs must be in [0, 20] (the most likely tokens reported beside each prompt "
                         f"token), got {prompt_logprobs}")
    if isinstance(stop, str):
        raise ValueError(  # noqa: TRY004 - the SDK answers every bad argument with ValueError
            "stop must be a sequence of strings, e.g. stop=[\"\\n\"], not a single string")
    top_p = max(top_p, 1.401298464324817e-45)  # a float32 on the wire: a tiny top_p must not become 0 ("off")
    msg = common_pb2.SamplingParams(max_tokens=max_tokens, temperature=temperature, top_k=top_k, top_p=top_p,
                                    seed=seed, stop=list(stop), stop_token_ids=list(stop_token_ids),
                                    ignore_eos=ignore_eos, logprobs=logprobs, prompt_logprobs=prompt_logprobs,
                                    keep_special_tokens=not skip_special_tokens)
    structured(msg, response_format, json_schema, regex, choice, grammar)
    adjust = SamplingParams(max_tokens=max_tokens, presence_penalty=presence_penalty,  # its checks, its messages
                            frequency_penalty=frequency_penalty, repetition_penalty=repetition_penalty,
                            min_p=min_p, min_tokens=min_tokens, logit_bias=tuple(sorted((logit_bias or {}).items())))
    logits_to_proto(adjust, msg)
    return msg


def structured(msg: common_pb2.SamplingParams, response_format: Mapping[str, Any] | None,
               json_schema: Mapping[str, Any] | str | None, regex: str | None, choice: Sequence[str] | None,
               grammar: str | None) -> None:
    """Set ``msg``'s structured-output oneof from at most one of the SDK's arguments."""
    given = [n for n, v in (("response_format", response_format), ("json_schema", json_schema), ("regex", regex),
                            ("choice", choice), ("grammar", grammar)) if v is not None]
    if len(given) > 1:
        raise ValueError(f"pass at most one structured-output argument, not {', '.join(given)}")
    if response_format is not None:
        kind = response_format.get("type")
        if kind == "json_object":
            msg.json_object = True
        elif kind == "json_schema":
            schema = (response_format.get("json_schema") or {}).get("schema")
            if schema is None:
                raise ValueError('response_format {"type": "json_schema"} needs json_schema.schema')
            json_schema = schema
        elif kind != "text":
            raise ValueError(f"response_format type must be text, json_object or json_schema, not {kind!r}")
    if json_schema is not None:
        msg.json_schema = json_schema if isinstance(json_schema, str) else json.dumps(json_schema)
    if regex is not None:
        msg.regex = regex
    if choice is not None:
        if isinstance(choice, str) or not choice:
            raise ValueError("choice must be a non-empty sequence of strings, e.g. choice=[\"yes\", \"no\"]")
        msg.choice.options.extend(choice)
    if grammar is not None:
        msg.grammar = grammar


def chat_messages(messages: Sequence[Message]) -> list[common_pb2.ChatMessage]:
    if not messages:
        raise ValueError("messages must hold at least one message")
    out = []
    for i, m in enumerate(messages):
        role, content, calls = m.get("role"), m.get("content"), m.get("tool_calls") or ()
        if content is None and calls:
            content = ""
        if not isinstance(role, str) or not isinstance(content, str):
            raise ValueError(  # noqa: TRY004 - the SDK answers every bad argument with ValueError
                f"messages[{i}] must have string 'role' and 'content', got {dict(m)!r}")
        thought = m.get("reasoning") or m.get("reasoning_content") or ""
        if not isinstance(thought, str):
            raise ValueError(f"messages[{i}].reasoning must be a string")  # noqa: TRY004 - ValueError, as above
        msg = common_pb2.ChatMessage(role=role, content=content, tool_call_id=str(m.get("tool_call_id") or ""),
                                     reasoning=thought,
                                     tool_calls=[_tool_call(c, f"messages[{i}].tool_calls[{j}]")
                                                 for j, c in enumerate(calls)])
        if (cc := cache_control(m.get("cache_control"), f"messages[{i}].cache_control")) is not None:
            msg.cache_control.CopyFrom(cc)
        out.append(msg)
    return out


def generate_request(prompt: str | Sequence[int] | None = None, messages: Sequence[Message] | None = None, *,
                     cache_salt: str = "", request_id: str = "", model: str = "", session_id: str = "",
                     session_end: bool = False, cache_control: Mapping[str, Any] | None = None, ttft_s: float = 0.0,
                     itl_s: float = 0.0, parent_session_id: str = "", session_pause_s: float = 0.0,
                     session_retention: str = "", tools: Sequence[Mapping[str, Any]] = (),
                     tool_choice: str | Mapping[str, Any] = "", parallel_tool_calls: bool | None = None,
                     chat_template_kwargs: Mapping[str, Any] | None = None, continue_final_message: bool = False,
                     add_generation_prompt: bool | None = None,
                     **sampling: Unpack[SamplingOptions]) -> api_pb2.GenerateRequest:
    """A ``GenerateRequest`` for exactly one of ``prompt`` (text or token ids) and ``messages`` (chat; then
    ``tools`` too)."""
    if (prompt is None) == (messages is None):
        raise ValueError("pass exactly one of prompt (text or token ids) and messages")
    if messages is None and (tools or tool_choice or chat_template_kwargs or continue_final_message
                             or add_generation_prompt is not None):
        raise ValueError("tools and the chat template's options need messages (a chat), not a prompt")
    req = api_pb2.GenerateRequest(request_id=request_id, model=model, cache_salt=cache_salt,
                                  sampling=sampling_params(**sampling), slo=slo(ttft_s, itl_s),
                                  tools=[_tool(t, f"tools[{i}]") for i, t in enumerate(tools)],
                                  tool_choice=_tool_choice(tool_choice), parallel_tool_calls=parallel_tool_calls,
                                  chat_template_kwargs=_kwargs(chat_template_kwargs),
                                  continue_final_message=continue_final_message,
                                  add_generation_prompt=add_generation_prompt)
    _session(req, session_id, session_end, cache_control, AgentHints(
        parent_session_id=parent_session_id, session_pause_s=session_pause_s, session_retention=session_retention))
    if messages is not None:
        req.messages.messages.extend(chat_messages(messages))
    elif isinstance(prompt, str):
        req.text = prompt
    else:
        ids = list(prompt)  # type: ignore[arg-type]
        if not all(isinstance(t, int) and t >= 0 for t in ids):
            raise ValueError("prompt token ids must be non-negative ints")
        req.token_ids.SetInParent()         # an empty list is still a (token-id) prompt
        req.token_ids.ids.extend(ids)
    return req


def chat_request(messages: Sequence[Message], *, cache_salt: str = "", request_id: str = "", model: str = "",
                 session_id: str = "", session_end: bool = False, cache_control: Mapping[str, Any] | None = None,
                 ttft_s: float = 0.0, itl_s: float = 0.0, parent_session_id: str = "", session_pause_s: float = 0.0,
                 session_retention: str = "", tools: Sequence[Mapping[str, Any]] = (),
                 tool_choice: str | Mapping[str, Any] = "", parallel_tool_calls: bool | None = None,
                 chat_template_kwargs: Mapping[str, Any] | None = None, continue_final_message: bool = False,
                 add_generation_prompt: bool | None = None,
                 **sampling: Unpack[SamplingOptions]) -> api_pb2.ChatRequest:
    req = api_pb2.ChatRequest(request_id=request_id, model=model, messages=chat_messages(messages),
                              cache_salt=cache_salt, sampling=sampling_params(**sampling), slo=slo(ttft_s, itl_s),
                              tools=[_tool(t, f"tools[{i}]") for i, t in enumerate(tools)],
                              tool_choice=_tool_choice(tool_choice), parallel_tool_calls=parallel_tool_calls,
                              chat_template_kwargs=_kwargs(chat_template_kwargs),
                              continue_final_message=continue_final_message,
                              add_generation_prompt=add_generation_prompt)
    _session(req, session_id, session_end, cache_control, AgentHints(
        parent_session_id=parent_session_id, session_pause_s=session_pause_s, session_retention=session_retention))
    return req


def _kwargs(kwargs: Mapping[str, Any] | None) -> str:
    """``chat_template_kwargs`` as the protocol carries it: JSON text ("" = none)."""
    if not kwargs:
        return ""
    if not isinstance(kwargs, Mapping):
        raise ValueError(f"chat_template_kwargs must be a mapping, not {kwargs!r}")  # noqa: TRY004 - as above
    return json.dumps(dict(kwargs))


def _tool(t: Mapping[str, Any], where: str) -> api_pb2.Tool:
    """An OpenAI tool (``{"type": "function", "function": {...}}``, or the function's dict alone) as the protocol's."""
    fn = t.get("function", t) if isinstance(t, Mapping) else None
    if not isinstance(fn, Mapping) or not isinstance(fn.get("name"), str):
        raise ValueError(  # noqa: TRY004 - the SDK answers every bad argument with ValueError
            f'{where} must be {{"type": "function", "function": {{"name": ..., "parameters": {{...}}}}}}')
    parameters = fn.get("parameters")
    return api_pb2.Tool(name=fn["name"], description=str(fn.get("description") or ""),
                        parameters=json.dumps(parameters) if parameters is not None else "")


def _tool_choice(choice: str | Mapping[str, Any]) -> str:
    """``tool_choice`` as the protocol has it: a mode, or the name of the one function to call."""
    if isinstance(choice, Mapping):
        fn = choice.get("function")
        if not isinstance(fn, Mapping) or not isinstance(fn.get("name"), str):
            raise ValueError(  # noqa: TRY004 - the SDK answers every bad argument with ValueError
                'tool_choice must be "auto", "none", "required", a function\'s name or {"type": "function", '
                '"function": {"name": ...}}')
        return str(fn["name"])
    return choice


def _tool_call(c: Mapping[str, Any], where: str) -> common_pb2.ToolCall:
    """An assistant message's call (OpenAI's ``{"id", "type", "function": {"name", "arguments"}}``)."""
    fn = c.get("function") if isinstance(c, Mapping) else None
    if not isinstance(fn, Mapping) or not isinstance(fn.get("name"), str):
        raise ValueError(  # noqa: TRY004 - the SDK answers every bad argument with ValueError
            f"{where} must be {{id, type: function, function: {{name, arguments}}}}")
    args = fn.get("arguments", "{}")
    return common_pb2.ToolCall(id=str(c.get("id") or ""), name=fn["name"],
                               arguments=args if isinstance(args, str) else json.dumps(args))
