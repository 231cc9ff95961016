"""The router's intake: one pipeline from a request as an API received it to a request admitted for routing.

Both APIs (OpenAI HTTP; gRPC ``Generate`` and ``Chat``) translate their wire format into a ``Call`` (who is
calling, the id they gave) and a ``Draft`` (the request's fields), and enter ``Intake.admit``, which yields an
``Admitted`` request or raises ``RequestError``. The steps, in order; the first that fails answers:

1. the caller's key → tenant (``access.Tenants``); what the wire itself could not accept (a message that does
   not parse) is answered only after this (a gRPC message over ``max_body_bytes`` never gets here: gRPC refuses
   it as it arrives, before the key is looked at);
2. the request id the caller gave: printable ASCII, at most 128 characters;
3. the in-flight caps (``access.Admission``): over one, refused at once, never queued;
4. the fields (``Draft``: an HTTP body is read and parsed here), inside the ``router.tokenize`` span;
5. the structured-output constraint (``structured.check_structured``);
6. the prompt → token ids (the model's chat template, with the tools a chat offers, and tokenizer);
7. the model: the base model or a LoRA adapter some instance serves;
8. what the engines can serve: context length, vocabulary, seed, stop ids and strings; a resumed stream's
   tokens (``resume_token_ids``: ids, fewer than ``max_tokens``);
9. the session (its id namespaced by the tenant, the end flag, the agent hints: parent session, announced pause,
   retention through it; ``session_fields``) and the retention hints (``cache_control``, the request's and each
   message's, as token ranges of the prompt, within the tenant's retention caps);
10. the cache salt (the tenant's namespace), the routing policy and the PD override;
11. the latency targets (``SLO``: the router admits by the TTFT target, the engine schedules by both): the
    request's own, else its tenant's SLO class's (``access.TenantTerms``).

The admitted request holds an admission slot until the ``async with`` block ends.
"""

from __future__ import annotations

import asyncio
import functools
import json
from array import array
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from contextlib import asynccontextmanager
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any, TypeVar

import numpy as np
from jinja2 import TemplateError
from kvmesh.contracts.engine import RetentionRange, SessionHint
from kvmesh.contracts.keys import int32s
from kvmesh.contracts.sampling import SamplingParams
from kvmesh.contracts.sessions import check_pause, check_retention, check_retention_hint, check_session_id, session_key
from kvmesh.contracts.slo import NO_SLO, SLO
from kvmesh.model_source.tokenizer import RELEASE_GIL_CHARS
from kvmesh.routing.cost import DISAGGREGATE_MODES

from services.router.access import Admission, Tenants, TenantTerms, cache_salt, dispatch_id
from services.router.errors import ErrorKind, RequestError, invalid
from services.router.ids import new_request_id
from services.router.structured import check_structured
from services.router.telemetry import RequestTrace
from services.router.tools import Choice, Tools, for_template, message_calls

if TYPE_CHECKING:
    from services.router.core import Router

ROLES = ("system", "user", "assistant", "tool")
P = TypeVar("P", list[int], array)  # a prompt's ids as a list, or packed
T = TypeVar("T")
MAX_REQUEST_ID = 128


@dataclass(frozen=True)
class Call:
    """Who calls and how, as the wire carried it. ``headers``: HTTP headers or gRPC metadata (keys, trace
    context). ``request_id``: the id the caller gave ("" = none). ``refused``: what the wire could not accept
    (answered once the caller is authenticated)."""

    api: str
    headers: Mapping[str, str]
    request_id: str = ""
    refused: RequestError | None = None


