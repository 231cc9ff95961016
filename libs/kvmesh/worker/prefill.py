"""The Prefill RPC: compute the prompt's KV (reusing the local prefix cache), sample the first token, push the
KV to the decode instance through the transfer engine, then announce it on ``kv.ready.<decode>``."""

from __future__ import annotations

import dataclasses
import logging
import time

import grpc

from kvmesh.bus import KVReady
from kvmesh.convert import layout_to_dict, sampling_from_proto
from kvmesh.proto.v1 import worker_pb2, worker_pb2_grpc
from kvmesh.transfer import TransferClient

log = logging.getLogger(__name__)


class PrefillServicer(worker_pb2_grpc.PrefillServicer):
    def __init__(self, worker) -> None:
        self.w = worker
        self.transfer = TransferClient()

    async def Prefill(self, request: worker_pb2.PrefillRequest, context: grpc.aio.ServicerContext):
        work, w = request.work, self.w
        if not request.decode_instance or not request.decode_transfer_address:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                                "decode_instance and decode_transfer_address are required")
        try:
            params = dataclasses.replace(sampling_from_proto(work.sampling), max_tokens=1, ignore_eos=True,
                                         stop=(), stop_token_ids=())
        except ValueError as e:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"sampling: {e}")
        t0 = time.monotonic()
        await w.warm_from_pool(list(work.prompt_token_ids), work.cache_salt, work.pool_blocks)
        final = None
        try:
            async for out in w.engine.generate(work.request_id, list(work.prompt_token_ids), params,
                                               cache_salt=work.cache_salt, export_kv=True):
                final = out
        except ValueError as e:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        compute_s = time.monotonic() - t0
        assert final is not None and final.exported is not None
        kv = final.exported
        first_token = final.new_token_ids[0]
        transfer_id = f"{work.request_id}@{w.instance_id}"
        ready = KVReady(request_id=work.request_id, decode_instance=request.decode_instance,
                        transfer_id=transfer_id, block_keys=tuple(kv.block_keys), num_tokens=kv.num_tokens,
                        first_token=first_token, layout=layout_to_dict(w.layout), prefill_instance=w.instance_id)
        try:
            stats = await self.transfer.push(request.decode_transfer_address, transfer_id, w.layout, kv.blocks,
                                             kv.block_keys, kv.num_tokens)
        except Exception as e:  # noqa: BLE001 - any push failure is reported to decode, which recomputes
            log.warning("request %s: KV push to %s failed: %s", work.request_id, request.decode_instance, e)
            await w.announce(dataclasses.replace(ready, ok=False, error=f"KV push failed: {e}"))
            await context.abort(grpc.StatusCode.UNAVAILABLE,
                                f"KV push to {request.decode_instance} failed: {e}")
        if w.cfg.fault_drop_kv_ready:
            log.warning("request %s: fault injection: kv.ready dropped", work.request_id)
        else:
            await w.announce(ready)
        return worker_pb2.PrefillResponse(first_token=first_token, cached_tokens=final.cached_tokens,
                                          num_blocks=int(kv.blocks.shape[0]), transfer_bytes=stats.nbytes,
                                          transfer_s=stats.seconds, transfer_id=transfer_id, compute_s=compute_s)

    async def close(self) -> None:
        await self.transfer.close()
