"""The Decode RPC: wait for the request's ``kv.ready``, take and verify its pushed KV, and stream tokens.

A ``kv.ready`` that does not come in time, a failed push, or KV that does not verify is not a hang: the
request falls back to computing its prompt here, and the first chunk says why."""

from __future__ import annotations

import asyncio
import logging
import time

import grpc

from kvmesh.bus import KVReady
from kvmesh.convert import sampling_from_proto
from kvmesh.keys import block_keys
from kvmesh.proto.v1 import worker_pb2, worker_pb2_grpc
from kvmesh.transfer import TransferServer

log = logging.getLogger(__name__)
EARLY_TTL_S = 60.0


class KVReadyBoard:
    """Matches ``kv.ready`` announcements with the Decode calls waiting for them (either may come first)."""

    def __init__(self) -> None:
        self._waiting: dict[str, asyncio.Future[KVReady]] = {}
        self._early: dict[str, tuple[float, KVReady]] = {}

    def post(self, ready: KVReady) -> None:
        fut = self._waiting.pop(ready.request_id, None)
        if fut is not None and not fut.done():
            fut.set_result(ready)
            return
        now = time.monotonic()
        self._early = {k: v for k, v in self._early.items() if now - v[0] < EARLY_TTL_S}
        self._early[ready.request_id] = (now, ready)

    async def wait(self, request_id: str, timeout_s: float) -> KVReady:
        early = self._early.pop(request_id, None)
        if early is not None:
            return early[1]
        fut: asyncio.Future[KVReady] = asyncio.get_running_loop().create_future()
        self._waiting[request_id] = fut
        try:
            return await asyncio.wait_for(fut, timeout_s)
        finally:
            self._waiting.pop(request_id, None)


class DecodeServicer(worker_pb2_grpc.DecodeServicer):
    def __init__(self, worker, transfer: TransferServer | None) -> None:
        self.w = worker
        self.transfer = transfer
        self.board = KVReadyBoard()
        self._background: set[asyncio.Task] = set()

    async def Decode(self, request: worker_pb2.DecodeRequest, context: grpc.aio.ServicerContext):
        work, w = request.work, self.w
        try:
            params = sampling_from_proto(work.sampling)
        except ValueError as e:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"sampling: {e}")
        prompt = list(work.prompt_token_ids)
        imported, fallback = None, ""
        if request.prefill_locally:
            await w.warm_from_pool(prompt, work.cache_salt, work.pool_blocks)
        else:
            imported, fallback = await self._receive(work.request_id, prompt, work.cache_salt,
                                                     request.kv_timeout_s or w.cfg.kv_timeout_s)
            if fallback:
                log.warning("request %s: recomputing the prompt locally: %s", work.request_id, fallback)
                w.metrics_fallbacks += 1
        first = True
        try:
            async for out in w.engine.generate(work.request_id, prompt, params, cache_salt=work.cache_salt,
                                               imported=imported, export_kv=w.pool is not None):
                chunk = worker_pb2.DecodeChunk(token_ids=out.new_token_ids, text=out.text_delta,
                                               finished=out.finished, finish_reason=out.finish_reason or "")
                if first:
                    chunk.cached_tokens = out.cached_tokens
                    chunk.kv_fallback = bool(fallback)
                    chunk.fallback_reason = fallback
                    first = False
                if out.exported is not None:  # the conversation so far, for the next turn on any instance
                    task = asyncio.create_task(w.write_back(out.exported.block_keys, out.exported.blocks))
                    self._background.add(task)
                    task.add_done_callback(self._background.discard)
                yield chunk
        except ValueError as e:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))

    async def _receive(self, request_id: str, prompt: list[int], cache_salt: str,
                       timeout_s: float) -> tuple[tuple | None, str]:
        """The pushed KV as ``(blocks, num_tokens, first_token)``, or why it cannot be used."""
        deadline = time.monotonic() + timeout_s
        try:
            ready = await self.board.wait(request_id, timeout_s)
        except asyncio.TimeoutError:
            return None, f"kv.ready not received within {timeout_s:g}s"
        if not ready.ok:
            return None, f"prefill {ready.prefill_instance}: {ready.error}"
        assert self.transfer is not None
        try:
            got = await self.transfer.take(ready.transfer_id, max(0.1, deadline - time.monotonic()))
        except asyncio.TimeoutError:
            self.transfer.discard(ready.transfer_id)
            return None, "kv.ready arrived but its blocks did not"
        except Exception as e:  # noqa: BLE001 - TransferRejected and friends: never consume, recompute
            return None, f"pushed KV rejected: {e}"
        seed = self.w.engine.engine.namespace_seed(cache_salt)
        expected = block_keys(seed, prompt[:got.num_tokens], self.w.layout.block_size)
        if got.num_tokens != len(prompt) or list(got.block_keys) != expected:
            return None, "pushed KV does not match this prompt (block keys differ)"
        return (got.blocks, got.num_tokens, ready.first_token), ""