@dataclass(frozen=True)
class Draft:
    """A request's fields as its wire gave them, each of its type (the wire checked that), none of their values
    checked. One of ``text``, ``token_ids`` and ``messages`` is the prompt; ``messages`` is as given (a list of
    ``{role, content}``, checked here). ``structured_field``: the field the structured-output constraint in
    ``sampling`` came from, which its errors name."""

    sampling: SamplingParams
    text: str | None = None
    token_ids: tuple[int, ...] | None = None
    messages: Any = None
    model: str = ""
    cache_salt: str = ""
    structured_field: str = ""
    policy: str | None = None
    disaggregate: str | None = None
    resume: tuple[int, ...] = ()
    session_id: str = ""
    session_end: bool = False
    parent_session_id: str = ""   # the session this one was forked from (a sub-agent)
    session_pause_s: float = 0.0  # the pause announced after this request (0 = none)
    session_retention: str = ""   # what the caches do with the session's KV through that pause ("" = default)
    cache_control: CacheControl | None = None  # the whole prompt's retention hint
    slo: tuple[float, float] = (0.0, 0.0)  # TTFT and ITL targets in seconds as given (0 = none)
    tools: Tools | None = None  # the functions a chat offers the model (``tools``), and its tool_choice
    choices: int = 1  # answers asked for (``n``): as many requests at the engines
    template: TemplateArgs | None = None  # how a chat is rendered, beyond the messages (None: the defaults)
    truncate: int = 0  # keep the prompt's last N tokens (> 0), its first -N (< 0), or all of it (0)
    more: tuple[dict[str, Any], ...] = ()  # a completions batch's further prompts ({"text"} / {"token_ids"})

    def batch(self) -> list[Draft]:
        """One draft per prompt of a batch (this one first): each a request of its own, the fields alike."""
        return [self, *(replace(self, **({"text": None, "token_ids": None} | p), more=()) for p in self.more)]


@dataclass(frozen=True)
class TemplateArgs:
    """A chat's rendering as the request asks for it (vLLM's fields): ``add_generation_prompt`` (open the
    assistant's turn after the messages), ``continue_final_message`` (end the prompt inside the last message,
    an assistant's, for the model to go on with it) and ``chat_template_kwargs`` (more variables for the
    template, e.g. ``{"enable_thinking": false}``)."""

    generation: bool = True
    continue_final: bool = False
    kwargs: tuple[tuple[str, Any], ...] = ()


@dataclass(frozen=True)
class CacheControl:
    """A retention hint as the wire gave it (None: the default), and the field it came from, which errors
    name (``cache_control``, ``messages[2].cache_control``)."""

    ttl_s: float | None = None
    priority: int | None = None
    field: str = "cache_control"


SLO_HEADERS = ("x-kvmesh-slo-ttft-s", "x-kvmesh-slo-itl-s")  # HTTP headers / gRPC metadata keys

# The agent hints' headers / gRPC metadata keys, each the request field it stands for: kvmesh's own spelling,
# then Dynamo's (its frontend's canonical session headers), so a harness written for either works unchanged.
SESSION_HEADERS = {
    "x-session-id": "session_id", "x-dynamo-session-id": "session_id",
    "x-parent-session-id": "parent_session_id", "x-dynamo-parent-session-id": "parent_session_id",
    "x-session-end": "session_end", "x-dynamo-session-final": "session_end",
    "x-session-pause-s": "session_pause_s", "x-session-retention": "session_retention",
}


def session_fields(given: Mapping[str, Any], headers: Mapping[str, str]) -> dict[str, Any]:
    """The ``Draft``'s session fields from a request's own (``given``: field -> value as the wire typed it, a
    falsy value = not given) and its headers (``SESSION_HEADERS``). A header and a field that say different
    things are refused (send one); two headers that stand for one field likewise."""
    out: dict[str, Any] = {"session_id": "", "parent_session_id": "", "session_end": False,
                           "session_pause_s": 0.0, "session_retention": ""}
    from_header: dict[str, tuple[str, str]] = {}
    for header, name in SESSION_HEADERS.items():
        sent = headers.get(header, "")
        if not sent:
            continue
        seen = from_header.get(name)
        if seen is not None and seen[1] != sent:
            raise invalid(f"the {seen[0]} and {header} headers differ ({seen[1]!r}, {sent!r}): send one")
        from_header[name] = (header, sent)
    for name, default in list(out.items()):
        field, (header, text) = given.get(name), from_header.get(name, ("", ""))
        value: Any = _header_value(name, header, text) if header else None
        if field and value is not None and field != value:
            raise invalid(f"the {header} header ({text!r}) and {name} ({field!r}) differ: send one")
        out[name] = field or value or default
    try:
        check_pause(out["session_pause_s"])
        check_retention_hint(out["session_retention"])
        if out["parent_session_id"]:
            check_session_id(out["parent_session_id"], "parent_session_id")
    except ValueError as e:
        raise invalid(str(e)) from None
    return out


