"""``python -m services.router``: the client API (gRPC + OpenAI HTTP) in front of the engine instances."""

from __future__ import annotations

import argparse
import asyncio
import logging
import signal
import socket
import sys

from aiohttp import web
from kvmesh import config
from kvmesh.grpc_server import ServiceServer
from kvmesh.ready import EXIT_BIND, READY_FILE_ENV, PortInUse, binding, report_failure, report_ready
from kvmesh.telemetry import tracing
from kvmesh.telemetry.config import TelemetryConfig

from services.router.access import Admission, Tenants
from services.router.config import RouterConfig
from services.router.core import Router
from services.router.grpc_api import KvmeshServicer, add_to_server
from services.router.http_api import OpenAIApi

log = logging.getLogger("router")


async def serve(cfg: RouterConfig, telemetry_cfg: TelemetryConfig | None = None,
                ready_file: str | None = None) -> None:
    tenants, admission = Tenants.from_config(cfg), Admission.from_config(cfg)  # one set of caps for both APIs
    tracing.setup("router", "router", telemetry_cfg)
    # Both ports are bound first, so a port in use fails at once (PortInUse names the setting to change).
    grpc_server = ServiceServer(["kvmesh.v1.Kvmesh"])
    grpc_address = grpc_server.bind(cfg.host, cfg.grpc_port, "--grpc-port / KVMESH_GRPC_PORT")
    with binding("HTTP", cfg.host, cfg.http_port, "--http-port / KVMESH_HTTP_PORT"):
        http_sock = socket.create_server((cfg.host, cfg.http_port),
                                         family=socket.AF_INET6 if ":" in cfg.host else socket.AF_INET)
    http = f"http://{cfg.host}:{http_sock.getsockname()[1]}"  # the port bound (0: any free one)
    router = Router(cfg)
    await router.start()
    add_to_server(KvmeshServicer(router, tenants, admission), grpc_server.server, cfg.max_body_bytes)
    await grpc_server.start()
    runner = web.AppRunner(OpenAIApi(router, tenants, admission).app, access_log=None)
    await runner.setup()
    await web.SockSite(runner, http_sock).start()
    await grpc_server.set_serving(True)
    log.info("router serving gRPC on %s and HTTP on %s (metrics on %s/metrics); API keys %s, at most %d "
             "requests in flight", grpc_address, http, http, "required" if tenants.required else "off",
             cfg.max_concurrent_requests)
    report_ready("router", {"grpc": grpc_address, "http": http, "metrics": f"{http}/metrics"}, ready_file)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    await grpc_server.stop()
    await runner.cleanup()
    await router.stop()
    tracing.shutdown()


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="kvmesh-router")
    p.add_argument("--config", help="TOML file with a [router] (and optionally [telemetry]) section")
    p.add_argument("--model")
    p.add_argument("--cluster")
    p.add_argument("--nats-url")
    p.add_argument("--host")
    p.add_argument("--grpc-port", type=int, help="client gRPC API port (0 = any free port)")
    p.add_argument("--http-port", type=int, help="OpenAI HTTP API and /metrics port (0 = any free port)")
    p.add_argument("--cachesvc-address")
    p.add_argument("--ready-file", help=f"once serving, write the bound endpoints here as JSON "
                                        f"(default: ${READY_FILE_ENV})")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    try:
        cfg = config.load(RouterConfig, args.config, section="router", model=args.model, cluster=args.cluster,
                          nats_url=args.nats_url, host=args.host, grpc_port=args.grpc_port,
                          http_port=args.http_port, cachesvc_address=args.cachesvc_address)
        Tenants.from_config(cfg)  # an unreadable or malformed api_keys_file stops here, with what to fix
    except ValueError as e:
        p.error(str(e))
    try:
        asyncio.run(serve(cfg, config.load(TelemetryConfig, args.config, section="telemetry"), args.ready_file))
    except PortInUse as e:  # a fixed port someone else holds: say which setting to change, no traceback
        report_failure("router", str(e), args.ready_file)
        sys.exit(EXIT_BIND)


if __name__ == "__main__":
    main()
