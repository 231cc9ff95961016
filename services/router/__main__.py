"""``python -m services.router``: the client API (gRPC + OpenAI HTTP) in front of the engine instances. It
reads the ``[shared]``, ``[router]`` and ``[telemetry]`` settings: ``--config FILE.toml``, ``KVMESH_*`` variables
and the flags generated from their fields (``--help``; every one: docs/configuration.md)."""

from __future__ import annotations

import argparse
import asyncio
import logging
import signal
import socket
import sys

from aiohttp import web
from kvmesh import aio, settings, tls
from kvmesh.grpc_server import ServiceServer
from kvmesh.ready import EXIT_BIND, PortInUse, binding, report_failure, report_ready
from kvmesh.settings import RouterSettings, SharedSettings, TelemetrySettings
from kvmesh.telemetry import tracing

from services.router.access import AdminKey, Admission, Tenants
from services.router.core import Router
from services.router.grpc_api import KvmeshServicer, add_to_server
from services.router.http_api import InternalApi, OpenAIApi
from services.router.intake import Intake

SECTIONS = settings.ENTRY_POINT_SECTIONS["router"]
log = logging.getLogger("router")


async def serve(cfg: RouterSettings, telemetry_cfg: TelemetrySettings | None = None,
                shared: SharedSettings | None = None) -> None:
    shared = shared or SharedSettings()
    tenants, admission = Tenants.from_config(cfg), Admission.from_config(cfg)  # one set of caps for both APIs
    tracing.setup("router", "router", telemetry_cfg)
    # Both ports are bound first, so a port in use fails at once (PortInUse names the setting to change).
    # a message over the body limit is refused as it arrives, before its key is checked (not after 256 MiB)
    grpc_server = ServiceServer(["kvmesh.v1.Kvmesh"], max_receive_bytes=cfg.max_body_bytes)
    # the client-facing port has TLS of its own (public_tls_*, public_client_ca), never the mesh's certificate
    grpc_address = grpc_server.bind(cfg.host, cfg.grpc_port, "--grpc-port / KVMESH_ROUTER_GRPC_PORT",
                                    tls.public_server_credentials(cfg.public_tls_cert, cfg.public_tls_key,
                                                                  cfg.public_client_ca))
    with binding("HTTP", cfg.host, cfg.http_port, "--http-port / KVMESH_ROUTER_HTTP_PORT"):
        http_sock = socket.create_server((cfg.host, cfg.http_port),
                                         family=socket.AF_INET6 if ":" in cfg.host else socket.AF_INET)
    with binding("metrics", cfg.host, cfg.metrics_port, "--metrics-port / KVMESH_ROUTER_METRICS_PORT"):
        internal_sock = socket.create_server((cfg.host, cfg.metrics_port),
                                             family=socket.AF_INET6 if ":" in cfg.host else socket.AF_INET)
    https = tls.public_ssl_context(cfg.public_tls_cert, cfg.public_tls_key)
    http = f"{'https' if https else 'http'}://{cfg.host}:{http_sock.getsockname()[1]}"  # 0: any free port
    internal = f"http://{cfg.host}:{internal_sock.getsockname()[1]}"
    router = Router(cfg, shared)
    await router.start()
    intake = Intake(router, tenants, admission)
    admin = AdminKey.from_config(cfg)
    add_to_server(KvmeshServicer(router, intake, admin), grpc_server.server, cfg.max_body_bytes)
    await grpc_server.start()
    runner = web.AppRunner(OpenAIApi(router, intake, admin).app, access_log=None)
    await runner.setup()
    await web.SockSite(runner, http_sock, ssl_context=https).start()
    internal_runner = web.AppRunner(InternalApi(router).app, access_log=None)
    await internal_runner.setup()
    await web.SockSite(internal_runner, internal_sock).start()
    await grpc_server.set_serving(True)
    log.info("router serving gRPC on %s and HTTP on %s (metrics and instances on the internal %s); API keys %s, "
             "admin operations %s, at most %d requests in flight", grpc_address, http, internal,
             "required" if tenants.required else "off", "on" if admin.enabled else "off",
             cfg.max_concurrent_requests)
    report_ready("router", {"grpc": grpc_address, "http": http, "metrics": f"{internal}/metrics"},
                 shared.ready_file)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    await grpc_server.stop()
    await runner.cleanup()
    await internal_runner.cleanup()
    await router.stop()
    tracing.shutdown()


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="kvmesh-router", description=__doc__)
    _, cfg = settings.parse_args(p, SECTIONS, argv)
    logging.basicConfig(level=cfg.shared.log_level, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    try:
        Tenants.from_config(cfg.router)  # an unreadable or malformed api_keys_file stops here, with what to fix
    except ValueError as e:
        p.exit(2, f"{p.prog}: {e}\n")
    tls.configure(cfg.shared)
    try:
        aio.run(serve(cfg.router, cfg.telemetry, cfg.shared), cfg.shared.event_loop, cfg.shared.gc_threshold)
    except PortInUse as e:  # a fixed port someone else holds: say which setting to change, no traceback
        report_failure("router", str(e), cfg.shared.ready_file)
        sys.exit(EXIT_BIND)


if __name__ == "__main__":
    main()
