"""What each entry point reads: its sections (besides ``shared``, its own first) and the defaults it sets
before the file and the environment. One home for the services' entry points, ``kvmesh config show`` and the
container entrypoint (docker/entrypoint.py), which checks a service's settings before it execs the service."""

from __future__ import annotations

import argparse
from collections.abc import Mapping
from typing import Any

from kvmesh.settings.load import Settings, add_flags, flag_overrides, load

ENTRY_POINT_SECTIONS: dict[str, tuple[str, ...]] = {
    "router": ("router", "telemetry"),
    "prefill": ("instance", "engine", "telemetry"),
    "decode": ("instance", "engine", "telemetry"),
    "both": ("instance", "engine", "telemetry"),
    "cachesvc": ("cachesvc", "telemetry"),
}


def entry_point_defaults(service: str) -> dict[str, dict[str, Any]]:
    """What the entry point of ``service`` sets before the file and the environment (an engine's role)."""
    return {"instance": {"role": service}} if service in ("prefill", "decode", "both") else {}


def load_entry_point(service: str, argv: list[str], env: Mapping[str, str]) -> Settings:
    """The settings ``service`` builds at start from ``env`` and its command line ``argv`` (``--config`` and its
    generated flags; other arguments are ignored). A :class:`kvmesh.settings.SettingsError` (a ValueError)
    names what is wrong."""
    if service not in ENTRY_POINT_SECTIONS:
        raise ValueError(f"unknown service {service!r}; choose one of {sorted(ENTRY_POINT_SECTIONS)}")
    parser = argparse.ArgumentParser(add_help=False, exit_on_error=False)
    parser.add_argument("--config")
    add_flags(parser, ENTRY_POINT_SECTIONS[service])
    try:
        args, _ = parser.parse_known_args(argv)
    except argparse.ArgumentError as e:
        raise ValueError(str(e)) from None
    return load(ENTRY_POINT_SECTIONS[service], path=args.config, env=env, overrides=flag_overrides(args),
                defaults=entry_point_defaults(service))
