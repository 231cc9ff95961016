"""Docker HEALTHCHECK of every kvmesh image: asks the address docker/entrypoint.py put in the service's
environment (``HEALTHCHECK_ADDRESS``): gRPC health SERVING for kvmesh services, an INFO line with JetStream on
for nats-server. Exit 0 = healthy, 1 = not (with the reason on stdout, which ``docker inspect`` shows)."""

from __future__ import annotations

import socket
import sys
from pathlib import Path
from urllib.parse import urlsplit


def target() -> str:
    environ = Path("/proc/1/environ").read_bytes().split(b"\0")
    for item in environ:
        key, _, value = item.decode(errors="replace").partition("=")
        if key == "HEALTHCHECK_ADDRESS":
            return value
    raise RuntimeError("HEALTHCHECK_ADDRESS is not set: start the container through docker/entrypoint.py")


def check_grpc(address: str) -> str | None:
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc
    from kvmesh import tls  # the container's own mesh certificate (KVMESH_TLS_*), when it has one

    try:
        with tls.channel(address) as ch:
            resp = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=3.0)
    except grpc.RpcError as e:
        return f"gRPC health of {address}: {e.code().name}"
    if resp.status != health_pb2.HealthCheckResponse.SERVING:
        return f"gRPC health of {address}: {health_pb2.HealthCheckResponse.ServingStatus.Name(resp.status)}"
    return None


def check_nats(host: str, port: int) -> str | None:
    try:
        with socket.create_connection((host, port), timeout=3.0) as s:
            info = s.recv(4096)
    except OSError as e:
        return f"nats-server on {host}:{port}: {e}"
    if not info.startswith(b"INFO ") or b'"jetstream":true' not in info:
        return f"nats-server on {host}:{port} answers without JetStream: {info[:120]!r}"
    return None


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
        url = urlsplit(target())
        if url.scheme == "nats":
            problem = check_nats(url.hostname or "127.0.0.1", url.port or 4222)
        elif url.scheme == "ready":
            problem = check_grpc(ready_grpc_address(url.path))
        else:
            problem = check_grpc(url.netloc)
    except (OSError, RuntimeError, ValueError) as e:
        problem = str(e)
    if problem:
        print(problem)
        return 1
    print("healthy")
    return 0


if __name__ == "__main__":
    sys.exit(main())
