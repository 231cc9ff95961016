"""Command line of an engine instance: ``python -m services.prefill``, ``services.decode`` and ``app.both`` call
``main`` with the role they serve and the ``RolePlugin``s that serve it. It reads the ``[shared]``,
``[instance]``, ``[engine]`` and ``[telemetry]`` settings (flags generated from their fields)."""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Sequence

from kvmesh import aio, settings, tls
from kvmesh.instance.host import RolePlugin, serve
from kvmesh.ready import EXIT_BIND, PortInUse, report_failure

SECTIONS = settings.ENTRY_POINT_SECTIONS["prefill"]  # every engine role reads the same sections
# Where each role is served from, for the message when a process is asked for a role it cannot serve.
ENTRY_POINTS = {"prefill": "python -m services.prefill", "decode": "python -m services.decode",
                "both": "python -m app.both (kvmesh up --both N): one process serving prefill and decode is "
                        "composed in the application layer, since a service never imports another"}


def main(role: str, roles: Sequence[RolePlugin], argv: list[str] | None = None) -> None:
    """Serve ``role`` (the heartbeats' and the default instance id's) with ``roles``' servicers. A ``--role``
    or ``KVMESH_INSTANCE_ROLE`` other than ``role`` exits 2 naming the entry point that serves it."""
    p = argparse.ArgumentParser(prog=f"kvmesh-{role}")
    _, cfg = settings.parse_args(p, SECTIONS, argv, defaults={"instance": {"role": role}})
    if cfg.instance.role != role:  # --role, KVMESH_INSTANCE_ROLE or the file asked for another
        p.error(f"role {cfg.instance.role.value!r} is not served here; run {ENTRY_POINTS[cfg.instance.role]}")
    logging.basicConfig(level=cfg.shared.log_level, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    tls.configure(cfg.shared)
    try:
        aio.run(serve(cfg.instance, cfg.engine, roles, cfg.telemetry, cfg.shared), cfg.shared.event_loop,
                cfg.shared.gc_threshold)
    except PortInUse as e:  # a fixed port someone else holds: say which setting to change, no traceback
        report_failure(cfg.instance.id or role, str(e), cfg.shared.ready_file)
        sys.exit(EXIT_BIND)
