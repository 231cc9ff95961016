"""The client gRPC API (``kvmesh.v1.Kvmesh``) over ``Router``."""

from __future__ import annotations

import time

import grpc

from kvmesh.convert import sampling_from_proto
from kvmesh.proto.v1 import api_pb2, api_pb2_grpc, common_pb2
from services.router.core import RequestError, Router, new_request_id

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

    async def _prepare(self, request, context, *, text=None, token_ids=None, messages=None):
        await self._authorize(context)
        rid = request.request_id or new_request_id()
        context.set_trailing_metadata((("x-request-id", rid),))
        try:
            params = sampling_from_proto(request.sampling)
            prompt = self.router.prompt_ids(text=text, token_ids=token_ids, messages=messages)
            self.router.check(request.model, prompt, params)
        except ValueError as e:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"sampling: {e}")
        except RequestError as e:
            await context.abort(STATUS[e.kind], e.message)
        return rid, prompt, params

    async def Generate(self, request: api_pb2.GenerateRequest, context):
        which = request.WhichOneof("prompt")
        kwargs = {"text": request.text} if which == "text" else \
            {"token_ids": list(request.token_ids.ids)} if which == "token_ids" else \
            {"messages": [{"role": m.role, "content": m.content} for m in request.messages.messages]} \
            if which == "messages" else {}
        rid, prompt, params = await self._prepare(request, context, **kwargs)
        try:
            async for c in self.router.generate(rid, prompt, params, request.cache_salt):
                msg = api_pb2.GenerateChunk(request_id=rid, token_ids=c.token_ids, text=c.text,
                                            finished=c.finished, finish_reason=c.finish_reason)
                if c.usage:
                    msg.usage.CopyFrom(common_pb2.Usage(**vars(c.usage)))
                yield msg
        except RequestError as e:
            await context.abort(STATUS[e.kind], e.message)

    async def Chat(self, request: api_pb2.ChatRequest, context):
        messages = [{"role": m.role, "content": m.content} for m in request.messages]
        rid, prompt, params = await self._prepare(request, context, messages=messages)
        text, ids, reason, usage = [], [], "", None
        try:
            async for c in self.router.generate(rid, prompt, params, request.cache_salt):
                text.append(c.text)
                ids += c.token_ids
                reason, usage = c.finish_reason or reason, c.usage or usage
        except RequestError as e:
            await context.abort(STATUS[e.kind], e.message)
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
