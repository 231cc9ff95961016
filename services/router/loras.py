"""LoRA adapters across the mesh, as the router sees them: which instance holds which adapter (name,
generation, path) from heartbeats and from the replies to its own load/unload calls; the generation a request's
block keys use; loading and unloading on every engine instance (vLLM's /v1/load_lora_adapter semantics), from
adapter folders under ``lora_root`` only; and loading an adapter on an instance that a request was routed to but
that lacks it, from the path this router loaded it from (or its holders' path when under ``lora_root``): never a
path a heartbeat alone advertises, which anyone on the bus could forge."""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import os
from collections import Counter
from collections.abc import Callable
from pathlib import Path

import grpc
from google.protobuf.message import Message
from kvmesh.proto.v1 import worker_pb2, worker_pb2_grpc

from services.router.errors import ErrorKind, RequestError, invalid
from services.router.registry import Instance, Registry

log = logging.getLogger(__name__)
LOAD_TIMEOUT_S = 60.0


def held(inst: Instance) -> dict[str, tuple[str, str]]:
    """``name -> (generation, path)`` of the adapters ``inst`` serves."""
    return {name: (gen, path) for name, gen, path in inst.beat.loras}


def under_root(path: str, root: str) -> str:
    """``path`` (absolute, or relative to ``root``) when it names a folder inside ``root``, ``..`` and symbolic
    links resolved; else the error says why. An empty ``root`` refuses every path."""
    if not root:
        raise RequestError(ErrorKind.FORBIDDEN, "runtime LoRA loads are off: set the router's lora_root "
                                                "(KVMESH_ROUTER_LORA_ROOT) to the folder adapters may be loaded from")
    joined = os.path.normpath(os.path.join(root, path))
    if not (Path(joined).is_relative_to(os.path.normpath(root))
            and Path(os.path.realpath(joined)).is_relative_to(os.path.realpath(root))):
        raise invalid(f"lora_path {path!r} is outside lora_root {root!r}: load adapters from folders under it")
    return joined


