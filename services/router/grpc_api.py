"""The client gRPC API (``kvmesh.v1.Kvmesh``) over ``Router``. Every call's trailing metadata carries
``x-request-id`` and ``traceparent``; a ``traceparent`` in the call's metadata is honoured.

A request message over ``max_body_bytes`` is refused by gRPC as it arrives (the server's receive limit, which
``serve`` sets to it), RESOURCE_EXHAUSTED, before its key is looked at. Requests are parsed by
``add_to_server``'s own deserializers, so one that is not a valid message (e.g. a string that is not UTF-8) is
answered INVALID_ARGUMENT with a message, not grpc's generic INTERNAL."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable
from typing import Any

import grpc
from google.protobuf.message import DecodeError, Message
from kvmesh.contracts.engine import TokenLogprobs, logprobs_to_proto
from kvmesh.contracts.sampling import sampling_from_proto
from kvmesh.contracts.sessions import check_session_id, session_key
from kvmesh.proto.v1 import api_pb2, api_pb2_grpc, common_pb2

from services.router.access import RETRY_AFTER_S, AdminKey
from services.router.core import Router
from services.router.errors import ErrorKind, RequestError, invalid
from services.router.intake import (
    Admitted,
    CacheControl,
    Call,
    Draft,
    Intake,
    TemplateArgs,
    session_fields,
    slo_from_headers,
)
from services.router.openai_body import template_args
from services.router.reasoning import ThinkSplitter
from services.router.telemetry import RequestTrace
from services.router.tool_formats import CallReader
from services.router.tools import MODES, ChatOutput, Tools, constrained, finish_reason, read_chat, tools_from_body


class KvmeshServicer(api_pb2_grpc.KvmeshServicer):
    def __init__(self, router: Router, intake: Intake | None = None, admin: AdminKey | None = None) -> None:
        """``intake``: shared with the HTTP API, and so are its caps (default: from the router's settings);
        ``admin``: the key that sees ``Health``'s instance list (default: the router's ``admin_key``)."""
        self.router = router
        self.intake = intake or Intake(router)
        self.admin = admin or AdminKey.from_config(router.cfg)

    @staticmethod
    def _call(request: Message | RequestError, context: grpc.aio.ServicerContext, api: str) -> Call:
        metadata = dict(context.invocation_metadata() or ())
        if isinstance(request, RequestError):
            return Call(api, metadata, refused=request)
        return Call(api, metadata, request.request_id)

    async def _abort(self, context: grpc.aio.ServicerContext, rt: RequestTrace, e: RequestError) -> None:
        rt.finish(e.kind, e.message)
        trailer = tuple(rt.headers().items())
        if e.kind == ErrorKind.OVERLOADED:
            trailer += (("retry-after", str(RETRY_AFTER_S)),)
        await context.abort(e.kind.grpc, e.message, trailing_metadata=trailer)

    async def Generate(self, request: api_pb2.GenerateRequest | RequestError,
                       context: grpc.aio.ServicerContext) -> AsyncIterator[api_pb2.GenerateChunk]:
        call = self._call(request, context, "grpc.generate")
        rt = self.intake.trace(call)
        context.set_trailing_metadata(tuple(rt.headers().items()))
        drafted: list[Draft] = []
        try:
            async with self.intake.admit(call, rt, _reader(request, call, drafted)) as req:
                out = self._reading(drafted[0], req)
                async for c in self.router.generate(req, rt):
                    msg = api_pb2.GenerateChunk(request_id=req.request_id, token_ids=c.token_ids, text=c.text,
                                                finished=c.finished, finish_reason=c.finish_reason,
                                                logprobs=[logprobs_to_proto(lp) for lp in c.logprobs],
                                                prompt_logprobs=[logprobs_to_proto(lp) for lp in c.prompt_logprobs])
                    if out is not None:
                        out.read(msg, c.finished)
                    if c.usage:
                        msg.usage.CopyFrom(common_pb2.Usage(**vars(c.usage)))
                    yield msg
                    rt.first_token_sent()  # resumed once the message was handed to the transport
        except RequestError as e:
            await self._abort(context, rt, e)
        except asyncio.CancelledError:
            rt.finish(ErrorKind.CANCELLED, "the client went away")
            raise
        finally:
            rt.finish()

    def _reading(self, draft: Draft, req: Admitted) -> StreamReader | None:
        """What reads a ``Generate`` of messages as it streams (offered tools, the reasoning split out); None
        for a plain prompt, or when there is nothing to read."""
        if draft.messages is None:
            return None
        tools = draft.tools if draft.tools is not None and draft.tools.offered else None
        think = self.router.thinking(req.prompt)
        if tools is None and think is None:
            return None
        out = StreamReader(tools.reader(self.router.tool_format) if tools else None,
                           ThinkSplitter(think) if think is not None else None)
        if req.resume:  # a resumed stream: what was delivered before the cut is read first, its output dropped
            out.skip(self.router.tokenizer.decode(list(req.resume)))
        return out

    async def Chat(self, request: api_pb2.ChatRequest | RequestError,
                   context: grpc.aio.ServicerContext) -> api_pb2.ChatResponse:
        call = self._call(request, context, "grpc.chat")
        rt = self.intake.trace(call)
        context.set_trailing_metadata(tuple(rt.headers().items()))
        text: list[str] = []
        ids: list[int] = []
        logprobs: list[TokenLogprobs] = []
        prompt_logprobs: tuple[TokenLogprobs, ...] = ()
        reason, usage = "", None
        drafted: list[Draft] = []  # the request as read: its tools read the answer
        think: bool | None = None  # the reasoning split out: whether the prompt opened it
        try:
            async with self.intake.admit(call, rt, _reader(request, call, drafted)) as req:
                think = self.router.thinking(req.prompt)
                async for c in self.router.generate(req, rt):
                    rt.first_token_sent()  # unary: TTFT ends when the first token is in hand
                    text.append(c.text)
                    ids += c.token_ids
                    logprobs += c.logprobs
                    prompt_logprobs = prompt_logprobs or c.prompt_logprobs
                    reason, usage = c.finish_reason or reason, c.usage or usage
        except RequestError as e:
            await self._abort(context, rt, e)
        except asyncio.CancelledError:
            rt.finish(ErrorKind.CANCELLED, "the client went away")
            raise
        finally:
            rt.finish()
        tools = drafted[0].tools if drafted and drafted[0].tools is not None and drafted[0].tools.offered else None
        read = read_chat("".join(text), reason, tools, self.router.tool_format, think)
        resp = api_pb2.ChatResponse(request_id=rt.request_id, text=read.content or "", token_ids=ids,
                                    finish_reason=read.finish_reason,
                                    logprobs=[logprobs_to_proto(lp) for lp in logprobs],
                                    tool_calls=[common_pb2.ToolCall(id=c["id"], name=c["function"]["name"],
                                                                    arguments=c["function"]["arguments"])
                                                for c in read.calls], reasoning=read.reasoning or "",
                                    prompt_logprobs=[logprobs_to_proto(lp) for lp in prompt_logprobs])
        if usage:
            resp.usage.CopyFrom(common_pb2.Usage(**vars(usage)))
        return resp

    async def ListModels(self, request: api_pb2.ListModelsRequest,
                         context: grpc.aio.ServicerContext) -> api_pb2.ListModelsResponse:
        try:
            self.intake.tenants.authenticate(dict(context.invocation_metadata() or ()))
        except RequestError as e:
            await context.abort(e.kind.grpc, e.message)
        r = self.router
        return api_pb2.ListModelsResponse(models=[api_pb2.Model(id=r.model_id, fingerprint=r.source.fingerprint,
                                                                max_model_len=r.max_model_len)] + [
            api_pb2.Model(id=name, fingerprint=r.source.fingerprint, max_model_len=r.max_model_len,
                          parent=r.model_id) for name in r.loras.served()])

    async def CloseSession(self, request: api_pb2.CloseSessionRequest,
                           context: grpc.aio.ServicerContext) -> api_pb2.CloseSessionResponse:
        """The caller's session is over (its tenant's session of that id only)."""
        try:
            tenant = self.intake.tenants.authenticate(dict(context.invocation_metadata() or ()))
            try:
                check_session_id(request.session_id)
            except ValueError as e:
                raise invalid(str(e)) from None
        except RequestError as e:
            await context.abort(e.kind.grpc, e.message)
        await self.router.sessions.close(session_key(tenant, request.session_id))
        return api_pb2.CloseSessionResponse(session_id=request.session_id)

    async def Health(self, request: api_pb2.HealthRequest,
                     context: grpc.aio.ServicerContext) -> api_pb2.HealthResponse:
        """Whether the router can serve, open to anyone; the instances (ids, roles, internal addresses, load)
        only to a caller with the admin key (and on the internal port's ``/health``)."""
        now = time.monotonic()
        instances = self.router.registry.alive()
        roles = {i.beat.role for i in instances}
        ok = "both" in roles or {"prefill", "decode"} <= roles
        try:
            self.admin.authorize(dict(context.invocation_metadata() or ()))
        except RequestError:
            return api_pb2.HealthResponse(ok=ok)
        return api_pb2.HealthResponse(ok=ok, instances=[
            api_pb2.Instance(instance_id=i.id, role=i.beat.role, grpc_address=i.beat.grpc_address,
                             age_s=now - i.last_seen, load=i.beat.load.to_dict())
            for i in instances])


def add_to_server(servicer: KvmeshServicer, server: grpc.aio.Server, max_request_bytes: int) -> None:
    """``api_pb2_grpc.add_KvmeshServicer_to_server`` with deserializers that refuse, with a message, a request
    over ``max_request_bytes`` or one that does not parse."""
    handlers = {
        "Generate": grpc.unary_stream_rpc_method_handler(
            servicer.Generate, request_deserializer=_parser(api_pb2.GenerateRequest, max_request_bytes),
            response_serializer=api_pb2.GenerateChunk.SerializeToString),
        "Chat": grpc.unary_unary_rpc_method_handler(
            servicer.Chat, request_deserializer=_parser(api_pb2.ChatRequest, max_request_bytes),
            response_serializer=api_pb2.ChatResponse.SerializeToString),
        "ListModels": grpc.unary_unary_rpc_method_handler(
            servicer.ListModels, request_deserializer=api_pb2.ListModelsRequest.FromString,
            response_serializer=api_pb2.ListModelsResponse.SerializeToString),
        "Health": grpc.unary_unary_rpc_method_handler(
            servicer.Health, request_deserializer=api_pb2.HealthRequest.FromString,
            response_serializer=api_pb2.HealthResponse.SerializeToString),
        "CloseSession": grpc.unary_unary_rpc_method_handler(
            servicer.CloseSession, request_deserializer=api_pb2.CloseSessionRequest.FromString,
            response_serializer=api_pb2.CloseSessionResponse.SerializeToString),
    }
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler("kvmesh.v1.Kvmesh", handlers),))
    server.add_registered_method_handlers("kvmesh.v1.Kvmesh", handlers)


