"""The Decode RPC: issue the push's capability, wait for the request's ``kv.ready``, take and verify its pushed
KV, and stream tokens.

The capability (a ``Grant`` of the transfer server: a token for the request's hand-off prefix, the blocks the
push may hold, the kv wait as its deadline) goes to the router in the call's initial metadata
(``PUSH_TOKEN_METADATA``) as soon as the call is accepted; the router hands it to prefill, whose every part
carries it. Anything else pushed under the request is refused by the transfer server.

A ``kv.ready`` that does not come in time, a failed push, or KV that does not verify is not a hang: the
request falls back to computing its prompt here, and the first chunk says why.

Traced as ``decode.request`` (a child of the router's span; it only waits, so it is no TTFT segment itself) with
``decode.load`` (pushed KV taken, verified and imported), ``decode.first_token`` (→ the first chunk leaves) and
``decode.generate`` (the rest of the stream, its inter-token latencies as attributes). After a fallback:
``decode.kv_fallback`` (the wait that failed, and why), then ``prefill.queue`` / ``prefill.compute`` from here."""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from collections.abc import AsyncIterator, Coroutine
from typing import Any

import grpc
from kvmesh.contracts.engine import (
    EngineRequest,
    ExportPlan,
    RequestTiming,
    engine_request_from_proto,
    logprobs_to_proto,
    prompt_length,
)
from kvmesh.engines import SequenceError
from kvmesh.instance.errors import abort_failed, refuse_continuation
from kvmesh.instance.host import Attached, EngineHost, RolePlugin
from kvmesh.instance.metrics import fallback_reason
from kvmesh.proto.v1 import worker_pb2, worker_pb2_grpc
from kvmesh.telemetry import tracing
from kvmesh.telemetry.rpc import traced_rpc
from kvmesh.transfer.receiver import Intake
from opentelemetry.trace import Span

from services.decode.faults import hang_after_tokens
from services.decode.handoff import Handoff, KVReadySubscription
from services.decode.write_back import write_back

log = logging.getLogger(__name__)
WRITE_BACK_DRAIN_S = 5.0  # how long a graceful stop waits for the write-backs in flight


