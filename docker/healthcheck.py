"""Docker HEALTHCHECK of every kvmesh image: asks the address docker/entrypoint.py put in the service's
environment (``HEALTHCHECK_ADDRESS``): gRPC health SERVING for kvmesh services, an INFO line with JetStream on
for nats-server. Exit 0 = healthy, 1 = not (with the reason on stdout, which ``docker inspect`` shows). A service
with a certificate (``KVMESH_TLS_CERT``) is asked over mutual TLS with its own certificate, verified against
``KVMESH_TLS_CA`` as ``KVMESH_TLS_SERVER_NAME`` (Kubernetes' exec probes, deploy/k8s/components/tls); so is a
nats-server that asks for TLS (compose's), which gets a TLS handshake after its INFO."""

from __future__ import annotations

import socket
import sys
from pathlib import Path
from typing import TYPE_CHECKING
from urllib.parse import urlsplit

if TYPE_CHECKING:
    import grpc


def service_environ() -> dict[str, str]:
    """The environment of the service (PID 1: the entrypoint execs it), not this probe's."""
    items = Path("/proc/1/environ").read_bytes().split(b"\0")
    return dict(item.decode(errors="replace").partition("=")[::2] for item in items if item)


def target(env: dict[str, str]) -> str:
    if "HEALTHCHECK_ADDRESS" not in env:
        raise RuntimeError("HEALTHCHECK_ADDRESS is not set: start the container through docker/entrypoint.py")
    return env["HEALTHCHECK_ADDRESS"]


def channel(address: str, env: dict[str, str]) -> grpc.Channel:
    import grpc

    mode = env.get("HEALTHCHECK_TLS", "mesh")
    if mode == "public":  # the router's client-facing port: its own certificate (a client CA it may require is
        # not the probe's to satisfy: set none there and probe HTTP /health instead)
        return grpc.secure_channel(address, grpc.ssl_channel_credentials(
            Path(env["KVMESH_ROUTER_PUBLIC_TLS_CERT"]).read_bytes()))
    if mode == "none" or not env.get("KVMESH_TLS_CERT"):
        return grpc.insecure_channel(address)
    ca = Path(env["KVMESH_TLS_CA"]).read_bytes() if env.get("KVMESH_TLS_CA") else None
    creds = grpc.ssl_channel_credentials(ca, Path(env["KVMESH_TLS_KEY"]).read_bytes(),
                                         Path(env["KVMESH_TLS_CERT"]).read_bytes())
    name = env.get("KVMESH_TLS_SERVER_NAME")
    return grpc.secure_channel(address, creds, [("grpc.ssl_target_name_override", name)] if name else None)


def check_grpc(address: str, env: dict[str, str]) -> str | None:
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    try:
        with channel(address, env) as ch:
            resp = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=3.0)
    except grpc.RpcError as e:
        return f"gRPC health of {address}: {e.code().name}"
    if resp.status != health_pb2.HealthCheckResponse.SERVING:
        return f"gRPC health of {address}: {health_pb2.HealthCheckResponse.ServingStatus.Name(resp.status)}"
    return None


def check_nats(host: str, port: int, env: dict[str, str]) -> str | None:
    """Its INFO line says JetStream is on; a server that asks for TLS (compose's: mutual, a user per certificate)
    must then complete the handshake with the container's own certificate (``KVMESH_TLS_*``: nats-server's), which
    checks its certificate and key as clients will, and leaves nothing in its log above debug (a client that
    stops after INFO is logged as a TLS handshake error)."""
    import ssl

    try:
        with socket.create_connection((host, port), timeout=3.0) as s:
            info = s.recv(4096)
            if not info.startswith(b"INFO ") or b'"jetstream":true' not in info:
                return f"nats-server on {host}:{port} answers without JetStream: {info[:120]!r}"
            if b'"tls_required":true' not in info:
                return None
            if not env.get("KVMESH_TLS_CERT"):
                return (f"nats-server on {host}:{port} asks for TLS: give its container KVMESH_TLS_CERT / KEY / CA "
                        "(its own certificate) to probe it")
            context = ssl.create_default_context(cafile=env.get("KVMESH_TLS_CA") or None)
            context.load_cert_chain(env["KVMESH_TLS_CERT"], env.get("KVMESH_TLS_KEY") or None)
            with context.wrap_socket(s, server_hostname=env.get("KVMESH_TLS_SERVER_NAME") or host):
                return None
    except OSError as e:  # ssl.SSLError included
        return f"nats-server on {host}:{port}: {e}"


def ready_grpc_address(path: str) -> str:
    """The gRPC address a service wrote to its ready file once serving (kvmesh.ready), through loopback."""
    import json

    try:
        address = json.loads(Path(path).read_text())["endpoints"]["grpc"]
    except FileNotFoundError:
        raise RuntimeError(f"not ready yet: {path} does not exist") from None
    host, _, port = address.rpartition(":")
    return f"127.0.0.1:{port}" if host in ("0.0.0.0", "", "[::]") else address


def main() -> int:
    try:
        env = service_environ()
        url = urlsplit(target(env))
        if url.scheme == "nats":
            problem = check_nats(url.hostname or "127.0.0.1", url.port or 4222, env)
        elif url.scheme == "ready":
            problem = check_grpc(ready_grpc_address(url.path), env)
        else:
            problem = check_grpc(url.netloc, env)
    except (OSError, RuntimeError, ValueError) as e:
        problem = str(e)
    if problem:
        print(problem)
        return 1
    print("healthy")
    return 0


if __name__ == "__main__":
    sys.exit(main())