def _parser(message: type[Message], max_bytes: int) -> Callable[[bytes], Message | RequestError]:
    def parse(data: bytes) -> Message | RequestError:
        if len(data) > max_bytes:
            return RequestError(ErrorKind.TOO_LARGE, f"the request is {len(data)} bytes, over the limit of "
                                                     f"{max_bytes} (max_body_bytes): send a shorter prompt")
        try:
            return message.FromString(data)
        except DecodeError as e:
            return invalid(f"the request is not a valid {message.DESCRIPTOR.full_name}: {e}")

    return parse


def _reader(request: api_pb2.GenerateRequest | api_pb2.ChatRequest | RequestError,
            call: Call, drafted: list[Draft] | None = None) -> Callable[[], Awaitable[Draft]]:
    """What the intake reads once the caller holds a slot (kept in ``drafted`` too, when given). A request the
    deserializer refused is never read: ``Intake.admit`` raises ``call.refused`` (this same error) first."""
    async def read() -> Draft:
        if isinstance(request, RequestError):
            raise request
        draft = await _draft(request, call)
        if drafted is not None:
            drafted.append(draft)
        return draft

    return read


class StreamReader:
    """A ``Generate`` of messages read as it streams (``tools.ChatOutput``, on the gRPC chunk): each chunk's text
    becomes its content, with the reasoning and the calls apart. A call's first piece has its id and name; a later
    piece (a named function's arguments, as generated) its arguments alone, to be joined to the call before it
    (the SDK does)."""

    def __init__(self, calls: CallReader | None, thinking: ThinkSplitter | None) -> None:
        self.output = ChatOutput(calls, thinking)

    def read(self, msg: api_pb2.GenerateChunk, last: bool) -> None:
        msg.reasoning, msg.text, deltas = self.output.feed(msg.text, last)
        msg.tool_calls.extend(common_pb2.ToolCall(id=d.id, name=d.name, arguments=d.arguments) for d in deltas)
        if self.output.called and msg.finish_reason:
            msg.finish_reason = finish_reason(msg.finish_reason, True)

    def skip(self, text: str) -> None:
        self.output.feed(text)