def _header_value(name: str, header: str, text: str) -> Any:
    if name == "session_end":
        if text.lower() not in ("true", "false", "1", "0"):
            raise invalid(f"the {header} header must be true or false, not {text[:40]!r}")
        return text.lower() in ("true", "1")
    if name == "session_pause_s":
        try:
            return float(text)
        except ValueError:
            raise invalid(f"the {header} header must be a number of seconds, not {text[:40]!r}") from None
    return text


def slo_from_headers(headers: Mapping[str, str], given: tuple[float, float]) -> tuple[float, float]:
    """The latency targets: ``SLO_HEADERS`` where present (a number of seconds each), else ``given`` (the body's
    or the message's)."""
    out = list(given)
    for i, key in enumerate(SLO_HEADERS):
        if (value := headers.get(key)) is not None:
            try:
                out[i] = float(value)
            except ValueError:
                raise invalid(f"{key} must be a number of seconds, not {value!r}") from None
    return out[0], out[1]


@dataclass(frozen=True)
class Admitted:
    """A request the router accepted: everything routing and dispatch need, nothing left to check.
    ``cache_salt``: what enters its block keys (the tenant's namespace, within it the request's own salt).
    ``model``: the name its answers carry (the LoRA adapter's, else the base model's id); ``lora``: the adapter
    ("" = the base model). ``policy`` / ``disaggregate``: the request's own routing choices (None = the
    configured ones). ``resume``: the tokens a cut stream of this request already delivered (its client resumes
    it here): the router streams what follows them. ``slo``: its latency targets (none set: the router's
    ``slo_ttft_s`` admits it, the engine's defaults schedule it). ``dispatch_id``: the id the instances know it
    by (``access.dispatch_id``: unique per request, whatever id the client chose; "" = ``request_id``).
    ``packed``: the prompt as int32 (``kvmesh.contracts.keys.int32s``), which the block keys and the wire take,
    where the intake has it so: token ids as checking them packed them, a text or a chat as the tokenizer gave it
    (a prompt that grew, in a migration or a resume, is packed where it is routed)."""

    request_id: str
    prompt: tuple[int, ...]
    sampling: SamplingParams
    tenant: str
    cache_salt: str
    model: str
    lora: str = ""
    policy: str | None = None
    disaggregate: str | None = None
    resume: tuple[int, ...] = ()
    session: SessionHint | None = None
    retention: tuple[RetentionRange, ...] = ()
    slo: SLO = NO_SLO
    dispatch_id: str = ""
    packed: array | None = None  # ``prompt`` as int32 where the intake had it so; None: not yet




def valid_request_id(rid: str) -> bool:
    return 0 < len(rid) <= MAX_REQUEST_ID and rid.isascii() and rid.isprintable()


