"""The ``Adapters`` gRPC service every engine instance serves: LoRA adapters loaded, replaced and unloaded at
run time. Files are read and validated off the engine thread; only the registration runs on it, so a slow or
bad adapter never stalls the running batch."""

from __future__ import annotations

import asyncio
import logging
import time
from typing import TYPE_CHECKING

import grpc

from kvmesh.proto.v1 import worker_pb2, worker_pb2_grpc

if TYPE_CHECKING:
    from kvmesh.instance.host import EngineHost

log = logging.getLogger(__name__)
SERVICE = "kvmesh.v1.Adapters"


def listing(engine) -> worker_pb2.LoRAAdapters:
    """What the engine serves now (run on the engine thread, after the call's change), stamped with the
    instance's clock like its heartbeats, so the router can tell a heartbeat built before the change."""
    return worker_pb2.LoRAAdapters(ts=time.time(), adapters=[
        worker_pb2.LoRAAdapter(name=s.name, generation=s.generation, path=s.path, rank=s.rank)
        for s in sorted(engine.loras.registered.values(), key=lambda s: s.name)])


class AdaptersServicer(worker_pb2_grpc.AdaptersServicer):
    def __init__(self, host: EngineHost) -> None:
        self.w = host

    async def LoadLoRA(self, request: worker_pb2.LoadLoRARequest,
                       context: grpc.aio.ServicerContext) -> worker_pb2.LoRAAdapters:
        llm = self.w.engine.engine
        t0 = time.monotonic()
        try:
            spec = await asyncio.get_running_loop().run_in_executor(None, llm.loras.read, request.lora_name,
                                                                    request.lora_path)
        except ValueError as e:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        await self.w.engine.call(lambda e: e.loras.register(spec))
        self.w.lora_load_s = time.monotonic() - t0  # the router prices loading an adapter where it is missing
        log.info("%s: LoRA adapter %s loaded from %s (generation %s, rank %d)", self.w.instance_id, spec.name,
                 spec.path, spec.generation, spec.rank)
        return await self.w.engine.call(listing)

    async def UnloadLoRA(self, request: worker_pb2.UnloadLoRARequest,
                         context: grpc.aio.ServicerContext) -> worker_pb2.LoRAAdapters:
        try:
            await self.w.engine.call(lambda e: e.unload_lora(request.lora_name))
        except KeyError:
            served = sorted(self.w.engine.engine.loras.registered) or "none"
            await context.abort(grpc.StatusCode.NOT_FOUND, f"LoRA adapter {request.lora_name!r} is not loaded; "
                                                           f"this instance serves {served}")
        log.info("%s: LoRA adapter %s unloaded", self.w.instance_id, request.lora_name)
        return await self.w.engine.call(listing)

    async def ListLoRA(self, request: worker_pb2.ListLoRARequest,
                       context: grpc.aio.ServicerContext) -> worker_pb2.LoRAAdapters:
        return await self.w.engine.call(listing)