async def _draft(request: api_pb2.GenerateRequest | api_pb2.ChatRequest, call: Call) -> Draft:
    """A ``Generate`` (text, token ids or messages) or ``Chat`` request as the intake's input; the routing
    overrides come from the metadata keys ``x-kvmesh-policy`` and ``x-kvmesh-disaggregate``, the latency targets
    from ``slo`` or the metadata keys ``x-kvmesh-slo-ttft-s`` / ``x-kvmesh-slo-itl-s`` (which win)."""
    try:
        sampling = sampling_from_proto(request.sampling)
    except ValueError as e:
        raise invalid(f"sampling: {e}") from None
    text: str | None = None
    token_ids: tuple[int, ...] | None = None
    messages: list[dict[str, Any]] | None = None
    tools = None
    template = None
    if isinstance(request, api_pb2.ChatRequest):
        messages = _messages(request.messages)
        tools = _tools(request)
        template = _template(request, messages)
    else:
        which = request.WhichOneof("prompt")
        if which == "text":
            text = request.text
        elif which == "token_ids":
            token_ids = tuple(request.token_ids.ids)
        elif which == "messages":
            messages = _messages(request.messages.messages)
            tools = _tools(request)
            template = _template(request, messages)
        if which != "messages" and (request.tools or request.tool_choice):
            raise invalid("tools need messages (a chat): a text or token-id prompt renders no tools")
    structured = sampling.structured
    sampling, structured_field = constrained(sampling, f"sampling.{structured.kind}" if structured else "", tools)
    resume = tuple(request.resume_token_ids) if isinstance(request, api_pb2.GenerateRequest) else ()
    sessions = session_fields({"session_id": request.session_id, "session_end": request.session_end,
                               "parent_session_id": request.parent_session_id,
                               "session_pause_s": request.session_pause_s,
                               "session_retention": request.session_retention}, call.headers)
    return Draft(sampling, text, token_ids, messages, model=request.model, cache_salt=request.cache_salt,
                 structured_field=structured_field, tools=tools, template=template,
                 policy=call.headers.get("x-kvmesh-policy"), disaggregate=call.headers.get("x-kvmesh-disaggregate"),
                 **sessions,
                 cache_control=_cache_control(request, "cache_control"), resume=resume,
                 slo=slo_from_headers(call.headers, (request.slo.ttft_s, request.slo.itl_s)))


