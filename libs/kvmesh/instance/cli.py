"""Command line of an engine instance: ``python -m services.prefill``, ``services.decode`` and ``app.both`` call
``main`` with the role they serve and the ``RolePlugin``s that serve it."""

from __future__ import annotations

import argparse
import asyncio
import logging
import sys
from collections.abc import Sequence

from kvmesh import config
from kvmesh.config import EngineConfig
from kvmesh.instance.config import WorkerConfig
from kvmesh.instance.host import RolePlugin, serve
from kvmesh.ready import EXIT_BIND, READY_FILE_ENV, PortInUse, report_failure
from kvmesh.telemetry.config import TelemetryConfig

# Where each role is served from, for the message when a process is asked for a role it cannot serve.
ENTRY_POINTS = {"prefill": "python -m services.prefill", "decode": "python -m services.decode",
                "both": "python -m app.both (kvmesh up --both N): one process serving prefill and decode is "
                        "composed in the application layer, since a service never imports another"}


def main(role: str, roles: Sequence[RolePlugin], argv: list[str] | None = None) -> None:
    """Serve ``role`` (the heartbeats' and the default instance id's) with ``roles``' servicers. A ``--role``
    or ``KVMESH_ROLE`` other than ``role`` exits 2 naming the entry point that serves it."""
    p = argparse.ArgumentParser(prog=f"kvmesh-{role}")
    p.add_argument("--config", help="TOML file with [worker] and [engine] sections")
    p.add_argument("--role", choices=list(ENTRY_POINTS), help=f"{role}, the only role served here (the default)")
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
    wcfg = config.load(WorkerConfig, args.config, section="worker", defaults={"role": role},
                       role=args.role, instance_id=args.instance_id, cluster=args.cluster, nats_url=args.nats_url,
                       host=args.host, port=args.port, transfer_backend=args.transfer_backend,
                       cachesvc_address=args.cachesvc_address, metrics_port=args.metrics_port,
                       transfer_port=args.transfer_port)
    if wcfg.role != role:  # --role, KVMESH_ROLE or the file asked for another
        p.error(f"role {wcfg.role!r} is not served here; run {ENTRY_POINTS.get(wcfg.role, wcfg.role)}")
    ecfg = config.load(EngineConfig, args.config, section="engine", model=args.model, threads=args.threads)
    tcfg = config.load(TelemetryConfig, args.config, section="telemetry")
    try:
        asyncio.run(serve(wcfg, ecfg, roles, tcfg, args.ready_file))
    except PortInUse as e:  # a fixed port someone else holds: say which setting to change, no traceback
        report_failure(wcfg.instance_id or wcfg.role, str(e), args.ready_file)
        sys.exit(EXIT_BIND)