class Adapters:
    def __init__(self, registry: Callable[[], Registry], channel: Callable[[str], grpc.aio.Channel],
                 root: str = "") -> None:
        """``root``: the folder runtime loads (``load``) may read from ("" = none may)."""
        self._registry = registry
        self._channel = channel
        self.root = root
        self.loaded: dict[str, str] = {}  # name -> path this router's admin path loaded it from

    def engines(self) -> list[Instance]:
        return [i for i in self._registry().alive() if i.beat.role.is_engine]

    def served(self) -> dict[str, tuple[str, str]]:
        """Every adapter some live instance serves: ``name -> (generation, path)``, the generation most of
        them hold (instances disagree only for a moment, mid-reload)."""
        votes: dict[str, Counter] = {}
        for inst in self.engines():
            for name, gp in held(inst).items():
                votes.setdefault(name, Counter())[gp] += 1
        return {name: c.most_common(1)[0][0] for name, c in sorted(votes.items())}

    def lora_id(self, name: str) -> str:
        """``name@generation``: what the request's block keys are namespaced by (as every engine does)."""
        served = self.served()
        if name not in served:
            raise RequestError(ErrorKind.NOT_FOUND, self.unknown(name, served))
        return f"{name}@{served[name][0]}"

    @staticmethod
    def unknown(name: str, served: dict[str, tuple[str, str]]) -> str:
        names = ", ".join(repr(n) for n in served) or "none"
        return f"LoRA adapter {name!r} is not served here; the adapters served are {names}"

    def holds(self, inst: Instance, name: str) -> bool:
        """Whether ``inst`` serves ``name`` at the generation the request's keys use."""
        return not name or held(inst).get(name, ("", ""))[0] == self.served().get(name, ("?", ""))[0]

    def _update(self, inst: Instance, reply: worker_pb2.LoRAAdapters) -> None:
        """The instance's record as its reply says (fresher than its last heartbeat): the registry's current
        record (a heartbeat may have replaced ``inst`` during the call) and ``inst`` itself."""
        loras = tuple((a.name, a.generation, a.path) for a in reply.adapters)
        if reply.ts >= inst.loras_ts:
            inst.beat = dataclasses.replace(inst.beat, loras=loras)
            inst.loras_ts = reply.ts
        self._registry().update_loras(inst.id, loras, reply.ts)

    async def _call(self, inst: Instance, method: str, request: Message) -> worker_pb2.LoRAAdapters:
        stub = worker_pb2_grpc.AdaptersStub(self._channel(inst.beat.grpc_address))
        reply = await getattr(stub, method)(request, timeout=LOAD_TIMEOUT_S)
        self._update(inst, reply)
        return reply

    async def load(self, name: str, path: str, inplace: bool = False) -> list[str]:
        """Load ``name`` from ``path`` (under ``root``) on every engine instance; the instance ids. A bad adapter
        is refused (invalid, what to fix) and the instances keep serving what they served."""
        if not isinstance(name, str) or not name or not isinstance(path, str) or not path:
            raise invalid("lora_name and lora_path are required strings")
        path = under_root(path, self.root)
        engines = self.engines()
        if not engines:
            raise RequestError(ErrorKind.UNAVAILABLE, "no engine instances are up to load the adapter on")
        if name in self.served() and not inplace:
            raise invalid(f"the LoRA adapter {name!r} has already been loaded; unload it first, or pass "
                          f"\"load_inplace\": true to replace its weights")
        results = await asyncio.gather(*(self._call(i, "LoadLoRA", worker_pb2.LoadLoRARequest(
            lora_name=name, lora_path=path)) for i in engines), return_exceptions=True)
        bad = [(i, r) for i, r in zip(engines, results) if isinstance(r, BaseException)]
        if bad:
            ok = [i for i, r in zip(engines, results) if not isinstance(r, BaseException)]
            if ok and not inplace:  # all or nothing: the ones that took it drop it again
                await asyncio.gather(*(self._call(i, "UnloadLoRA", worker_pb2.UnloadLoRARequest(lora_name=name))
                                       for i in ok), return_exceptions=True)
            inst, err = bad[0]
            if isinstance(err, grpc.aio.AioRpcError) and err.code() == grpc.StatusCode.INVALID_ARGUMENT:
                raise invalid(err.details() or "the adapter was refused")
            detail = f"{err.code().name}: {err.details()}" if isinstance(err, grpc.aio.AioRpcError) else repr(err)
            raise RequestError(ErrorKind.UNAVAILABLE, f"instance {inst.id} could not load the adapter: {detail}")
        self.loaded[name] = path
        log.info("LoRA adapter %s loaded from %s on %d instances", name, path, len(engines))
        return [i.id for i in engines]

    async def unload(self, name: str) -> list[str]:
        """Unload ``name`` from every instance that serves it; requests in flight under it finish."""
        holders = [i for i in self.engines() if name in held(i)]
        if not holders:
            raise RequestError(ErrorKind.NOT_FOUND, self.unknown(name, self.served()))
        await asyncio.gather(*(self._call(i, "UnloadLoRA", worker_pb2.UnloadLoRARequest(lora_name=name))
                               for i in holders), return_exceptions=True)
        return [i.id for i in holders]

    async def ensure(self, inst: Instance, name: str) -> None:
        """Load ``name`` on ``inst`` (routed there, but it lacks the adapter) from the path its holders use;
        the instance's failure is retryable on another one."""
        if self.holds(inst, name):
            return
        served = self.served()
        if name not in served:
            raise RequestError(ErrorKind.NOT_FOUND, self.unknown(name, served), inst.id)
        # the path comes from this router's own loads (or lora_root), never from what a heartbeat advertises
        try:
            path = self.loaded.get(name) or under_root(served[name][1], self.root)
        except RequestError as e:
            raise RequestError(ErrorKind.UNAVAILABLE, f"instance {inst.id} lacks LoRA adapter {name!r}, and this "
                                                      f"router did not load it: {e.message}", inst.id,
                               retryable=True) from None
        try:
            await self._call(inst, "LoadLoRA", worker_pb2.LoadLoRARequest(lora_name=name, lora_path=path))
        except grpc.aio.AioRpcError as e:
            raise RequestError(ErrorKind.UNAVAILABLE, f"instance {inst.id} could not load LoRA adapter {name!r}: "
                                                      f"{e.code().name}: {e.details()}", inst.id,
                               retryable=True) from None
        log.info("LoRA adapter %s loaded on %s for a request routed there", name, inst.id)