class DecodeServicer(worker_pb2_grpc.DecodeServicer):
    def __init__(self, host: EngineHost) -> None:
        self.w = host
        self.kv_ready = KVReadySubscription(host)
        self._background: set[asyncio.Task] = set()

    @traced_rpc("decode.request", rpc="decode", metrics=lambda self: self.w.metrics,
                attributes=lambda self, request, context: {
                    **self.w.span_attributes(request.work, context),
                    tracing.SEGMENT: False, "kvmesh.prefill_locally": request.prefill_locally,
                    "kvmesh.tokens.prompt": prompt_length(request.work)})
    async def Decode(self, request: worker_pb2.DecodeRequest, context: grpc.aio.ServicerContext,
                     span: Span) -> AsyncIterator[worker_pb2.DecodeChunk]:
        work, w = request.work, self.w
        attrs = w.span_attributes(work, context)
        t0, t0_ns = time.monotonic(), time.time_ns()
        try:  # the conversation's blocks go back to the pool when it ends (write-back), for its next turn anywhere
            engine_request = engine_request_from_proto(work, ExportPlan() if w.pool is not None else None)
        except ValueError as e:
            w.metrics.rejections.labels("invalid").inc()
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"work: {e}")
        await refuse_continuation(context, w.engine, work)
        if engine_request.params.prompt_logprobs is not None and not request.prefill_locally:
            w.metrics.rejections.labels("invalid").inc()
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "sampling.prompt_logprobs needs prefill_locally: a "
                                "prompt's logprobs come from computing all of it here, not from pushed KV")
        handoff = None if request.prefill_locally else Handoff(w, self.kv_ready, request, engine_request, context,
                                                               span)
        pool_fetch = ""  # a local prefill's fetch from the pool: its outcome (EngineHost.warm_from_pool)
        try:
            if handoff is None:
                if request.route_reason:
                    span.set_attribute("kvmesh.route.reason", request.route_reason)
                if engine_request.session is not None:  # a warm of its context on the way: let it land first
                    await w.session_warmed(engine_request.session.key)
                scores = engine_request.params.prompt_logprobs is not None  # computes all of its prompt anyway
                warmed = await w.warm_from_pool(list(engine_request.prompt), work.cache_salt,
                                                0 if scores else work.pool_blocks, span, attrs, work.lora_name)
                intake, pool_fetch = Intake(), warmed.outcome
            else:
                intake = await handoff.receive()
                engine_request = dataclasses.replace(engine_request, imported=intake.imported)
            chunks = self._stream(request, context, span, attrs, engine_request, intake, t0, t0_ns, pool_fetch)
            if w.cfg.fault_hang_after_tokens and not work.generated_tokens:  # a fault test's dying decode
                chunks = hang_after_tokens(chunks, w.cfg.fault_hang_after_tokens, work.request_id,
                                           w.drain_started if w.cfg.fault_resume_on_drain else None)
            async for chunk in chunks:
                yield chunk
        finally:
            if handoff is not None:
                handoff.close()

    async def _stream(self, request: worker_pb2.DecodeRequest, context: grpc.aio.ServicerContext, span: Span,
                      attrs: dict[str, Any], engine_request: EngineRequest, intake: Intake, t0: float,
                      t0_ns: int, pool_fetch: str = "") -> AsyncIterator[worker_pb2.DecodeChunk]:
        """The engine's outputs as chunks, once the KV is here (or the fallback decided); the first says how the
        prompt's KV came: ``cached_tokens``, the hand-off's fallback, the pool fetch's outcome."""
        w, fallback = self.w, intake.fallback
        if fallback:
            self._fell_back(request.work.request_id, fallback, span, attrs, t0_ns)
        timing = RequestTiming()
        first, last, itls = True, 0.0, []
        # a session's output so far (with the prompt, its context for the next turn); kept only where it is used
        generated: list[int] | None = [] if engine_request.session is not None and w.pool is not None else None
        gen: Span | None = None
        # its TTFT target counts from its arrival at the router: that wait, and this call's so far
        engine_request = dataclasses.replace(engine_request,
                                             waited_s=engine_request.waited_s + time.monotonic() - t0)
        try:
            async for out in w.engine.generate(engine_request, timing):
                chunk = worker_pb2.DecodeChunk(token_ids=out.token_ids, text=out.text, finished=out.finished,
                                               finish_reason=out.finish_reason or "",
                                               logprobs=[logprobs_to_proto(lp) for lp in out.logprobs],
                                               prompt_logprobs=[logprobs_to_proto(lp) for lp in out.prompt_logprobs])
                if generated is not None:
                    generated.extend(out.token_ids)
                if out.exported is not None:  # the conversation so far, for the next turn on any instance
                    self._in_background(write_back(w, out.exported, span, attrs, engine_request.session,
                                                   request.work.pool_blocks))
                    if generated is not None:
                        context = [*engine_request.prompt, *generated][:out.exported.num_tokens]
                        w.remember_session(engine_request.session, request.work.cache_salt,
                                           request.work.lora_name, context)
                now = time.monotonic()
                if first:
                    chunk.cached_tokens = out.cached_tokens
                    chunk.kv_fallback = bool(fallback)
                    chunk.fallback_reason = fallback
                    chunk.pool_fetch = pool_fetch
                    self._first_token_spans(span, attrs, timing, engine_request.imported is not None,
                                            max(intake.received_ns, t0_ns), intake.attributes,
                                            len(engine_request.prompt), out.cached_tokens)
                    w.metrics.ttft.observe(now - t0)
                    if engine_request.imported is None:
                        w.metrics.prefix.observe(len(engine_request.prompt), out.cached_tokens)
                    gen = tracing.start("decode.generate", span, attributes={**attrs, tracing.SEGMENT: False})
                    first = False
                else:
                    itls.append(now - last)
                    w.metrics.itl.observe(now - last)
                last = now
                yield chunk
        except ValueError as e:
            w.metrics.rejections.labels("invalid").inc()
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        except SequenceError as e:  # this request failed inside the engine; the rest of its batch did not
            await abort_failed(context, e, span)
        finally:
            if gen is not None:
                gen.set_attributes(tracing.itl_attributes(itls))
                gen.end()

    def _fell_back(self, request_id: str, fallback: str, span: Span, attrs: dict[str, Any], t0_ns: int) -> None:
        """The pushed KV is not used: the prompt is recomputed here (logged, counted by reason, traced)."""
        log.warning("request %s (trace %s): recomputing the prompt locally: %s", request_id, tracing.trace_id(span),
                    fallback)
        self.w.metrics_fallbacks += 1
        self.w.metrics.fallbacks.labels(fallback_reason(fallback)).inc()
        tracing.record("decode.kv_fallback", span, t0_ns, time.time_ns(), {**attrs, "kvmesh.reason": fallback})

    def _in_background(self, work: Coroutine[Any, Any, None]) -> None:
        """Run ``work`` past the call (a write-back), kept until done so ``close`` can wait for it."""
        task = asyncio.create_task(work)
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    def _first_token_spans(self, span: Span, attrs: dict[str, Any], timing: RequestTiming, imported: bool,
                           received_ns: int, load_attrs: dict[str, Any], prompt_tokens: int,
                           cached_tokens: int) -> None:
        """The spans from ``kv.ready`` (or the fallback) to the first chunk, from the engine's timestamps."""
        if not span.is_recording():
            return
        off = time.time_ns() - time.monotonic_ns()
        if imported:
            tracing.record("decode.load", span, received_ns, off + int(timing.added * 1e9),
                           {**attrs, **load_attrs,
                            "kvmesh.engine_wait_ms": round((timing.started - timing.submitted) * 1e3, 3),
                            "kvmesh.import_ms": round((timing.added - timing.started) * 1e3, 3),
                            "kvmesh.imported": not timing.scheduled})
        if timing.scheduled:  # computed here: role both, a fallback, or no room for the pushed KV
            self.w.record_engine_spans(span, timing, attrs, prompt_tokens, cached_tokens)
        start = timing.first_output if timing.scheduled else timing.added
        tracing.start("decode.first_token", span, attributes=attrs, start_ns=off + int(start * 1e9)).end()

    async def close(self) -> None:
        """A graceful stop lets the write-backs in flight finish (the last turn of a conversation reaches the
        pool, so the next turn hits it on another instance), for at most ``WRITE_BACK_DRAIN_S``; the rest are
        cancelled (logged). The host closes its pool client after this."""
        pending = list(self._background)
        if not pending:
            return
        _, late = await asyncio.wait(pending, timeout=WRITE_BACK_DRAIN_S)
        for task in late:
            task.cancel()
        if late:
            log.warning("stopping: %d write-backs still in flight after %.0f s, cancelled", len(late),
                        WRITE_BACK_DRAIN_S)


async def _attach(host: EngineHost) -> Attached:
    servicer = DecodeServicer(host)
    worker_pb2_grpc.add_DecodeServicer_to_server(servicer, host.grpc.server)
    await host.bus.subscribe(host.subjects.kv_ready(host.instance_id), servicer.kv_ready.on_kv_ready)
    return servicer


# The decode role, for an engine host (``python -m services.decode``; ``app.both`` with prefill's).
ROLE = RolePlugin("kvmesh.v1.Decode", _attach, receives_kv=True)
