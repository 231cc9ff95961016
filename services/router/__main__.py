"""``python -m services.router``: the client API (gRPC + OpenAI HTTP) in front of the engine instances."""

from __future__ import annotations

import argparse
import asyncio
import logging
import signal

from aiohttp import web
from kvmesh import config
from kvmesh.grpc_server import ServiceServer
from kvmesh.telemetry import tracing
from kvmesh.telemetry.config import TelemetryConfig

from services.router.access import Admission, Tenants
from services.router.config import RouterConfig
from services.router.core import Router
from services.router.grpc_api import KvmeshServicer, add_to_server
from services.router.http_api import OpenAIApi

log = logging.getLogger("router")


async def serve(cfg: RouterConfig, telemetry_cfg: TelemetryConfig | None = None) -> None:
    tenants, admission = Tenants.from_config(cfg), Admission.from_config(cfg)  # one set of caps for both APIs
    tracing.setup("router", "router", telemetry_cfg)
    router = Router(cfg)
    await router.start()
    grpc_server = ServiceServer(["kvmesh.v1.Kvmesh"])
    add_to_server(KvmeshServicer(router, tenants, admission), grpc_server.server, cfg.max_body_bytes)
    grpc_address = grpc_server.bind(cfg.host, cfg.grpc_port)
    await grpc_server.start()
    runner = web.AppRunner(OpenAIApi(router, tenants, admission).app, access_log=None)
    await runner.setup()
    await web.TCPSite(runner, cfg.host, cfg.http_port).start()
    await grpc_server.set_serving(True)
    log.info("router serving gRPC on %s and HTTP on http://%s:%d (metrics on http://%s:%d/metrics); "
             "API keys %s, at most %d requests in flight", grpc_address, cfg.host, cfg.http_port, cfg.host,
             cfg.http_port, "required" if tenants.required else "off", cfg.max_concurrent_requests)
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
    p.add_argument("--grpc-port", type=int)
    p.add_argument("--http-port", type=int)
    p.add_argument("--cachesvc-address")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    try:
        cfg = config.load(RouterConfig, args.config, section="router", model=args.model, cluster=args.cluster,
                          nats_url=args.nats_url, host=args.host, grpc_port=args.grpc_port,
                          http_port=args.http_port, cachesvc_address=args.cachesvc_address)
        Tenants.from_config(cfg)  # an unreadable or malformed api_keys_file stops here, with what to fix
    except ValueError as e:
        p.error(str(e))
    asyncio.run(serve(cfg, config.load(TelemetryConfig, args.config, section="telemetry")))


if __name__ == "__main__":
    main()
