"""The Prefill RPC: compute the prompt's KV (reusing the local prefix cache), sample the first token, push the
KV to the decode instance through the transfer engine (every part carrying the capability decode issued,
``push_token``), then announce it on ``kv.ready.<decode>``.

Traced as ``prefill.request`` (a child of the router's span, from the call's metadata) with ``prefill.fetch``,
``prefill.queue``, ``prefill.compute`` and ``kv.push`` under it; ``kv.ready`` carries its context to decode."""

from __future__ import annotations

import dataclasses
import logging
import time
from typing import Any

import grpc
from kvmesh import tls
from kvmesh.contracts.engine import (
    EngineOutput,
    EngineRequest,
    ExportPieces,
    ExportPlan,
    RequestTiming,
    engine_request_from_proto,
    logprobs_to_proto,
    prompt_length,
)
from kvmesh.contracts.ids import InstanceId, RequestId, handoff_transfer_id
from kvmesh.contracts.messages import KVReady
from kvmesh.engines import SequenceError
from kvmesh.instance.errors import abort_failed, refuse_continuation
from kvmesh.instance.host import Attached, EngineHost, RolePlugin
from kvmesh.proto.v1 import worker_pb2, worker_pb2_grpc
from kvmesh.telemetry import tracing
from kvmesh.telemetry.rpc import traced_rpc
from kvmesh.transfer.header import parse_versions
from opentelemetry.trace import Span, SpanKind, StatusCode

from services.prefill.faults import make_handoff
from services.prefill.handoff import PartStats, PushStream, Target, announcer, push_overlap

log = logging.getLogger(__name__)


