"""``kvmesh config show``: the effective settings of every section (defaults < TOML file < ``KVMESH_*``
environment < flags), with where each value came from, secrets masked. ``--json`` prints
``{section: {field: {"value": ..., "source": ..., "env": "KVMESH_..."}}}`` (:func:`kvmesh.settings.show`); the
text view is the same data as TOML. A bad value, an unknown or renamed variable fails here, at start, with the
message the service itself would give."""

from __future__ import annotations

import argparse
import json
import os
import sys
import tomllib
from typing import Any

from kvmesh import settings


def _toml_value(value: Any) -> str:
    if value is None:
        return '""'
    if isinstance(value, bool):
        return "true" if value else "false"
    return json.dumps(value)


def text(shown: dict[str, dict[str, dict[str, Any]]]) -> str:
    """``show``'s data as TOML, each value's source (and its variable) as a comment."""
    lines = []
    for section, fields in shown.items():
        lines.append(f"[{section}]")
        width = max(len(n) for n in fields)
        for name, item in fields.items():
            where = {"env": f"env {item['env']}"}.get(item["source"], item["source"])
            lines.append(f"{name:<{width}} = {_toml_value(item['value']):<24} # {where}")
        lines.append("")
    return "\n".join(lines).rstrip("\n")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="kvmesh config", description=__doc__)
    sub = p.add_subparsers(dest="action", required=True)
    s = sub.add_parser("show", help="print the effective settings")
    s.add_argument("--service", default="all", choices=["all", *settings.SECTIONS, *settings.ENTRY_POINT_SECTIONS],
                   help="all sections (default), one section, or the sections one service reads "
                        "(its defaults applied: an engine's role)")
    s.add_argument("--config", help="TOML file, one [section] table per section (docs/configuration.md)")
    s.add_argument("--json", action="store_true",
                   help='one JSON object: {section: {field: {"value", "source", "env"}}}')
    args = p.parse_args(argv)
    try:
        shown = settings.show(args.config, dict(os.environ), defaults=settings.entry_point_defaults(args.service))
    except (settings.SettingsError, OSError, tomllib.TOMLDecodeError) as e:
        print(f"kvmesh config: {e}", file=sys.stderr)
        return 2
    if args.service in settings.ENTRY_POINT_SECTIONS:
        shown = {k: v for k, v in shown.items() if k in ("shared", *settings.ENTRY_POINT_SECTIONS[args.service])}
    elif args.service != "all":
        shown = {args.service: shown[args.service]}
    print(json.dumps(shown, indent=2) if args.json else text(shown))
    return 0
