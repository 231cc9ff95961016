"""``kvmesh config show``: the effective settings of each service (defaults < TOML file < ``KVMESH_*``
environment < flags), with where each value came from, secrets masked. A bad value fails here, at start, with
the message the service itself would give."""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import tomllib
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit, urlunsplit

from kvmesh import config
from kvmesh.config import EngineConfig
from kvmesh.instance.config import WorkerConfig
from kvmesh.telemetry.config import TelemetryConfig
from kvmesh.tls import TLSConfig

from services.cachesvc.config import CacheServiceConfig
from services.router.config import RouterConfig

# section -> its settings class; the section is also the TOML table the class is read from.
SECTIONS: dict[str, type] = {
    "engine": EngineConfig,
    "worker": WorkerConfig,
    "router": RouterConfig,
    "cachesvc": CacheServiceConfig,
    "telemetry": TelemetryConfig,
    "tls": TLSConfig,  # read from the environment only (every process, every gRPC hop)
}
# the sections each deployable service reads, its own first
SERVICE_SECTIONS: dict[str, tuple[str, ...]] = {
    "router": ("router", "telemetry", "tls"),
    "prefill": ("worker", "engine", "telemetry", "tls"),
    "decode": ("worker", "engine", "telemetry", "tls"),
    "cachesvc": ("cachesvc", "telemetry", "tls"),
}
# variables read outside the settings classes (see the README)
PROCESS_ENV = ("KVMESH_STATE_DIR", "KVMESH_CACHE_DIR", "KVMESH_LOG_LEVEL")
SECRET_FIELDS = ("api_key", "api_keys")
MASK = "***"


def settings_class(section: str) -> type:
    return SECTIONS[section]


def field_names(section: str) -> list[str]:
    return [f.name for f in dataclasses.fields(settings_class(section))]


def env_keys(service: str) -> set[str]:
    """Every ``KVMESH_*`` variable ``service`` reads."""
    keys = {f"KVMESH_{n.upper()}" for s in SERVICE_SECTIONS[service] for n in field_names(s)}
    return keys | set(PROCESS_ENV)


def load_section(section: str, path: str | Path | None = None, env: dict[str, str] | None = None,
                 overrides: dict[str, Any] | None = None, defaults: dict[str, Any] | None = None) -> Any:
    cls = settings_class(section)
    known = {f.name for f in dataclasses.fields(cls)}
    return config.load(cls, path, env, section=section, defaults=defaults,
                       **{k: v for k, v in (overrides or {}).items() if k in known})


def load_service(service: str, path: str | Path | None = None, env: dict[str, str] | None = None,
                 flags: dict[str, str] | None = None) -> dict[str, Any]:
    """The settings objects ``service`` builds at start from ``path``, ``env`` and its command-line ``flags``
    (``{"grpc_port": "8001"}``: a flag's name is its field's)."""
    if service not in SERVICE_SECTIONS:
        raise ValueError(f"unknown service {service!r}; choose one of {sorted(SERVICE_SECTIONS)}")
    out = {}
    for section in SERVICE_SECTIONS[service]:
        typed = _typed_flags(section, flags or {})
        defaults = {"role": service} if section == "worker" else None
        out[section] = load_section(section, path, env, typed, defaults)
    return out


def _typed_flags(section: str, flags: dict[str, str]) -> dict[str, Any]:
    """Command-line strings converted like environment values (the services' argparse types)."""
    types = {f.name: f.type for f in dataclasses.fields(settings_class(section))}
    out = {}
    for name, value in flags.items():
        if name in types:
            out[name] = config.coerce(f"--{name.replace('_', '-')}", value, types[name])
    return out


def sources(section: str, path: str | Path | None, env: dict[str, str]) -> dict[str, str]:
    """Where each field's effective value comes from: ``default``, ``file``, or ``env KVMESH_<FIELD>``."""
    table = tomllib.loads(Path(path).read_text()).get(section, {}) if path else {}
    out = {}
    for name in field_names(section):
        key = f"KVMESH_{name.upper()}"
        out[name] = f"env {key}" if key in env else "file" if name in table else "default"
    return out


def masked(name: str, value: Any) -> Any:
    """``value`` safe to print: secrets as ``***``, a password in a URL (``nats://user:pw@host``) likewise."""
    if name in SECRET_FIELDS and value:
        return {MASK: f"{len(value)} keys"} if isinstance(value, dict) else MASK
    if isinstance(value, str) and "://" in value and "@" in value:
        parts = urlsplit(value)
        if parts.password:
            netloc = f"{parts.username}:{MASK}@{parts.hostname}" + (f":{parts.port}" if parts.port else "")
            return urlunsplit(parts._replace(netloc=netloc))
    return value


def _toml_value(value: Any) -> str:
    if value is None:
        return '""'
    if isinstance(value, bool):
        return "true" if value else "false"
    return json.dumps(value)


def show(sections: list[str], path: str | None, env: dict[str, str], as_json: bool,
         role: str | None = None) -> str:
    """The settings of ``sections`` as TOML with each value's source (or JSON); ``role``: an engine's
    default role (prefill / decode)."""
    loaded = {s: load_section(s, path, env, defaults={"role": role} if role and s == "worker" else None)
              for s in sections}
    if as_json:
        return json.dumps({s: {k: masked(k, v) for k, v in dataclasses.asdict(cfg).items()}
                           for s, cfg in loaded.items()}, indent=2)
    lines = []
    for s, cfg in loaded.items():
        src = sources(s, path, env)
        lines.append(f"[{s}]")
        width = max(len(n) for n in src)
        for name, value in dataclasses.asdict(cfg).items():
            lines.append(f"{name:<{width}} = {_toml_value(masked(name, value)):<24} # {src[name]}")
        lines.append("")
    return "\n".join(lines).rstrip("\n")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="kvmesh config", description=__doc__)
    sub = p.add_subparsers(dest="action", required=True)
    s = sub.add_parser("show", help="print the effective settings")
    s.add_argument("--service", default="all",
                   choices=["all", *SECTIONS, *(k for k in SERVICE_SECTIONS if k not in SECTIONS)],
                   help="a settings section, a service (prefill/decode: worker, engine, telemetry), or all")
    s.add_argument("--config", help="TOML file, one table per section ([router], [worker], [engine], ...)")
    s.add_argument("--json", action="store_true", help="one JSON object: section -> settings")
    args = p.parse_args(argv)
    if args.service == "all":
        sections = list(SECTIONS)
    elif args.service in SECTIONS:
        sections = [args.service]
    else:
        sections = list(SERVICE_SECTIONS[args.service])
    role = args.service if args.service in ("prefill", "decode") else None
    try:
        print(show(sections, args.config, dict(os.environ), args.json, role))
    except (OSError, ValueError, TypeError, tomllib.TOMLDecodeError) as e:
        print(f"kvmesh config: {e}", file=sys.stderr)
        return 2
    return 0
