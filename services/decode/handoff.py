"""The receiving side of one PD hand-off, owned by one object for the whole of a Decode call:

1. the push's capability (a ``Grant`` of the transfer server: the request's hand-off parts, the blocks the push may
   hold, the kv wait as its deadline), sent to the router in the call's initial metadata at once, with the blocks
   held here (prefill pushes only past them), before any engine command, so the router's Prefill call leaves as
   early as it would without one;
2. those held blocks pinned until the import (``Engine.pin``);
3. blocks reserved for the push to land in (``Reservation``; a part that arrives before is buffered);
4. ``kv.ready`` awaited (only one MACed under the grant's token and naming this request's transfer: a forged one is
   dropped and counted) and the parts taken and verified (``KVIntake``); the grant revoked;
5. what became of it: ``Intake`` (the KV to import, or why the prompt is recomputed here).

``close`` always runs once the request's stream ended (after the request was added, its sequence holds its own
references): the grant revoked, the reservation released unless the import adopted it, the pin dropped."""

from __future__ import annotations

import time

import grpc
from kvmesh.contracts.engine import EngineRequest
from kvmesh.contracts.ids import HELD_BLOCKS_METADATA, PUSH_TOKEN_METADATA, NamespaceSeed, handoff_prefix
from kvmesh.instance.host import EngineHost
from kvmesh.proto.v1 import worker_pb2
from kvmesh.transfer import Grant, TransferServer
from opentelemetry.trace import Span

from services.decode.intake import Intake, KVIntake
from services.decode.reservation import Reservation


class HandoffReceiver:
    def __init__(self, host: EngineHost, intake: KVIntake, request: worker_pb2.DecodeRequest,
                 engine_request: EngineRequest, context: grpc.aio.ServicerContext, span: Span) -> None:
        self.w, self.intake, self.request, self.engine_request = host, intake, request, engine_request
        self.context, self.span = context, span
        self.request_id = request.work.request_id
        self.grant: Grant | None = None
        self.reservation: Reservation | None = None
        self.pin_asked = False  # from then on the lease may be held, even if the call is cancelled

    async def receive(self) -> Intake:
        """Steps 1 to 5 (module docstring). An adapter this instance does not serve, or nothing to wait for,
        aborts the call with INVALID_ARGUMENT."""
        w, work, prompt = self.w, self.request.work, list(self.engine_request.prompt)
        try:  # under the adapter's name@generation: KV pushed under another generation never matches
            namespace = w.engine.namespace(work.cache_salt, work.lora_name)
        except ValueError as e:  # nothing to wait for
            self._transfer().discard_prefix(handoff_prefix(self.request_id))
            w.metrics.rejections.labels("invalid").inc()
            await self.context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        # what this instance holds of the prompt now, not what the index says (it lags when turns come back to
        # back): prefill pushes from the first block decode lacks, at least the last token's
        first = w.engine.holds(namespace, prompt, (len(prompt) - 1) // w.layout.block_size)
        wait_s = self.request.kv_timeout_s or w.cfg.kv_timeout_s + 2 * self.request.expected_prefill_s
        deadline = time.monotonic() + wait_s
        self.grant = await self._issue(first, len(prompt), wait_s)
        self.span.set_attributes({"kvmesh.cached_blocks": self.request.cached_blocks, "kvmesh.held_blocks": first})
        pinned = await self._pin(namespace, prompt, first)
        if pinned >= first:  # else the push cannot be used anyway (intake says why)
            self.reservation = Reservation(w, self.engine_request, first)
            await self.reservation.acquire()
            self.span.set_attribute("kvmesh.reserved_blocks", len(self.reservation.block_ids))
        intake = await self.intake.receive(self.request_id, prompt, namespace, deadline - time.monotonic(), pinned,
                                           self.reservation, self.grant.token)
        self._revoke()  # taken, or given up on: nothing more is pushed
        if intake.imported is None and self.reservation is not None:  # recomputed: its blocks are needed now
            self.reservation.release()
        return intake

    def close(self) -> None:
        """Revoke, release, unpin (idempotent)."""
        self._revoke()
        if self.reservation is not None:  # nothing lands any more; its blocks freed unless the import adopted them
            self.reservation.release()
        if self.pin_asked:  # a call cancelled while it waited gets no count back, but the engine may have pinned
            self.w.engine.unpin(self.request_id)
            self.pin_asked = False

    async def _issue(self, first_block: int, prompt_tokens: int, wait_s: float) -> Grant:
        """Step 1: the grant, to the router at once."""
        end = -(-prompt_tokens // self.w.layout.block_size)
        try:
            grant = self._transfer().grant(handoff_prefix(self.request_id), first_block, end, wait_s)
        except ValueError as e:  # no block to push: an empty prompt, a wait of 0
            self.w.metrics.rejections.labels("invalid").inc()
            await self.context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"nothing to wait for: {e}")
        await self.context.send_initial_metadata(((PUSH_TOKEN_METADATA, grant.token),
                                                  (HELD_BLOCKS_METADATA, str(first_block))))
        return grant

    async def _pin(self, namespace: NamespaceSeed, prompt: list[int], first: int) -> int:
        """Step 2: the blocks held here, kept until imported (prefill pushes only past them)."""
        if not first:
            return 0
        self.pin_asked = True
        pinned = await self.w.engine.pin(self.request_id, namespace, prompt, first)
        self.span.set_attribute("kvmesh.pinned_blocks", pinned)
        return pinned

    def _revoke(self) -> None:
        if self.grant is not None and self.w.transfer_server is not None:
            self.w.transfer_server.revoke(handoff_prefix(self.request_id), self.grant)
        self.grant = None

    def _transfer(self) -> TransferServer:
        assert self.w.transfer_server is not None  # RolePlugin(receives_kv=True): the host started one
        return self.w.transfer_server
