"""Decode's side of a PD hand-off: the request's ``kvmesh.transfer.receiver.Receiver`` (grant → pin → reserve →
``kv.ready`` → parts verified → ``ImportedKV`` or why the prompt is recomputed) wired to this instance: its engine,
transfer server, settings and metrics, the grant sent in the Decode call's initial metadata, and the ``kv.ready``
subscription that feeds the receivers' board (``KVReadySubscription``)."""

from __future__ import annotations

import time

import grpc
from kvmesh.bus.trace_headers import trace_context
from kvmesh.contracts.engine import EngineRequest
from kvmesh.contracts.ids import HELD_BLOCKS_METADATA, PUSH_TOKEN_METADATA, TRANSFER_VERSIONS_METADATA, handoff_prefix
from kvmesh.contracts.messages import KVReady, Message
from kvmesh.engines.convert import convert_import
from kvmesh.instance.host import EngineHost
from kvmesh.proto.v1 import worker_pb2
from kvmesh.telemetry import tracing
from kvmesh.transfer import Grant, TransferServer
from kvmesh.transfer.receiver import Intake, KVReadyBoard, NothingToWaitFor, ReceiveCounters, Receiver
from opentelemetry.trace import Span, SpanKind


class KVReadySubscription:
    """This instance's ``kv.ready`` subject: each announcement traced (``kv.ready``, from when prefill sent it)
    and posted on the board the receivers wait on."""

    def __init__(self, host: EngineHost) -> None:
        self.w = host
        self.board = KVReadyBoard()

    async def on_kv_ready(self, msg: Message, headers: dict[str, str]) -> None:
        if not isinstance(msg, KVReady):  # only prefill's kv.ready goes to this subject
            return
        received = time.time_ns()
        try:
            sent = int(headers.get(tracing.SENT_HEADER, received))
        except ValueError:
            sent = received
        tracing.record("kv.ready", trace_context(headers), min(sent, received), received,
                       {tracing.REQUEST_ID: msg.request_id, tracing.MODEL: self.w.model_name,
                        "kvmesh.instance": self.w.instance_id,
                        "kvmesh.prefill_instance": msg.prefill_instance, "kvmesh.ok": msg.ok,
                        "kvmesh.blocks": len(msg.block_keys)}, SpanKind.CONSUMER)
        self.board.post(msg, received)


class Handoff:
    """One Decode call's receiver, its grant sent in the call's initial metadata. ``close`` always runs once the
    request's stream ended."""

    def __init__(self, host: EngineHost, ready: KVReadySubscription, request: worker_pb2.DecodeRequest,
                 engine_request: EngineRequest, context: grpc.aio.ServicerContext, span: Span) -> None:
        self.w, self.ready, self.request, self.engine_request = host, ready, request, engine_request
        self.context, self.span = context, span
        self.receiver: Receiver | None = None

    async def receive(self) -> Intake:
        """What became of the push. An adapter this instance does not serve, or nothing to wait for, aborts the
        call with INVALID_ARGUMENT."""
        w, work = self.w, self.request.work
        try:  # under the adapter's name@generation: KV pushed under another generation never matches
            namespace = w.engine.namespace(work.cache_salt, work.lora_name)
        except ValueError as e:  # nothing to wait for
            await self._invalid(str(e))
        metrics = w.metrics
        self.receiver = Receiver(
            self._transfer(), self.ready.board, w.engine, self.engine_request, namespace, w.layout,
            convertible=w.convertible, convert=convert_import, in_place=w.cfg.receive_in_place,
            counters=ReceiveCounters(metrics.transfer_bytes.labels("receive").inc,
                                     metrics.transfer_bytes.labels("receive_in_place").inc,
                                     lambda why: metrics.kv_ready_dropped.labels(why).inc()))
        self.span.set_attributes({"kvmesh.cached_blocks": self.request.cached_blocks})
        wait_s = self.request.kv_timeout_s or w.cfg.kv_timeout_s + 2 * self.request.expected_prefill_s
        try:
            return await self.receiver.receive(wait_s, self._send_grant)
        except NothingToWaitFor as e:
            await self._invalid(str(e))
            raise  # (abort raised already)
        finally:
            self.span.set_attributes(self.receiver.attributes)

    def close(self) -> None:
        if self.receiver is not None:
            self.receiver.close()

    async def _send_grant(self, grant: Grant, held_blocks: int) -> None:
        await self.context.send_initial_metadata(((PUSH_TOKEN_METADATA, grant.token),
                                                  (TRANSFER_VERSIONS_METADATA, str(self._transfer().versions)),
                                                  (HELD_BLOCKS_METADATA, str(held_blocks))))

    async def _invalid(self, why: str) -> None:
        self._transfer().discard_prefix(handoff_prefix(self.request.work.request_id))
        self.w.metrics.rejections.labels("invalid").inc()
        await self.context.abort(grpc.StatusCode.INVALID_ARGUMENT, why)

    def _transfer(self) -> TransferServer:
        assert self.w.transfer_server is not None  # RolePlugin(receives_kv=True): the host started one
        return self.w.transfer_server
