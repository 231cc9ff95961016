"""Every internal RPC authorised by the caller's mesh role (``kvmesh.identity``), as a gRPC server interceptor.

The flows the design has, and no others (``RULES``; a method not listed is refused):

- the router asks cachesvc ``MatchPrefix`` (or ``MatchPrefixBatch``) and calls engines' ``Prefill`` /
  ``Decode``; it alone (with an admin tool's certificate) reaches an engine's ``Adapters``, from its admin path,
  which checks the admin key first;
- engines put, get, grant and lease blocks on cachesvc;
- a (re)started cachesvc shard lists and gets, from the other shards, the blocks it lost (``ListBlocks``, which
  names every key a shard holds, is for shards alone);
- an ``admin`` certificate (operators' tools) may also read ``Stats`` and use reflection; any mesh certificate may
  ask ``Health``.

Installed only where the process requires client certificates (``kvmesh.tls.mutual``); with TLS explicitly off
(plaintext) servers behave as before. A refused call ends UNAUTHENTICATED (no mesh identity) or PERMISSION_DENIED
(the wrong role) with what to fix, is counted by method (``refused``) and logged.
"""

from __future__ import annotations

import inspect
import logging
from collections import Counter
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import grpc

from kvmesh.identity import Identity, MeshRole, of_peer

log = logging.getLogger(__name__)

R, A, C = MeshRole.ROUTER, MeshRole.ADMIN, MeshRole.CACHESVC
ENGINES = frozenset({MeshRole.PREFILL, MeshRole.DECODE, MeshRole.BOTH})
EVERYONE = frozenset(MeshRole)

# method prefix (a whole service ends with "/") -> the roles that may call it
RULES: dict[str, frozenset[MeshRole]] = {
    "/kvmesh.v1.CacheService/MatchPrefix": frozenset({R, A}),
    "/kvmesh.v1.CacheService/MatchPrefixBatch": frozenset({R, A}),
    # engines too: a sharded pool's view (its shard count and copies) comes from it
    "/kvmesh.v1.CacheService/Stats": frozenset({R, A, *ENGINES}),
    "/kvmesh.v1.CacheService/PutBlocks": ENGINES,
    "/kvmesh.v1.CacheService/GetBlocks": frozenset({*ENGINES, C}),  # a shard: the copies it lost (repair)
    "/kvmesh.v1.CacheService/ListBlocks": frozenset({C}),
    "/kvmesh.v1.CacheService/GrantPut": ENGINES,
    "/kvmesh.v1.CacheService/LeaseBlocks": ENGINES,
    "/kvmesh.v1.CacheService/ReleaseLease": ENGINES,
    "/kvmesh.v1.Prefill/": frozenset({R}),
    "/kvmesh.v1.Decode/": frozenset({R}),
    "/kvmesh.v1.Adapters/": frozenset({R, A}),
    "/grpc.health.v1.Health/": EVERYONE,
    "/grpc.reflection.v1alpha.ServerReflection/": frozenset({A}),
}


def allowed(method: str) -> frozenset[MeshRole]:
    """The roles that may call ``method`` (``/package.Service/Method``); empty: nobody."""
    service = method[:method.rfind("/") + 1]
    return RULES.get(method, RULES.get(service, frozenset()))


def caller(context: grpc.aio.ServicerContext) -> Identity | None:
    """The mesh identity of the peer of a call (None on a plaintext server)."""
    try:
        return of_peer(context.auth_context())
    except ValueError:
        return None


class Authorizer(grpc.aio.ServerInterceptor):
    """The interceptor; ``refused``: calls refused, by method, since start (a metric reads it)."""

    def __init__(self, service: str) -> None:
        self.service = service
        self.refused: Counter[str] = Counter()

    def refusal(self, method: str, context: grpc.aio.ServicerContext) -> tuple[grpc.StatusCode, str] | None:
        """Why the call may not go on (None: it may)."""
        try:
            who = of_peer(context.auth_context())
        except ValueError as e:
            return grpc.StatusCode.UNAUTHENTICATED, f"{self.service}: {e}"
        if who is None:
            return grpc.StatusCode.UNAUTHENTICATED, (
                f"{self.service} takes calls from mesh members only: present a certificate signed by the mesh CA "
                f"that names spiffe://kvmesh/<role>/<instance> (KVMESH_TLS_CERT / KVMESH_TLS_KEY)")
        roles = allowed(method)
        if who.role not in roles:
            may = ", ".join(sorted(roles)) or "no role (not a mesh RPC)"
            return grpc.StatusCode.PERMISSION_DENIED, (
                f"{self.service}: {method} is not for {who}: the roles that may call it are {may}")
        return None

    def _refuse(self, method: str, context: grpc.aio.ServicerContext, code: grpc.StatusCode, why: str) -> None:
        key = method.lstrip("/").removeprefix("kvmesh.v1.")
        self.refused[key] += 1
        n = self.refused[key]
        if n & (n - 1) == 0:  # the 1st, 2nd, 4th, 8th... of a method: a flood does not flood the log
            log.warning("refused %s from %s (%s; %d so far): %s", method, context.peer(), code.name, n, why)

    async def intercept_service(self, continuation: Callable[[grpc.HandlerCallDetails],
                                                             Awaitable[grpc.RpcMethodHandler]],
                                handler_call_details: grpc.HandlerCallDetails) -> grpc.RpcMethodHandler:
        handler = await continuation(handler_call_details)
        if handler is None:
            return handler
        method = handler_call_details.method
        if handler.unary_unary is not None:
            return grpc.unary_unary_rpc_method_handler(self._unary(method, handler.unary_unary),
                                                       handler.request_deserializer, handler.response_serializer)
        if handler.unary_stream is not None:
            return grpc.unary_stream_rpc_method_handler(self._stream(method, handler.unary_stream),
                                                        handler.request_deserializer, handler.response_serializer)
        if handler.stream_unary is not None:
            return grpc.stream_unary_rpc_method_handler(self._unary(method, handler.stream_unary),
                                                        handler.request_deserializer, handler.response_serializer)
        return grpc.stream_stream_rpc_method_handler(self._stream(method, handler.stream_stream),
                                                     handler.request_deserializer, handler.response_serializer)

    async def _check(self, method: str, context: grpc.aio.ServicerContext) -> None:
        refusal = self.refusal(method, context)
        if refusal is not None:
            self._refuse(method, context, *refusal)
            await context.abort(*refusal)

    def _unary(self, method: str, behavior: Callable[..., Any]) -> Callable[..., Awaitable[Any]]:
        async def unary(request: Any, context: grpc.aio.ServicerContext) -> Any:
            await self._check(method, context)
            return await behavior(request, context)
        return unary

    def _stream(self, method: str, behavior: Callable[..., Any]) -> Callable[..., Any]:
        if inspect.isasyncgenfunction(behavior):
            async def stream(request: Any, context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
                await self._check(method, context)
                async for item in behavior(request, context):
                    yield item
            return stream

        async def writes(request: Any, context: grpc.aio.ServicerContext) -> Any:  # context.write() style
            await self._check(method, context)
            return await behavior(request, context)
        return writes
