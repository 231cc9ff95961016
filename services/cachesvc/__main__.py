"""``python -m services.cachesvc [--config FILE] [--port N] [--nats-url URL] [--cluster C]
[--transfer-backend tcp|shm|mooncake] [--transfer-port N] [--metrics-port N] [--ready-file PATH]``"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import sys

from kvmesh.ready import EXIT_BIND, READY_FILE_ENV, PortInUse, report_failure

from services.cachesvc.config import load_config
from services.cachesvc.server import serve

log = logging.getLogger("cachesvc")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m services.cachesvc", description=__doc__)
    parser.add_argument("--config", help="TOML file; settings are read from its [cachesvc] table")
    parser.add_argument("--port", type=int, help="gRPC port (0 = any free port)")
    parser.add_argument("--nats-url", help="NATS server URL, e.g. nats://127.0.0.1:4222")
    parser.add_argument("--cluster", help="cluster name: the kvmesh.<cluster>.* subjects")
    parser.add_argument("--transfer-backend", help="the transfer endpoint's backend: tcp, shm or mooncake")
    parser.add_argument("--transfer-port", type=int, help="the transfer endpoint's port (0 = any free port)")
    parser.add_argument("--metrics-port", type=int, help="Prometheus /metrics port (0 = any free port)")
    parser.add_argument("--ready-file", help=f"once serving, write the bound endpoints here as JSON "
                                             f"(default: ${READY_FILE_ENV})")
    args = parser.parse_args(argv)
    logging.basicConfig(stream=sys.stderr, level=os.environ.get("KVMESH_LOG_LEVEL", "INFO").upper(),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        cfg = load_config(args.config, port=args.port, nats_url=args.nats_url, cluster=args.cluster,
                          transfer_backend=args.transfer_backend, transfer_port=args.transfer_port,
                          metrics_port=args.metrics_port)
    except (OSError, ValueError) as e:
        log.error("bad settings: %s", e)
        return 2
    from kvmesh import config
    from kvmesh.telemetry import tracing
    from kvmesh.telemetry.config import TelemetryConfig

    tracing.setup("cachesvc", cfg.durable_name, config.load(TelemetryConfig, args.config, section="telemetry"))
    try:
        asyncio.run(serve(cfg, args.ready_file))
    except PortInUse as e:  # a fixed port someone else holds: say which setting to change
        report_failure("cachesvc", str(e), args.ready_file)
        return EXIT_BIND
    except (ConnectionError, OSError, RuntimeError) as e:
        log.error("cannot serve: %s", e)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