def _cache_control(message: api_pb2.GenerateRequest | api_pb2.ChatRequest | common_pb2.ChatMessage,
                   field: str) -> CacheControl | None:
    """A message's ``cache_control`` (None: unset); a TTL of 0 is the default one."""
    if not message.HasField("cache_control"):
        return None
    cc = message.cache_control
    return CacheControl(cc.ttl_s or None, cc.priority if cc.HasField("priority") else None, field)


def _messages(messages: Iterable[common_pb2.ChatMessage]) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    for i, m in enumerate(messages):
        msg: dict[str, Any] = {"role": m.role, "content": m.content}
        if m.tool_calls:
            msg["tool_calls"] = [{"id": c.id, "type": "function", "function": {"name": c.name,
                                                                               "arguments": c.arguments}}
                                 for c in m.tool_calls]
        if m.tool_call_id:
            msg["tool_call_id"] = m.tool_call_id
        if m.reasoning:
            msg["reasoning"] = m.reasoning
        if (cc := _cache_control(m, f"messages[{i}].cache_control")) is not None:
            msg["cache_control"] = cc
        out.append(msg)
    return out


def _template(request: api_pb2.ChatRequest | api_pb2.GenerateRequest,
              messages: list[dict[str, Any]]) -> TemplateArgs | None:
    """The request's rendering fields as OpenAI's body has them (``openai_body.template_args``)."""
    body: dict[str, Any] = {"continue_final_message": request.continue_final_message}
    if request.chat_template_kwargs:
        try:
            body["chat_template_kwargs"] = json.loads(request.chat_template_kwargs)
        except ValueError as e:
            raise invalid(f"chat_template_kwargs is not valid JSON: {e}") from None
    if request.HasField("add_generation_prompt"):
        body["add_generation_prompt"] = request.add_generation_prompt
    return template_args(body, messages)


def _tools(request: api_pb2.ChatRequest | api_pb2.GenerateRequest) -> Tools | None:
    """A ``Chat``'s tools read as OpenAI's body has them (``tools.tools_from_body``, whose errors name the
    fields OpenAI's way: ``tools[1].function.name``); ``tool_choice`` is a mode or the one function's name."""
    given = []
    for i, t in enumerate(request.tools):
        fn: dict[str, Any] = {"name": t.name}
        if t.description:
            fn["description"] = t.description
        if t.parameters:
            try:
                fn["parameters"] = json.loads(t.parameters)
            except ValueError as e:
                raise invalid(f"tools[{i}].parameters is not valid JSON: {e}") from None
        given.append({"type": "function", "function": fn})
    choice: Any = request.tool_choice or None
    if choice is not None and choice not in MODES:
        choice = {"type": "function", "function": {"name": choice}}
    body: dict[str, Any] = {"tools": given, "tool_choice": choice}
    if request.HasField("parallel_tool_calls"):
        body["parallel_tool_calls"] = request.parallel_tool_calls
    return tools_from_body(body)
