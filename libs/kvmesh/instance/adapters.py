"""The ``Adapters`` gRPC service every engine instance serves: LoRA adapters loaded, replaced and unloaded at
run time, through the engine's seam (which reads and checks the files without stalling the running batch)."""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING

import grpc

from kvmesh.engines import Engine
from kvmesh.proto.v1 import worker_pb2, worker_pb2_grpc

if TYPE_CHECKING:
    from kvmesh.instance.host import EngineHost

log = logging.getLogger(__name__)
SERVICE = "kvmesh.v1.Adapters"


def listing(engine: Engine) -> worker_pb2.LoRAAdapters:
    """What the engine serves now (after the call's change), stamped with the instance's clock like its
    heartbeats, so the router can tell a heartbeat built before the change."""
    return worker_pb2.LoRAAdapters(ts=time.time(), adapters=[
        worker_pb2.LoRAAdapter(name=a.name, generation=a.generation, path=a.path, rank=a.rank)
        for a in engine.adapters()])


class AdaptersServicer(worker_pb2_grpc.AdaptersServicer):
    def __init__(self, host: EngineHost) -> None:
        self.w = host

    async def LoadLoRA(self, request: worker_pb2.LoadLoRARequest,
                       context: grpc.aio.ServicerContext) -> worker_pb2.LoRAAdapters:
        t0 = time.monotonic()
        try:
            info = await self.w.engine.load_lora(request.lora_name, request.lora_path)
        except ValueError as e:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        self.w.lora_load_s = time.monotonic() - t0  # the router prices loading an adapter where it is missing
        log.info("%s: LoRA adapter %s loaded from %s (generation %s, rank %d)", self.w.instance_id, info.name,
                 info.path, info.generation, info.rank)
        return listing(self.w.engine)

    async def UnloadLoRA(self, request: worker_pb2.UnloadLoRARequest,
                         context: grpc.aio.ServicerContext) -> worker_pb2.LoRAAdapters:
        try:
            await self.w.engine.unload_lora(request.lora_name)
        except KeyError:
            served = [a.name for a in self.w.engine.adapters()] or "none"
            await context.abort(grpc.StatusCode.NOT_FOUND, f"LoRA adapter {request.lora_name!r} is not loaded; "
                                                           f"this instance serves {served}")
        log.info("%s: LoRA adapter %s unloaded", self.w.instance_id, request.lora_name)
        return listing(self.w.engine)

    async def ListLoRA(self, request: worker_pb2.ListLoRARequest,
                       context: grpc.aio.ServicerContext) -> worker_pb2.LoRAAdapters:
        return listing(self.w.engine)
