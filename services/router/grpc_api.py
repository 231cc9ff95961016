"""The client gRPC API (``kvmesh.v1.Kvmesh``) over ``Router``. Every call's trailing metadata carries
``x-request-id`` and ``traceparent``; a ``traceparent`` in the call's metadata is honoured.

Requests are parsed by ``add_to_server``'s own deserializers, so a request that is too large or not a valid
message (e.g. a string that is not UTF-8) is answered RESOURCE_EXHAUSTED / INVALID_ARGUMENT with a message,
not grpc's generic INTERNAL."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from dataclasses import dataclass

import grpc
from google.protobuf.message import DecodeError, Message
from kvmesh.contracts.sampling import sampling_from_proto
from kvmesh.proto.v1 import api_pb2, api_pb2_grpc, common_pb2

from services.router.access import RETRY_AFTER_S, Admission, Tenants, cache_salt
from services.router.core import RequestError, Router, new_request_id
from services.router.telemetry import RequestTrace

STATUS = {"invalid": grpc.StatusCode.INVALID_ARGUMENT, "not_found": grpc.StatusCode.NOT_FOUND,
          "unavailable": grpc.StatusCode.UNAVAILABLE, "overloaded": grpc.StatusCode.RESOURCE_EXHAUSTED,
          "too_large": grpc.StatusCode.RESOURCE_EXHAUSTED, "unauthenticated": grpc.StatusCode.UNAUTHENTICATED,
          "internal": grpc.StatusCode.INTERNAL}


@dataclass
class BadRequest:
    """What the deserializer hands the servicer instead of a request it could not accept."""

    kind: str
    message: str


class KvmeshServicer(api_pb2_grpc.KvmeshServicer):
    def __init__(self, router: Router, tenants: Tenants | None = None,
                 admission: Admission | None = None) -> None:
        """``tenants`` and ``admission``: shared with the HTTP API (default: from the router's settings)."""
        self.router = router
        self.tenants = tenants or Tenants.from_config(router.cfg)
        self.admission = admission or Admission.from_config(router.cfg)

    async def _prepare(self, request, context, api: str, *, text=None, token_ids=None, messages=None):
        """The request id, prompt, sampling, cache salt, trace and admission release of a call (aborts the
        call when it is not acceptable)."""
        metadata = dict(context.invocation_metadata() or ())
        bad = request if isinstance(request, BadRequest) else None
        given = "" if bad else request.request_id
        if given and (len(given) > 128 or not given.isascii() or not given.isprintable()):
            bad = BadRequest("invalid", "request_id must be printable ASCII of at most 128 characters")
        rid = (None if bad else given) or new_request_id()  # it goes out in metadata: never a bad one
        rt = RequestTrace(self.router.metrics, rid, api, metadata)
        context.set_trailing_metadata(tuple(rt.headers(rid).items()))
        leave: Callable[[], None] | None = None
        try:
            tenant = self.tenants.authenticate(metadata)
            if bad:
                raise RequestError(bad.kind, bad.message)
            leave = self.admission.enter(tenant)
            with rt.segment("router.tokenize") as span:
                try:
                    params = sampling_from_proto(request.sampling)
                except ValueError as e:
                    raise RequestError("invalid", f"sampling: {e}") from None
                prompt = self.router.prompt_ids(text=text, token_ids=token_ids, messages=messages)
                lora = self.router.check(request.model, prompt, params)
                span.set_attribute("kvmesh.tokens.prompt", len(prompt))
            salt = cache_salt(tenant, request.cache_salt)
        except RequestError as e:
            if leave is not None:
                leave()
            await self._abort(context, rt, rid, e)
        rt.describe(request.model or self.router.model_id, tenant or request.cache_salt, len(prompt))
        return rid, prompt, params, salt, rt, leave, lora

    async def _abort(self, context, rt: RequestTrace, rid: str, e: RequestError) -> None:
        rt.finish(e.kind, e.message)
        trailer = tuple(rt.headers(rid).items())
        if e.kind == "overloaded":
            trailer += (("retry-after", str(RETRY_AFTER_S)),)
        await context.abort(STATUS[e.kind], e.message, trailing_metadata=trailer)

    async def Generate(self, request: api_pb2.GenerateRequest, context):
        which = None if isinstance(request, BadRequest) else request.WhichOneof("prompt")
        kwargs = {"text": request.text} if which == "text" else \
            {"token_ids": list(request.token_ids.ids)} if which == "token_ids" else \
            {"messages": [{"role": m.role, "content": m.content} for m in request.messages.messages]} \
            if which == "messages" else {}
        rid, prompt, params, salt, rt, leave, lora = await self._prepare(request, context, "grpc.generate",
                                                                         **kwargs)
        try:
            async for c in self.router.generate(rid, prompt, params, salt, trace=rt, policy=_policy(context),
                                                lora=lora, disaggregate=_disaggregate(context)):
                msg = api_pb2.GenerateChunk(request_id=rid, token_ids=c.token_ids, text=c.text,
                                            finished=c.finished, finish_reason=c.finish_reason)
                if c.usage:
                    msg.usage.CopyFrom(common_pb2.Usage(**vars(c.usage)))
                yield msg
                rt.first_token_sent()  # resumed once the message was handed to the transport
        except RequestError as e:
            await self._abort(context, rt, rid, e)
        except asyncio.CancelledError:
            rt.finish("cancelled", "the client went away")
            raise
        finally:
            rt.finish()
            leave()

    async def Chat(self, request: api_pb2.ChatRequest, context):
        messages = [] if isinstance(request, BadRequest) else \
            [{"role": m.role, "content": m.content} for m in request.messages]
        rid, prompt, params, salt, rt, leave, lora = await self._prepare(request, context, "grpc.chat",
                                                                         messages=messages)
        text, ids, reason, usage = [], [], "", None
        try:
            async for c in self.router.generate(rid, prompt, params, salt, trace=rt, policy=_policy(context),
                                                lora=lora, disaggregate=_disaggregate(context)):
                rt.first_token_sent()  # unary: TTFT ends when the first token is in hand
                text.append(c.text)
                ids += c.token_ids
                reason, usage = c.finish_reason or reason, c.usage or usage
        except RequestError as e:
            await self._abort(context, rt, rid, e)
        except asyncio.CancelledError:
            rt.finish("cancelled", "the client went away")
            raise
        finally:
            rt.finish()
            leave()
        resp = api_pb2.ChatResponse(request_id=rid, text="".join(text), token_ids=ids, finish_reason=reason)
        if usage:
            resp.usage.CopyFrom(common_pb2.Usage(**vars(usage)))
        return resp

    async def ListModels(self, request, context):
        try:
            self.tenants.authenticate(dict(context.invocation_metadata() or ()))
        except RequestError as e:
            await context.abort(STATUS[e.kind], e.message)
        r = self.router
        return api_pb2.ListModelsResponse(models=[api_pb2.Model(id=r.model_id, fingerprint=r.source.fingerprint,
                                                                max_model_len=r.max_model_len)] + [
            api_pb2.Model(id=name, fingerprint=r.source.fingerprint, max_model_len=r.max_model_len,
                          parent=r.model_id) for name in r.loras.served()])

    async def Health(self, request, context):
        now = time.monotonic()
        instances = self.router.registry.alive()
        roles = {i.beat.role for i in instances}
        ok = "both" in roles or {"prefill", "decode"} <= roles
        return api_pb2.HealthResponse(ok=ok, instances=[
            api_pb2.Instance(instance_id=i.id, role=i.beat.role, grpc_address=i.beat.grpc_address,
                             age_s=now - i.last_seen, load={k: float(v) for k, v in i.beat.load.items()})
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
    }
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler("kvmesh.v1.Kvmesh", handlers),))
    server.add_registered_method_handlers("kvmesh.v1.Kvmesh", handlers)


def _parser(message: type[Message], max_bytes: int) -> Callable[[bytes], Message | BadRequest]:
    def parse(data: bytes) -> Message | BadRequest:
        if len(data) > max_bytes:
            return BadRequest("too_large", f"the request is {len(data)} bytes, over the limit of {max_bytes} "
                                           "(max_body_bytes): send a shorter prompt")
        try:
            return message.FromString(data)
        except DecodeError as e:
            return BadRequest("invalid", f"the request is not a valid {message.DESCRIPTOR.full_name}: {e}")

    return parse


def _disaggregate(context) -> str | None:
    """A per-request PD choice (always | never | auto) from the ``x-kvmesh-disaggregate`` metadata key."""
    return dict(context.invocation_metadata() or ()).get("x-kvmesh-disaggregate")


def _policy(context) -> str | None:
    """A per-request routing policy from the ``x-kvmesh-policy`` metadata key."""
    return dict(context.invocation_metadata() or ()).get("x-kvmesh-policy")
