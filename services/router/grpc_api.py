"""The client gRPC API (``kvmesh.v1.Kvmesh``) over ``Router``. Every call's trailing metadata carries
``x-request-id`` and ``traceparent``; a ``traceparent`` in the call's metadata is honoured."""

from __future__ import annotations

import asyncio
import time

import grpc

from kvmesh.convert import sampling_from_proto
from kvmesh.proto.v1 import api_pb2, api_pb2_grpc, common_pb2
from services.router.core import RequestError, Router, new_request_id
from services.router.telemetry import RequestTrace

STATUS = {"invalid": grpc.StatusCode.INVALID_ARGUMENT, "not_found": grpc.StatusCode.NOT_FOUND,
          "unavailable": grpc.StatusCode.UNAVAILABLE, "overloaded": grpc.StatusCode.RESOURCE_EXHAUSTED,
          "unauthenticated": grpc.StatusCode.UNAUTHENTICATED, "internal": grpc.StatusCode.INTERNAL}


class KvmeshServicer(api_pb2_grpc.KvmeshServicer):
    def __init__(self, router: Router) -> None:
        self.router = router

    async def _authorize(self, context: grpc.aio.ServicerContext) -> None:
        key = self.router.cfg.api_key
        if not key:
            return
        md = dict(context.invocation_metadata() or ())
        given = md.get("x-api-key") or md.get("authorization", "").removeprefix("Bearer ").strip()
        if given != key:
            await context.abort(grpc.StatusCode.UNAUTHENTICATED, "missing or wrong API key "
                                "(send metadata 'authorization: Bearer <key>')")

    async def _prepare(self, request, context, api: str, *, text=None, token_ids=None, messages=None):
        """The request id, prompt, sampling and trace of a call (aborts the call when it is not acceptable)."""
        rid = request.request_id or new_request_id()
        rt = RequestTrace(self.router.metrics, rid, api, dict(context.invocation_metadata() or ()))
        context.set_trailing_metadata(tuple(rt.headers(rid).items()))
        try:
            await self._authorize(context)
        except BaseException:
            rt.finish("unauthenticated", "missing or wrong API key")
            raise
        try:
            with rt.segment("router.tokenize") as span:
                try:
                    params = sampling_from_proto(request.sampling)
                except ValueError as e:
                    raise RequestError("invalid", f"sampling: {e}") from None
                prompt = self.router.prompt_ids(text=text, token_ids=token_ids, messages=messages)
                self.router.check(request.model, prompt, params)
                span.set_attribute("kvmesh.tokens.prompt", len(prompt))
        except RequestError as e:
            rt.finish(e.kind, e.message)
            await context.abort(STATUS[e.kind], e.message)
        rt.describe(request.model or self.router.model_id, request.cache_salt, len(prompt))
        return rid, prompt, params, rt

    async def _abort(self, context, rt: RequestTrace, e: RequestError) -> None:
        rt.finish(e.kind, e.message)
        await context.abort(STATUS[e.kind], e.message)

    async def Generate(self, request: api_pb2.GenerateRequest, context):
        which = request.WhichOneof("prompt")
        kwargs = {"text": request.text} if which == "text" else \
            {"token_ids": list(request.token_ids.ids)} if which == "token_ids" else \
            {"messages": [{"role": m.role, "content": m.content} for m in request.messages.messages]} \
            if which == "messages" else {}
        rid, prompt, params, rt = await self._prepare(request, context, "grpc.generate", **kwargs)
        try:
            async for c in self.router.generate(rid, prompt, params, request.cache_salt, trace=rt,
                                                policy=_policy(context)):
                msg = api_pb2.GenerateChunk(request_id=rid, token_ids=c.token_ids, text=c.text,
                                            finished=c.finished, finish_reason=c.finish_reason)
                if c.usage:
                    msg.usage.CopyFrom(common_pb2.Usage(**vars(c.usage)))
                yield msg
                rt.first_token_sent()  # resumed once the message was handed to the transport
        except RequestError as e:
            await self._abort(context, rt, e)
        except asyncio.CancelledError:
            rt.finish("cancelled", "the client went away")
            raise
        finally:
            rt.finish()

    async def Chat(self, request: api_pb2.ChatRequest, context):
        messages = [{"role": m.role, "content": m.content} for m in request.messages]
        rid, prompt, params, rt = await self._prepare(request, context, "grpc.chat", messages=messages)
        text, ids, reason, usage = [], [], "", None
        try:
            async for c in self.router.generate(rid, prompt, params, request.cache_salt, trace=rt,
                                                policy=_policy(context)):
                rt.first_token_sent()  # unary: TTFT ends when the first token is in hand
                text.append(c.text)
                ids += c.token_ids
                reason, usage = c.finish_reason or reason, c.usage or usage
        except RequestError as e:
            await self._abort(context, rt, e)
        except asyncio.CancelledError:
            rt.finish("cancelled", "the client went away")
            raise
        finally:
            rt.finish()
        resp = api_pb2.ChatResponse(request_id=rid, text="".join(text), token_ids=ids, finish_reason=reason)
        if usage:
            resp.usage.CopyFrom(common_pb2.Usage(**vars(usage)))
        return resp

    async def ListModels(self, request, context):
        await self._authorize(context)
        r = self.router
        return api_pb2.ListModelsResponse(models=[api_pb2.Model(id=r.model_id, fingerprint=r.source.fingerprint,
                                                                max_model_len=r.max_model_len)])

    async def Health(self, request, context):
        now = time.monotonic()
        instances = self.router.registry.alive()
        roles = {i.beat.role for i in instances}
        ok = "both" in roles or {"prefill", "decode"} <= roles
        return api_pb2.HealthResponse(ok=ok, instances=[
            api_pb2.Instance(instance_id=i.id, role=i.beat.role, grpc_address=i.beat.grpc_address,
                             age_s=now - i.last_seen, load={k: float(v) for k, v in i.beat.load.items()})
            for i in instances])


def _policy(context) -> str | None:
    """A per-request routing policy from the ``x-kvmesh-policy`` metadata key."""
    return dict(context.invocation_metadata() or ()).get("x-kvmesh-policy")
