"""Services bind the port they are given: 0 means any free port, and they report the one they bound (ready line
and ready file, ``kvmesh.ready``); a fixed port that is taken fails at once with the setting to change."""

from __future__ import annotations

import os
import subprocess
import sys
import uuid
from pathlib import Path

import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from kvmesh import tls
from kvmesh.bus import NatsServer
from kvmesh.ready import EXIT_BIND, ServiceFailed, wait_ready
from kvmesh.settings import SharedSettings
from kvmesh.state import StackInfo

from app.launcher import Stack, StackOptions
from tests.ports import taken_port

REPO = Path(__file__).resolve().parents[2]


def spawn(module: str, args: list[str], tmp_path: Path) -> tuple[subprocess.Popen[bytes], Path, Path]:
    ready, log = tmp_path / f"{module}.ready.json", tmp_path / f"{module}.log"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO / "libs"), str(REPO),
                                                         os.environ.get("PYTHONPATH", "")])}
    with open(log, "wb") as out:
        proc = subprocess.Popen([sys.executable, "-m", module, *args, "--ready-file", str(ready)], cwd=REPO,
                                env=env, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
    return proc, ready, log


def stop(proc: subprocess.Popen[bytes]) -> None:
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def serving(address: str, cfg: SharedSettings | None = None) -> bool:
    """Health SERVING at ``address``; ``cfg``: the TLS to dial it with (a stack's mesh_settings())."""
    with tls.channel(address, cfg=cfg or SharedSettings()) as ch:
        reply = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=5)
    return reply.status == health_pb2.HealthCheckResponse.SERVING


def test_cachesvc_on_port_0_reports_the_ports_it_bound(nats_server: NatsServer, tmp_path: Path) -> None:
    cluster = f"ports{uuid.uuid4().hex[:8]}"
    args = ["--port", "0", "--transfer-port", "0", "--metrics-port", "0", "--nats-url", nats_server.url,
            "--cluster", cluster]
    proc, ready_path, log = spawn("services.cachesvc", args, tmp_path)
    try:
        ready = wait_ready(ready_path, proc, "cachesvc", log, timeout_s=60)
        grpc_address, transfer, metrics = (ready.endpoints[k] for k in ("grpc", "transfer", "metrics"))
        assert grpc_address.startswith("127.0.0.1:") and int(grpc_address.rsplit(":", 1)[1]) > 0
        assert serving(grpc_address)  # the reported port is the one serving
        assert transfer.startswith("tcp://127.0.0.1:") and metrics.startswith("http://127.0.0.1:")
        assert f"cachesvc ready: grpc={grpc_address} transfer={transfer} metrics={metrics}" in log.read_text()
    finally:
        stop(proc)


def test_cachesvc_on_a_taken_port_fails_fast_naming_the_setting(nats_server: NatsServer, tmp_path: Path) -> None:
    with taken_port() as port:  # bound and listening here for the whole test: not a race
        proc, ready_path, log = spawn("services.cachesvc", ["--port", str(port), "--nats-url", nats_server.url],
                                      tmp_path)
        try:
            with pytest.raises(ServiceFailed) as failed:
                wait_ready(ready_path, proc, "cachesvc", log, timeout_s=60)
            assert proc.wait(20) == EXIT_BIND
        finally:
            stop(proc)
    message = f"gRPC port {port} is in use on 127.0.0.1: set --port / KVMESH_CACHESVC_PORT (0 = any free port)"
    assert str(failed.value) == f"cachesvc: {message}"
    assert message in log.read_text() and "Traceback" not in log.read_text()


@pytest.mark.parametrize("which", ["http", "grpc"])
def test_the_router_on_a_taken_port_fails_fast_naming_the_setting(which: str, tmp_path: Path) -> None:
    with taken_port() as port:
        other = "0"
        args = ["--http-port", str(port), "--grpc-port", other] if which == "http" else \
            ["--http-port", other, "--grpc-port", str(port)]
        # the ports are bound before NATS or the model are touched: neither is needed to fail
        proc, ready_path, log = spawn("services.router", [*args, "--nats-url", "nats://127.0.0.1:1"], tmp_path)
        try:
            with pytest.raises(ServiceFailed) as failed:
                wait_ready(ready_path, proc, "router", log, timeout_s=60)
            assert proc.wait(20) == EXIT_BIND
        finally:
            stop(proc)
    setting = "--http-port / KVMESH_ROUTER_HTTP_PORT" if which == "http" else \
        "--grpc-port / KVMESH_ROUTER_GRPC_PORT"
    what = "HTTP" if which == "http" else "gRPC"
    assert str(failed.value) == f"router: {what} port {port} is in use on 127.0.0.1: set {setting} " \
                                "(0 = any free port)"
    assert "Traceback" not in log.read_text()


def test_a_stack_on_port_0_writes_the_addresses_its_services_bound(tmp_path: Path) -> None:
    stack = Stack(tmp_path, StackOptions.local("ports", prefill=0, decode=0))
    info = stack.start(timeout_s=120)  # NATS, cachesvc and the router: each on a port it chose
    try:
        assert StackInfo.read(tmp_path) == info
        assert info.router_http == stack.router_http and stack.http_port > 0
        assert info.router_grpc == stack.router_grpc == info.endpoints["router"]["grpc"] and serving(info.router_grpc)
        assert serving(info.endpoints["cachesvc"]["grpc"], stack.mesh_settings())
        router_env = stack.service("router").env  # cachesvc's actual address, passed on with the new names
        assert router_env["KVMESH_ROUTER_CACHESVC_ADDRESS"] == info.endpoints["cachesvc"]["grpc"]
        assert info.nats_url == stack.nats.url and stack.nats.port > 0
    finally:
        stack.stop()


def test_a_stack_whose_router_port_is_taken_says_which_setting_to_change(tmp_path: Path) -> None:
    with taken_port() as port:
        stack = Stack(tmp_path, StackOptions.local(
            "ports", prefill=0, decode=0, settings={"router": {"grpc_port": port}}))
        with pytest.raises(ServiceFailed, match=f"^router: gRPC port {port} is in use on 127.0.0.1: set "
                                                "--grpc-port / KVMESH_ROUTER_GRPC_PORT \\(0 = any free port\\)$"):
            stack.start(timeout_s=120)
    assert not (tmp_path / "stack.json").exists() and all(s.proc.poll() is not None for s in stack.services)
