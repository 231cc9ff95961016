"""A grpc.aio server with what every kvmesh service carries: health checking, reflection and, inside a mesh with
mutual TLS, every call authorised by the caller's role (``kvmesh.authz``)."""

from __future__ import annotations

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from kvmesh import tls
from kvmesh.authz import Authorizer
from kvmesh.ready import binding

MAX_MESSAGE_BYTES = 256 * 1024 * 1024


class ServiceServer:
    def __init__(self, service_names: list[str], authorizer: Authorizer | None = None,
                 max_receive_bytes: int = MAX_MESSAGE_BYTES) -> None:
        """``authorizer``: checks every call's mesh role (an internal service whose process requires client
        certificates); None: any caller that gets through the port's TLS (a public port, a plaintext mesh).
        ``max_receive_bytes``: a larger request message is refused by gRPC itself (RESOURCE_EXHAUSTED) as it
        arrives, before any servicer or interceptor sees it (a public port: its body limit)."""
        self.authorizer = authorizer
        self.server = grpc.aio.server(interceptors=[authorizer] if authorizer else None,
                                      options=[("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
                                               ("grpc.max_receive_message_length", max_receive_bytes),
                                               ("grpc.so_reuseport", 0)])
        self.health = health.aio.HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.server)
        self.service_names = service_names
        reflection.enable_server_reflection([*service_names, health.SERVICE_NAME, reflection.SERVICE_NAME],
                                            self.server)
        self.port = 0

    def bind(self, host: str, port: int, setting: str = "--port / KVMESH_INSTANCE_PORT",
             credentials: object = tls.MESH) -> str:
        """Reserve the port (0 = any free one) and return ``host:port`` as bound (add servicers after this,
        before ``start``). A port that cannot be bound raises ``PortInUse`` naming ``setting``. ``credentials``:
        the port's TLS (default: this process's mesh certificate, if any; None: plaintext)."""
        with binding("gRPC", host, port, setting):
            self.port = tls.add_port(self.server, f"{host}:{port}", credentials=credentials)
            if self.port == 0:
                raise OSError(f"cannot bind gRPC to {host}:{port}")
        return f"{host}:{self.port}"

    async def start(self) -> None:
        await self.server.start()

    async def set_serving(self, serving: bool = True) -> None:
        status = health_pb2.HealthCheckResponse.SERVING if serving else health_pb2.HealthCheckResponse.NOT_SERVING
        for name in ("", *self.service_names):
            await self.health.set(name, status)

    async def stop(self, grace_s: float = 2.0) -> None:
        await self.set_serving(False)
        await self.server.stop(grace_s)