class Intake:
    """The pipeline; one per router, shared by both APIs (so are its caps)."""

    def __init__(self, router: Router, tenants: Tenants | None = None, admission: Admission | None = None,
                 terms: TenantTerms | None = None) -> None:
        self.router = router
        self.tenants = tenants or Tenants.from_config(router.cfg)
        self.admission = admission or Admission.from_config(router.cfg)
        self.terms = terms or TenantTerms.from_config(router.cfg)

    def trace(self, call: Call) -> RequestTrace:
        """The request's root span and TTFT clock, under the id the caller gave when it is valid, else a new
        one (every answer carries it, an error's too)."""
        given = call.request_id if call.refused is None and valid_request_id(call.request_id) else ""
        return RequestTrace(self.router.metrics, given or new_request_id(), call.api, call.headers)

    @asynccontextmanager
    async def admit(self, call: Call, rt: RequestTrace,
                    read: Callable[[], Awaitable[Draft]]) -> AsyncIterator[Admitted]:
        """Steps 1-9 of the module's docstring; ``read``: the wire's fields, read once the caller holds a slot."""
        tenant = self.tenants.authenticate(call.headers)
        if call.refused is not None:
            raise call.refused
        if call.request_id and not valid_request_id(call.request_id):
            raise invalid(f"request_id must be printable ASCII of at most {MAX_REQUEST_ID} characters")
        leave = self.admission.enter(tenant)
        more: Callable[[], None] | None = None
        try:
            with rt.segment("router.tokenize") as span:
                draft = await read()
                if draft.choices > 1:  # each choice is a request at an engine: the caps count them all
                    more = self.admission.enter(tenant, draft.choices - 1)
                check_constraint(draft)
                session = self.session(draft, tenant)
                self.router.sessions.arrived(session)  # a paused session's instance warms its KV meanwhile
                whole, packed = await self._prompt(draft)
                prompt = truncated(whole, draft.truncate, self.router.max_model_len)
                if packed is not None:
                    packed = truncated(packed, draft.truncate, self.router.max_model_len)
                dropped = len(whole) - len(prompt) if draft.truncate > 0 else 0  # cut off the front
                lora = self.model(draft.model)
                sampling = self.sampling(draft)
                self.check(prompt, sampling)
                self.check_resume(draft.resume, sampling)
                retention = await self.retention(draft, len(prompt), dropped)
                span.set_attribute("kvmesh.tokens.prompt", len(prompt))
                if session is not None:
                    span.set_attribute("kvmesh.session", session.key)
            request = Admitted(rt.request_id, tuple(prompt), sampling, tenant,
                               cache_salt(tenant, draft.cache_salt), lora or self.router.model_id, lora,
                               self.policy(draft.policy), self.disaggregate(draft.disaggregate), draft.resume,
                               session, retention, self.terms.slo(tenant, self.slo(draft.slo)),
                               dispatch_id(tenant, rt.request_id), packed)
            rt.describe(request.model, tenant or draft.cache_salt, len(prompt))
            rt.slo = request.slo
            yield request
        finally:
            leave()
            if more is not None:
                more()

    # ---- the steps ---------------------------------------------------------------------------------------
    async def prompt_ids(self, draft: Draft) -> list[int]:
        """The prompt's token ids; the error names the field to fix. A long text (or chat) is tokenized on the
        router's tokenize threads: the event loop keeps serving the other requests meanwhile, and several long
        prompts are tokenized on several cores (``Tokenizer`` releases the GIL for them)."""
        return (await self._prompt(draft))[0]

    async def _prompt(self, draft: Draft) -> tuple[list[int], array | None]:
        """``prompt_ids``, and the same packed as int32 (as checking token ids, or the tokenizer, made it)."""
        tok = self.router.tokenizer
        if draft.messages is not None:
            return await self._rendered_packed(chat_messages(draft.messages), draft.tools, draft.template)
        if draft.token_ids is not None:
            return list(draft.token_ids), self._packed(draft.token_ids)
        if draft.text is not None:
            if not draft.text.strip():
                raise invalid("the prompt is blank (empty or whitespace): give the model some text")
            return await self._tokenize(len(draft.text), tok.encode_packed, draft.text)
        raise invalid("a prompt is required (text, token ids or messages)")

    def _packed(self, ids: tuple[int, ...]) -> array:
        """Token ids (integers: the API layers see to that) checked whole against the vocabulary: packed as int32
        (an id past it fails), then the least and the largest read off the packed array (4k ids: min and max of
        the tuple cost 0.1 ms, a Python loop ~1 ms)."""
        vocab = self.router.source.config.vocab_size
        try:
            packed: array | None = int32s(ids)
        except OverflowError:
            packed = None
        if packed is None or not _within(packed, vocab):
            raise invalid(f"prompt token ids must be integers in [0, {vocab})")
        return packed

    async def token_ids(self, draft: Draft, generation: bool = True, special: bool = True) -> list[int]:
        """``/tokenize``: the ids a request with this prompt would send (``generation``: a chat's assistant turn
        opened after it; ``special``: a text's special tokens, as the tokenizer adds them)."""
        if draft.messages is not None:
            template = draft.template or TemplateArgs()
            return await self._rendered(chat_messages(draft.messages), draft.tools, True,
                                        replace(template, generation=template.generation and generation))
        if draft.text is not None and not special:
            return await self._tokenize(len(draft.text), lambda t: self.router.tokenizer.encode(t, False), draft.text)
        return await self.prompt_ids(draft)

    def sampling(self, draft: Draft) -> SamplingParams:
        """The draft's sampling, asking the engine to keep special tokens in the text when the markers of the
        model's calls are special tokens (``Router.tool_keeps_special``) and the request lets it call (tools
        offered, ``tool_choice`` auto)."""
        tools = draft.tools
        if tools is not None and tools.choice == Choice.AUTO and tools.offered and self.router.tool_keeps_special:
            return replace(draft.sampling, skip_special_tokens=False)
        return draft.sampling

    async def _rendered(self, chat: list[dict[str, Any]], tools: Tools | None, generation: bool,
                        template: TemplateArgs | None = None) -> list[int]:
        """``chat`` (with the ``tools`` offered) rendered by the chat template and tokenized; ``generation``:
        the whole prompt (rendered as ``template`` asks), or not (a part of it: no turn opened, never cut)."""
        tok = self.router.tokenizer
        return await self._chat(chat, tools, generation, template, lambda text: tok.encode(text, False))

    async def _rendered_packed(self, chat: list[dict[str, Any]], tools: Tools | None,
                               template: TemplateArgs | None) -> tuple[list[int], array]:
        """A chat's whole prompt (``_rendered``), and the same packed as int32 as the tokenizer gave it."""
        tok = self.router.tokenizer
        return await self._chat(chat, tools, True, template, lambda text: tok.encode_packed(text, False))

    async def _chat(self, chat: list[dict[str, Any]], tools: Tools | None, generation: bool,
                    template: TemplateArgs | None, encode: Callable[[str], T]) -> T:
        t = template or TemplateArgs()
        chat, offered = for_template(chat, tools, self.router.tokenizer, self.router.tool_format)
        render = functools.partial(self.router.tokenizer.render_chat,
                                   add_generation_prompt=generation and t.generation, tools=offered,
                                   continue_final_message=generation and t.continue_final, extra=dict(t.kwargs))
        chars = sum(len(m["content"]) for m in chat) + len(json.dumps(offered) if offered else "")
        try:
            return await self._tokenize(chars, lambda c: encode(render(c)), chat)
        except (ValueError, TemplateError) as e:
            raise invalid(f"the chat template cannot render these messages: {e}") from None

    async def _tokenize(self, chars: int, fn: Callable[[Any], T], arg: Any) -> T:
        """``fn(arg)`` here when the text is short (a thread hop costs more than it saves), else on the tokenize
        threads."""
        if chars < RELEASE_GIL_CHARS:
            return fn(arg)
        return await asyncio.get_running_loop().run_in_executor(self.router.tokenize_pool, fn, arg)

    def model(self, model: str) -> str:
        """The LoRA adapter ``model`` names ("" for the base model)."""
        r = self.router
        if not model or model == r.model_id:
            return ""
        served = r.loras.served()
        if model not in served:
            names = ", ".join(repr(n) for n in served) or "none"
            raise RequestError(ErrorKind.NOT_FOUND, f"model {model!r} is not served here; this router serves "
                                                    f"{r.model_id!r} and the LoRA adapters {names}")
        return model

    def check(self, prompt: list[int], params: SamplingParams) -> None:
        """Refuse what the engines cannot serve, before anything is routed."""
        if not prompt:
            raise invalid("the prompt is empty")
        ctx, vocab = self.router.max_model_len, self.router.source.config.vocab_size
        if len(prompt) >= ctx:
            raise invalid(f"the prompt has {len(prompt)} tokens, but the context of this model is {ctx} tokens "
                          "(prompt + max_tokens): shorten the prompt")
        if len(prompt) + params.max_tokens > ctx:
            raise invalid(f"prompt ({len(prompt)} tokens) + max_tokens ({params.max_tokens}) exceeds the context "
                          f"of {ctx} tokens: set max_tokens to at most {ctx - len(prompt)}")
        if not 0 <= params.temperature < float("inf"):
            raise invalid(f"temperature must be a finite number >= 0, not {params.temperature}")
        if params.top_k > vocab:
            raise invalid(f"top_k ({params.top_k}) exceeds the vocabulary ({vocab} tokens); 0 turns top-k off")
        if params.seed is not None and not 0 <= params.seed < 2**64:
            raise invalid("seed must be an integer in [0, 2^64)")
        if any(not 0 <= t < vocab for t in params.stop_token_ids):
            raise invalid(f"stop_token_ids must be token ids in [0, {vocab})")
        if any(not s for s in params.stop):
            raise invalid("stop strings must not be empty")
        if any(t >= vocab for t, _ in params.logit_bias):
            raise invalid(f"logit_bias names token {max(params.logit_bias)[0]}; token ids are in [0, {vocab})")

    def check_resume(self, resume: tuple[int, ...], params: SamplingParams) -> None:
        """The tokens a resumed stream delivered: token ids, fewer than ``max_tokens``."""
        if not resume:
            return
        vocab = self.router.source.config.vocab_size
        if any(not 0 <= t < vocab for t in resume):
            raise invalid(f"resume_token_ids must be token ids in [0, {vocab})")
        if len(resume) >= params.max_tokens:
            raise invalid(f"resume_token_ids has {len(resume)} tokens, as many as max_tokens ({params.max_tokens}) "
                          "or more: that stream was complete")

    @staticmethod
    def session(draft: Draft, tenant: str) -> SessionHint | None:
        """The request's session and its agent hints, ids namespaced by ``tenant`` (so no tenant reaches
        another's, nor forks from another's)."""
        if not draft.session_id:
            for name in ("session_end", "parent_session_id", "session_pause_s", "session_retention"):
                if getattr(draft, name):
                    raise invalid(f"{name} needs a session_id (the session it is about)")
            return None
        try:
            check_session_id(draft.session_id)
        except ValueError as e:
            raise invalid(str(e)) from None
        parent = session_key(tenant, draft.parent_session_id) if draft.parent_session_id else ""
        return SessionHint(session_key(tenant, draft.session_id), draft.session_end, parent, draft.session_pause_s,
                           draft.session_retention, draft.tools is not None and draft.tools.forces_call)

    async def retention(self, draft: Draft, prompt_tokens: int, dropped: int = 0) -> tuple[RetentionRange, ...]:
        """The retention hints as prompt token ranges: the request's covers the whole prompt, a message's the
        prompt up to the end of that message (the chat up to it rendered and tokenized: a long one on the
        tokenize threads, like the prompt, and mostly from the prefix token cache, the prompt's own leading
        part); ``dropped``: the tokens truncation cut off the prompt's front, which every range loses."""
        hints = [(draft.cache_control, prompt_tokens)] if draft.cache_control is not None else []
        if draft.messages is not None and isinstance(draft.messages, list):
            chat = chat_messages(draft.messages)
            for i, m in enumerate(draft.messages):
                if isinstance(m, dict) and m.get("cache_control") is not None:
                    end = len(await self._rendered(chat[:i + 1], draft.tools, False, draft.template))
                    hints.append((message_cache_control(m["cache_control"], f"messages[{i}].cache_control"),
                                  min(end - dropped, prompt_tokens)))
        out = []
        for hint, end in hints:
            try:
                ttl_s, priority = check_retention(hint.ttl_s, hint.priority, hint.field)
            except ValueError as e:
                raise invalid(str(e)) from None
            self.terms.check_retention(ttl_s, priority, hint.field)
            if end > 0 and priority > 0:
                out.append(RetentionRange(0, end, priority, ttl_s))
        return tuple(out)

    def policy(self, name: str | None) -> str | None:
        try:
            self.router.policies.get(name)
        except ValueError as e:
            raise invalid(str(e)) from None
        return name

    @staticmethod
    def slo(targets: tuple[float, float]) -> SLO:
        try:
            return SLO(*targets)
        except ValueError as e:
            raise invalid(f"{e}: set by kvmesh_slo {{ttft_s, itl_s}} (HTTP body), the slo field (gRPC) or the "
                          f"{' / '.join(SLO_HEADERS)} headers") from None

    @staticmethod
    def disaggregate(mode: str | None) -> str | None:
        if mode is not None and mode not in DISAGGREGATE_MODES:
            raise invalid(f"x-kvmesh-disaggregate must be one of {', '.join(DISAGGREGATE_MODES)}, not {mode!r}")
        return mode


