"""Command line of an engine instance: ``python -m services.prefill`` / ``services.decode`` call ``main``."""

from __future__ import annotations

import argparse
import asyncio
import logging
import sys

from kvmesh import config
from kvmesh.config import EngineConfig
from kvmesh.ready import EXIT_BIND, READY_FILE_ENV, PortInUse, report_failure
from kvmesh.telemetry.config import TelemetryConfig
from kvmesh.worker.config import WorkerConfig
from kvmesh.worker.runtime import serve


def main(default_role: str, argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog=f"kvmesh-{default_role}")
    p.add_argument("--config", help="TOML file with [worker] and [engine] sections")
    p.add_argument("--role", choices=["prefill", "decode", "both"])
    p.add_argument("--instance-id")
    p.add_argument("--cluster")
    p.add_argument("--nats-url")
    p.add_argument("--host")
    p.add_argument("--port", type=int, help="gRPC port (0 = any free port; the ready line / file names it)")
    p.add_argument("--cachesvc-address")
    p.add_argument("--transfer-backend", choices=["tcp", "shm", "mooncake"])
    p.add_argument("--model")
    p.add_argument("--threads", type=int)
    p.add_argument("--transfer-port", type=int, help="KV transfer endpoint port (0 = a free one)")
    p.add_argument("--metrics-port", type=int, help="Prometheus /metrics port (0 = a free one)")
    p.add_argument("--ready-file", help=f"once serving, write the bound endpoints here as JSON "
                                        f"(default: ${READY_FILE_ENV})")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    wcfg = config.load(WorkerConfig, args.config, section="worker", defaults={"role": default_role},
                       role=args.role, instance_id=args.instance_id, cluster=args.cluster, nats_url=args.nats_url,
                       host=args.host, port=args.port, transfer_backend=args.transfer_backend,
                       cachesvc_address=args.cachesvc_address, metrics_port=args.metrics_port,
                       transfer_port=args.transfer_port)
    ecfg = config.load(EngineConfig, args.config, section="engine", model=args.model, threads=args.threads)
    tcfg = config.load(TelemetryConfig, args.config, section="telemetry")
    try:
        asyncio.run(serve(wcfg, ecfg, tcfg, args.ready_file))
    except PortInUse as e:  # a fixed port someone else holds: say which setting to change, no traceback
        report_failure(wcfg.instance_id or wcfg.role, str(e), args.ready_file)
        sys.exit(EXIT_BIND)
