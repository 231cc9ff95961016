"""TLS on a kvmesh gRPC server: a mesh member (certificate signed by the mesh CA) gets in; plaintext, a client
without a certificate, and a client trusting another CA do not."""

from __future__ import annotations

import asyncio

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from kvmesh import tls
from kvmesh.grpc_server import ServiceServer
from kvmesh.settings import SharedSettings

from tests.certs import make_certs


@pytest.fixture(scope="module")
def certs(tmp_path_factory):
    return make_certs(tmp_path_factory.mktemp("certs"))


async def _check(address: str, channel: grpc.aio.Channel) -> bool:
    async with channel:
        try:
            resp = await health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=3)
            return resp.status == health_pb2.HealthCheckResponse.SERVING
        except grpc.aio.AioRpcError:
            return False


def test_only_mesh_members_reach_a_tls_server(certs):
    member = SharedSettings(tls_cert=certs["cert"], tls_key=certs["key"], tls_ca=certs["ca"])

    async def main() -> dict[str, bool]:
        server = ServiceServer(["kvmesh.test"])
        server.port = tls.add_port(server.server, "127.0.0.1:0", member)
        address = f"127.0.0.1:{server.port}"
        await server.start()
        await server.set_serving(True)
        try:
            return {
                "member": await _check(address, tls.aio_channel(address, cfg=member)),
                "plaintext": await _check(address, grpc.aio.insecure_channel(address)),
                "no client certificate": await _check(address, tls.aio_channel(address, cfg=SharedSettings(
                    tls_ca=certs["ca"]))),
                "trusts another CA": await _check(address, tls.aio_channel(address, cfg=SharedSettings(
                    tls_cert=certs["cert"], tls_key=certs["key"], tls_ca=certs["other_ca"]))),
            }
        finally:
            await server.stop(0)

    assert asyncio.run(main()) == {"member": True, "plaintext": False, "no client certificate": False,
                                   "trusts another CA": False}


def test_half_a_tls_setting_is_refused_with_what_to_fix(certs, tmp_path):
    with pytest.raises(ValueError, match="tls_cert and tls_key go together"):
        SharedSettings(tls_cert=certs["cert"])
    with pytest.raises(ValueError, match="is not a readable file"):
        SharedSettings(tls_ca=str(tmp_path / "missing.pem"))