def message_cache_control(value: Any, field: str) -> CacheControl:
    """``{"type": "ephemeral", "ttl": 300 | "5m" | "1h", "priority": 0-100}`` (Anthropic's and Dynamo's shape,
    every key optional) as a ``CacheControl``; the error names ``field``."""
    if isinstance(value, CacheControl):
        return value
    if not isinstance(value, dict):
        raise invalid(f'{field} must be an object like {{"ttl": 300, "priority": 50}}')
    ttl = value.get("ttl", value.get("ttl_s"))
    if isinstance(ttl, str):
        units = {"s": 1, "m": 60, "h": 3600}
        number, unit = ttl[:-1], ttl[-1:]
        if unit not in units or not number.isdigit():
            raise invalid(f'{field}.ttl must be a number of seconds or a duration like "5m" or "1h", not {ttl!r}')
        ttl = int(number) * units[unit]
    if ttl is not None and (isinstance(ttl, bool) or not isinstance(ttl, (int, float))):
        raise invalid(f"{field}.ttl must be a number of seconds, not {ttl!r}")
    priority = value.get("priority")
    if priority is not None and (isinstance(priority, bool) or not isinstance(priority, int)):
        raise invalid(f"{field}.priority must be an integer in [0, 100], not {priority!r}")
    return CacheControl(ttl, priority, field)