class PrefillServicer(worker_pb2_grpc.PrefillServicer):
    def __init__(self, host: EngineHost) -> None:
        self.w = host
        # faulty only when a test asks
        self.handoff = make_handoff(host.cfg.faults, announcer(host), tls.transfer_client_tls(host.shared))

    @traced_rpc("prefill.request", rpc="prefill", metrics=lambda self: self.w.metrics,
                attributes=lambda self, request, context: {
                    **self.w.span_attributes(request.work, context),
                    "kvmesh.decode_instance": request.decode_instance,
                    "kvmesh.tokens.prompt": prompt_length(request.work)})
    async def Prefill(self, request: worker_pb2.PrefillRequest, context: grpc.aio.ServicerContext,
                      span: Span) -> worker_pb2.PrefillResponse:
        work, w = request.work, self.w
        attrs = w.span_attributes(work, context)
        t0 = time.monotonic()
        if not request.decode_instance or not request.decode_transfer_address or not request.push_token:
            w.metrics.rejections.labels("invalid").inc()
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                                "decode_instance, decode_transfer_address and push_token (the capability decode "
                                "issued for this request's push) are required")
        try:
            target = Target(request.decode_transfer_address, request.push_token, parse_versions(request.push_versions))
        except ValueError as e:
            w.metrics.rejections.labels("invalid").inc()
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"push_versions: {e}")
        try:
            engine_request = _first_token_only(engine_request_from_proto(work))
        except ValueError as e:
            w.metrics.rejections.labels("invalid").inc()
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"work: {e}")
        await refuse_continuation(context, w.engine, work)
        if engine_request.params.prompt_logprobs is not None:
            w.metrics.rejections.labels("invalid").inc()
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "sampling.prompt_logprobs is served where the "
                                "request decodes (prefill_locally): decode would get the KV but not the logprobs")
        prompt = list(engine_request.prompt)
        # decode holds (and pinned) the leading blocks the router saw there: push only the rest. At most the
        # blocks before the last token's, so at least one block moves and decode computes nothing
        skip = min(request.decode_cached_blocks, (len(prompt) - 1) // w.layout.block_size)
        # the rest pushed layer group by layer group as the forward pass writes them
        plan = ExportPlan(ExportPieces.BY_LAYER_GROUP, skip, w.cfg.push_layer_groups)
        engine_request = dataclasses.replace(engine_request, export=plan)
        warmed = await w.warm_from_pool(prompt, work.cache_salt, work.pool_blocks, span, attrs, work.lora_name)
        transfer_id = handoff_transfer_id(work.request_id, w.instance_id)
        stream = self.handoff.open(transfer_id, target, w.layout)
        try:
            response = await self._prefill(request, context, span, attrs, engine_request, stream, t0)
            response.pool_fetch = warmed.outcome
            return response
        finally:
            stream.cancel()  # a failed or abandoned request sends no more parts

    async def _compute(self, context: grpc.aio.ServicerContext, span: Span, engine_request: EngineRequest,
                       stream: PushStream) -> tuple[EngineOutput, RequestTiming, int]:
        """The prompt through the engine, each chunk's blocks (or a layer group of them, or the last ones) pushed
        as they are read out: its last output, its timings, and the blocks pushed."""
        w, final, timing, blocks = self.w, None, RequestTiming(), 0
        try:
            async for out in w.engine.generate(engine_request, timing):
                if out.exported is not None and out.exported.num_blocks:  # on their way while it computes
                    stream.add(out.exported)
                    if out.exported.layers is None or out.exported.layers[1] == w.layout.num_layers:
                        blocks += out.exported.num_blocks  # each block once, at its last layer group
                final = out
        except ValueError as e:
            w.metrics.rejections.labels("invalid").inc()
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        except SequenceError as e:  # this request failed inside the engine; the rest of its batch did not
            await abort_failed(context, e, span)
        assert final is not None and final.exported is not None
        return final, timing, blocks

    async def _prefill(self, request: worker_pb2.PrefillRequest, context: grpc.aio.ServicerContext, span: Span,
                       attrs: dict[str, Any], engine_request: EngineRequest, stream: PushStream,
                       t0: float) -> worker_pb2.PrefillResponse:
        """Compute the prompt, pushing each chunk's KV as the engine reads it out, then announce it."""
        work, w = request.work, self.w
        # its TTFT target counts from its arrival at the router
        engine_request = dataclasses.replace(engine_request, waited_s=engine_request.waited_s + time.monotonic() - t0)
        final, timing, blocks = await self._compute(context, span, engine_request, stream)
        compute_s = time.monotonic() - t0
        w.metrics.ttft.observe(timing.first_output - t0)
        w.metrics.prefix.observe(len(engine_request.prompt), final.cached_tokens)
        w.record_engine_spans(span, timing, attrs, len(engine_request.prompt), final.cached_tokens)
        kv = final.exported
        assert kv is not None  # (_compute checked it)
        first_token = final.token_ids[0]
        # decode emits the first token, and never sees the logits it came from: its logprobs travel with it
        first_logprobs = final.logprobs[0] if final.logprobs else None
        first_block = stream.first_block  # the first part's
        ready = KVReady(request_id=RequestId(work.request_id), decode_instance=InstanceId(request.decode_instance),
                        transfer_id=stream.transfer_id, block_keys=tuple(kv.block_keys[first_block:]),
                        num_tokens=kv.num_tokens, first_token=first_token, layout=w.layout,
                        prefill_instance=w.instance_id, first_block=first_block, parts=stream.parts,
                        first_logprobs=first_logprobs)
        push_attrs = {**attrs, "kvmesh.decode_instance": request.decode_instance,
                      "kvmesh.transfer_backend": w.cfg.transfer_backend, "kvmesh.blocks": blocks,
                      "kvmesh.tokens": kv.num_tokens, "kvmesh.first_block": first_block,
                      "kvmesh.decode_cached_blocks": request.decode_cached_blocks, "kvmesh.parts": stream.parts,
                      tracing.BACKGROUND: True}
        # the announcement is MACed with the push's capability: decode drops one it cannot verify
        parts = await self._hand_off(context, span, stream, ready, push_attrs, timing.first_output,
                                     request.push_token)
        nbytes = sum(p.nbytes for p in parts)
        response = worker_pb2.PrefillResponse(first_token=first_token, cached_tokens=final.cached_tokens,
                                              num_blocks=blocks, transfer_bytes=nbytes,
                                              transfer_s=parts[-1].end - parts[0].start,
                                              transfer_id=stream.transfer_id, compute_s=compute_s)
        if first_logprobs is not None:
            response.first_logprobs.CopyFrom(logprobs_to_proto(first_logprobs))
        return response

    async def _hand_off(self, context: grpc.aio.ServicerContext, span: Span, stream: PushStream, ready: KVReady,
                        push_attrs: dict[str, Any], compute_end: float, token: str) -> list[PartStats]:
        """Wait for the parts still on their way, trace the push (``kv.push``), then announce it on
        ``kv.ready``; a failed part is announced as a failure and ends the call (ABORTED)."""
        try:
            parts = await stream.finish()
        except Exception as e:  # noqa: BLE001 - any push failure is reported to decode, which recomputes
            log.warning("request %s (trace %s): KV push to %s failed: %s", ready.request_id,
                        tracing.trace_id(span), ready.decode_instance, e)
            sent = stream.done
            push = tracing.start("kv.push", span, SpanKind.CLIENT, {
                **push_attrs, "kvmesh.bytes": sum(p.nbytes for p in sent), "kvmesh.parts_verified": len(sent)},
                tracing.mono_ns(sent[0].start if sent else time.monotonic()))
            push.set_status(StatusCode.ERROR, f"KV push failed: {e}")
            push.end()
            await self.handoff.announce(dataclasses.replace(ready, ok=False, error=f"KV push failed: {e}").signed(
                token), span)
            # ABORTED, not UNAVAILABLE: decode was told and recomputes, so the router must not retry elsewhere
            await context.abort(grpc.StatusCode.ABORTED, f"KV push to {ready.decode_instance} failed: {e}")
        overlap = push_overlap(parts, compute_end)
        tracing.record("kv.push", span, tracing.mono_ns(parts[0].start), tracing.mono_ns(parts[-1].end),
                       {**push_attrs, **overlap}, SpanKind.CLIENT)
        self.w.metrics.transfer_bytes.labels("push").inc(overlap["kvmesh.bytes"])
        await self.handoff.announce(ready.signed(token), span)
        return parts

    async def close(self) -> None:
        await self.handoff.close()


def _first_token_only(request: EngineRequest) -> EngineRequest:
    """Prefill samples one token: the first, or a migrated request's next one after those it generated already."""
    params = dataclasses.replace(request.params, max_tokens=request.generated + 1, ignore_eos=True, stop=(),
                                 stop_token_ids=())
    return dataclasses.replace(request, params=params)


async def _attach(host: EngineHost) -> Attached:
    servicer = PrefillServicer(host)
    worker_pb2_grpc.add_PrefillServicer_to_server(servicer, host.grpc.server)
    return servicer


# The prefill role, for an engine host (``python -m services.prefill``; ``app.both`` with decode's).
ROLE = RolePlugin("kvmesh.v1.Prefill", _attach)
