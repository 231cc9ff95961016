"""The Decode RPC: wait for the request's ``kv.ready``, take and verify its pushed KV, and stream tokens.

A ``kv.ready`` that does not come in time, a failed push, or KV that does not verify is not a hang: the
request falls back to computing its prompt here, and the first chunk says why.

Traced as ``decode.request`` (a child of the router's span; it only waits, so it is no TTFT segment itself) with
``decode.load`` (pushed KV taken, verified and imported), ``decode.first_token`` (→ the first chunk leaves) and
``decode.generate`` (the rest of the stream, its inter-token latencies as attributes). After a fallback:
``decode.kv_fallback`` (the wait that failed, and why), then ``prefill.queue`` / ``prefill.compute`` from here."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator
from typing import Any

import grpc
from opentelemetry.trace import Span

from kvmesh.contracts.keys import block_keys
from kvmesh.contracts.messages import KVReady
from kvmesh.contracts.sampling import sampling_from_proto
from kvmesh.engine.async_engine import RequestTiming
from kvmesh.engine.errors import SequenceError
from kvmesh.engine.kv_cache import blocks_from_bytes
from kvmesh.proto.v1 import worker_pb2, worker_pb2_grpc
from kvmesh.telemetry import tracing
from kvmesh.telemetry.rpc import traced_rpc
from kvmesh.transfer import TransferServer
from kvmesh.worker.metrics import fallback_reason

log = logging.getLogger(__name__)
EARLY_TTL_S = 60.0


class KVReadyBoard:
    """Matches ``kv.ready`` announcements with the Decode calls waiting for them (either may come first).
    Each announcement travels with the time it was received (epoch ns)."""

    def __init__(self) -> None:
        self._waiting: dict[str, asyncio.Future[tuple[KVReady, int]]] = {}
        self._early: dict[str, tuple[float, KVReady, int]] = {}

    def post(self, ready: KVReady, received_ns: int | None = None) -> None:
        received_ns = time.time_ns() if received_ns is None else received_ns
        fut = self._waiting.pop(ready.request_id, None)
        if fut is not None and not fut.done():
            fut.set_result((ready, received_ns))
            return
        now = time.monotonic()
        self._early = {k: v for k, v in self._early.items() if now - v[0] < EARLY_TTL_S}
        self._early[ready.request_id] = (now, ready, received_ns)

    async def wait(self, request_id: str, timeout_s: float) -> tuple[KVReady, int]:
        early = self._early.pop(request_id, None)
        if early is not None:
            return early[1], early[2]
        fut: asyncio.Future[tuple[KVReady, int]] = asyncio.get_running_loop().create_future()
        self._waiting[request_id] = fut
        try:
            return await asyncio.wait_for(fut, timeout_s)
        finally:
            self._waiting.pop(request_id, None)


async def abort_failed(context: grpc.aio.ServicerContext, e: SequenceError, span: Span) -> None:
    """End the call of a request that failed inside the engine: INVALID_ARGUMENT when the request is at
    fault, INTERNAL (logged, with its trace) when we are; the details name the request."""
    if not e.client_fault:
        log.error("%s (trace %s)", e, tracing.trace_id(span))
    await context.abort(grpc.StatusCode.INVALID_ARGUMENT if e.client_fault else grpc.StatusCode.INTERNAL, str(e))


class DecodeServicer(worker_pb2_grpc.DecodeServicer):
    def __init__(self, worker, transfer: TransferServer | None) -> None:
        self.w = worker
        self.transfer = transfer
        self.board = KVReadyBoard()
        self._background: set[asyncio.Task] = set()

    @traced_rpc("decode.request", rpc="decode", metrics=lambda self: self.w.metrics,
                attributes=lambda self, request, context: {
                    **self.w.span_attributes(request.work.request_id, request.work.cache_salt),
                    tracing.SEGMENT: False, "kvmesh.prefill_locally": request.prefill_locally,
                    "kvmesh.tokens.prompt": len(request.work.prompt_token_ids)})
    async def Decode(self, request: worker_pb2.DecodeRequest, context: grpc.aio.ServicerContext,
                     span: Span) -> AsyncIterator[worker_pb2.DecodeChunk]:
        work, w = request.work, self.w
        attrs = w.span_attributes(work.request_id, work.cache_salt)
        t0, t0_ns = time.monotonic(), time.time_ns()
        try:
            params = sampling_from_proto(work.sampling)
        except ValueError as e:
            w.metrics.rejections.labels("invalid").inc()
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"sampling: {e}")
        prompt = list(work.prompt_token_ids)
        imported, fallback, received_ns, load_attrs = None, "", 0, {}
        if request.prefill_locally:
            await w.warm_from_pool(prompt, work.cache_salt, work.pool_blocks, span, attrs)
        else:
            imported, fallback, received_ns, load_attrs = await self._receive(
                work.request_id, prompt, work.cache_salt, request.kv_timeout_s or w.cfg.kv_timeout_s)
            if fallback:
                log.warning("request %s (trace %s): recomputing the prompt locally: %s", work.request_id,
                            tracing.trace_id(span), fallback)
                w.metrics_fallbacks += 1
                w.metrics.fallbacks.labels(fallback_reason(fallback)).inc()
                tracing.record("decode.kv_fallback", span, t0_ns, time.time_ns(),
                               {**attrs, "kvmesh.reason": fallback})
        timing = RequestTiming()
        first, last, itls = True, 0.0, []
        gen: Span | None = None
        try:
            async for out in w.engine.generate(work.request_id, prompt, params, timing=timing,
                                               cache_salt=work.cache_salt, imported=imported,
                                               export_kv=w.pool is not None):
                chunk = worker_pb2.DecodeChunk(token_ids=out.new_token_ids, text=out.text_delta,
                                               finished=out.finished, finish_reason=out.finish_reason or "")
                if out.exported is not None:  # the conversation so far, for the next turn on any instance
                    task = asyncio.create_task(w.write_back(out.exported.block_keys, out.exported.blocks, span,
                                                            attrs))
                    self._background.add(task)
                    task.add_done_callback(self._background.discard)
                now = time.monotonic()
                if first:
                    chunk.cached_tokens = out.cached_tokens
                    chunk.kv_fallback = bool(fallback)
                    chunk.fallback_reason = fallback
                    self._first_token_spans(span, attrs, timing, imported is not None, max(received_ns, t0_ns),
                                            load_attrs, len(prompt), out.cached_tokens)
                    w.metrics.ttft.observe(now - t0)
                    if imported is None:
                        w.metrics.prefix.observe(len(prompt), out.cached_tokens)
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

    async def _receive(self, request_id: str, prompt: list[int], cache_salt: str,
                       timeout_s: float) -> tuple[tuple | None, str, int, dict[str, Any]]:
        """The pushed KV as ``(blocks, num_tokens, first_token)`` or why it cannot be used, when ``kv.ready``
        was received (epoch ns, 0 = never), and what ``decode.load`` reports about the intake."""
        deadline = time.monotonic() + timeout_s
        try:
            ready, received_ns = await self.board.wait(request_id, timeout_s)
        except TimeoutError:
            return None, f"kv.ready not received within {timeout_s:g}s", 0, {}
        if not ready.ok:
            return None, f"prefill {ready.prefill_instance}: {ready.error}", received_ns, {}
        assert self.transfer is not None
        t = time.monotonic()
        try:
            got = await self.transfer.take(ready.transfer_id, max(0.1, deadline - time.monotonic()))
        except TimeoutError:
            self.transfer.discard(ready.transfer_id)
            return None, "kv.ready arrived but its blocks did not", received_ns, {}
        except Exception as e:  # noqa: BLE001 - TransferRejected and friends: never consume, recompute
            return None, f"pushed KV rejected: {e}", received_ns, {}
        self.w.metrics.transfer_bytes.labels("receive").inc(got.nbytes)
        seed = self.w.engine.engine.namespace_seed(cache_salt)
        expected = block_keys(seed, prompt[:got.num_tokens], self.w.layout.block_size)
        if got.num_tokens != len(prompt) or list(got.block_keys) != expected:
            return None, "pushed KV does not match this prompt (block keys differ)", received_ns, {}
        return (blocks_from_bytes(got.layout, got.data), got.num_tokens, ready.first_token), "", received_ns, {
            "kvmesh.blocks": got.num_blocks, "kvmesh.bytes": got.nbytes,
            "kvmesh.take_ms": round((time.monotonic() - t) * 1e3, 3),
            "kvmesh.receive_ms": round(got.seconds * 1e3, 3), "kvmesh.prefill_instance": ready.prefill_instance}
