"""``python -m services.cachesvc``: the cache service. It reads the ``[shared]``, ``[cachesvc]`` and
``[telemetry]`` settings: ``--config FILE.toml``, ``KVMESH_*`` variables and the flags generated from their fields
(``--help``; every one: docs/configuration.md)."""

from __future__ import annotations

import argparse
import logging
import sys

from kvmesh import aio, settings, tls
from kvmesh.ready import EXIT_BIND, PortInUse, report_failure

from services.cachesvc.server import serve

SECTIONS = settings.ENTRY_POINT_SECTIONS["cachesvc"]
log = logging.getLogger("cachesvc")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m services.cachesvc", description=__doc__)
    _, cfg = settings.parse_args(parser, SECTIONS, argv)
    logging.basicConfig(stream=sys.stderr, level=cfg.shared.log_level,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    from kvmesh.telemetry import tracing

    tls.configure(cfg.shared)
    c = cfg.cachesvc
    tracing.setup("cachesvc", c.durable_name if c.shards == 1 else f"{c.durable_name}-{c.shard}", cfg.telemetry)
    try:
        aio.run(serve(cfg.cachesvc, cfg.shared), cfg.shared.event_loop, cfg.shared.gc_threshold)
    except PortInUse as e:  # a fixed port someone else holds: say which setting to change
        report_failure("cachesvc", str(e), cfg.shared.ready_file)
        return EXIT_BIND
    except (ConnectionError, OSError, RuntimeError) as e:
        log.error("cannot serve: %s", e)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