def check_constraint(draft: Draft) -> None:
    """The structured-output constraint, if any, can be served (the error names the field it came from)."""
    if draft.sampling.structured is not None:
        check_structured(draft.sampling.structured, draft.structured_field)


def truncated(prompt: P, keep: int, context: int) -> P:
    """``prompt`` cut as ``Draft.truncate`` says: its last ``keep`` tokens (> 0) or first ``-keep`` (< 0), at most
    the context less one (room for a token)."""
    if not keep:
        return prompt
    n = min(abs(keep), context - 1)
    return prompt[-n:] if keep > 0 else prompt[:n]


def _within(packed: array, vocab: int) -> bool:
    """Whether every one of the int32 ids is in ``[0, vocab)``."""
    ids = np.frombuffer(packed, dtype=np.int32)
    return not ids.size or bool(ids.min() >= 0 and ids.max() < vocab)


def chat_messages(messages: Any) -> list[dict[str, Any]]:
    """``[{role, content}]`` for the chat template: a role each, a string content each (OpenAI's text parts
    joined; an assistant's that calls tools may be null), not every one blank; an assistant's ``tool_calls``
    (``tools.message_calls``) and its ``reasoning`` (or ``reasoning_content``, as ``reasoning_content``: what
    Qwen3's and DeepSeek's templates read), and a tool result's ``tool_call_id`` kept."""
    if not isinstance(messages, list) or not messages:
        raise invalid("messages must be a non-empty list of {role, content} objects")
    chat = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or m.get("role") not in ROLES:
            raise invalid(f"messages[{i}] needs a role: system, user, assistant or tool")
        content = m.get("content")
        calls = m.get("tool_calls") if m["role"] == "assistant" else None
        if isinstance(content, list) and all(isinstance(p, dict) and p.get("type") == "text"
                                             and isinstance(p.get("text"), str) for p in content):
            content = "".join(p["text"] for p in content)  # OpenAI's text content parts
        if content is None and calls:
            content = ""
        if not isinstance(content, str):
            raise invalid(f"messages[{i}].content must be a string (or a list of {{type: text, text}} parts)")
        message: dict[str, Any] = {"role": m["role"], "content": content}
        if calls:
            message["tool_calls"] = message_calls(calls, f"messages[{i}].tool_calls")
        if m["role"] == "tool" and isinstance(m.get("tool_call_id"), str):
            message["tool_call_id"] = m["tool_call_id"]
        thought = m.get("reasoning", m.get("reasoning_content")) if m["role"] == "assistant" else None
        if isinstance(thought, str) and thought:  # a reasoning model's earlier thinking, for a template that reads it
            message["reasoning_content"] = thought
        chat.append(message)
    if not any(m["content"].strip() or m.get("tool_calls") for m in chat):
        raise invalid(f"messages[{len(chat) - 1}].content is blank: every message is empty or whitespace; give "
                      "the model some text")
    return chat
