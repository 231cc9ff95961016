"""Loading the sections: field defaults < entry-point defaults < TOML file (one ``[section]`` table each) <
environment < explicit overrides (command-line flags), with each value's source kept for ``config show`` and for
the message of a value that fails."""

from __future__ import annotations

import argparse
import difflib
import functools
import os
import tomllib
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple, cast
from urllib.parse import urlsplit, urlunsplit

from pydantic import TypeAdapter, ValidationError
from pydantic_settings import EnvSettingsSource

from kvmesh.settings.sections import (
    SECTIONS,
    CacheServiceSettings,
    EngineSettings,
    InstanceSettings,
    RouterSettings,
    Section,
    SharedSettings,
    TelemetrySettings,
)

MASK = "***"

# The flat names read before sections had their own, and what replaced each (a name that set several
# sections' fields now has one variable per section), plus the kernel switches the engine read from the
# environment before they were [engine] settings. Frozen history: do not add to it.
RENAMED: dict[str, tuple[str, ...]] = {
    "KVMESH_NATIVE_GEMM": ("KVMESH_ENGINE_NATIVE_GEMM",),
    "KVMESH_NATIVE_POINTWISE": ("KVMESH_ENGINE_NATIVE_POINTWISE",),
    **{f"KVMESH_{f.upper()}": (f"KVMESH_ENGINE_{f.upper()}",) for f in (
        "device", "dtype", "threads", "attention", "kv_cache_mb", "num_blocks", "kv_dtype", "host_cache_mb",
        "enable_prefix_caching", "max_batched_tokens", "max_num_seqs", "max_model_len")},
    **{f"KVMESH_{f.upper()}": (f"KVMESH_INSTANCE_{f.upper()}",) for f in (
        "role", "pool_fetch_min_blocks", "heartbeat_s", "fault_drop_kv_ready",
        "fault_corrupt_pushes", "fault_stall_pushes")},
    **{f"KVMESH_{f.upper()}": (f"KVMESH_ROUTER_{f.upper()}",) for f in (
        "model_name", "grpc_port", "http_port", "match_timeout_s", "request_timeout_s", "policy", "slo_ttft_s",
        "prefill_tok_per_s", "api_key", "api_keys", "api_keys_file", "max_body_bytes", "max_concurrent_requests",
        "max_requests_per_tenant")},
    **{f"KVMESH_{f.upper()}": (f"KVMESH_CACHESVC_{f.upper()}",) for f in (
        "durable_name", "pool_capacity_mb", "max_message_mb", "disk_dir", "disk_capacity_mb", "disk_segment_mb",
        "max_lease_s", "snapshot_timeout_s", "external", "external_capacity_mb", "mooncake_master",
        "mooncake_metadata_url", "mooncake_host", "mooncake_segment_mb", "mooncake_replicas",
        "mooncake_manifest_s", "transfer_timeout_s", "transfer_buffer_mb", "max_transfer_mb")},
    **{f"KVMESH_{f.upper()}": (f"KVMESH_TELEMETRY_{f.upper()}",) for f in (
        "tracing", "trace_file", "trace_sample_ratio", "trace_flush_ms")},
    "KVMESH_MODEL": ("KVMESH_ENGINE_MODEL", "KVMESH_ROUTER_MODEL"),
    "KVMESH_BLOCK_SIZE": ("KVMESH_ENGINE_BLOCK_SIZE", "KVMESH_ROUTER_BLOCK_SIZE"),
    "KVMESH_EVICTION": ("KVMESH_ENGINE_EVICTION", "KVMESH_CACHESVC_POOL_EVICTION"),
    "KVMESH_HOST": ("KVMESH_INSTANCE_HOST", "KVMESH_ROUTER_HOST", "KVMESH_CACHESVC_HOST"),
    "KVMESH_PORT": ("KVMESH_INSTANCE_PORT", "KVMESH_CACHESVC_PORT"),
    "KVMESH_METRICS_PORT": ("KVMESH_INSTANCE_METRICS_PORT", "KVMESH_CACHESVC_METRICS_PORT"),
    "KVMESH_TRANSFER_BACKEND": ("KVMESH_INSTANCE_TRANSFER_BACKEND", "KVMESH_CACHESVC_TRANSFER_BACKEND"),
    "KVMESH_TRANSFER_PORT": ("KVMESH_INSTANCE_TRANSFER_PORT", "KVMESH_CACHESVC_TRANSFER_PORT"),
    "KVMESH_CACHESVC_ADDRESS": ("KVMESH_INSTANCE_CACHESVC_ADDRESS", "KVMESH_ROUTER_CACHESVC_ADDRESS"),
    "KVMESH_KV_TIMEOUT_S": ("KVMESH_INSTANCE_KV_TIMEOUT_S",),
    "KVMESH_INSTANCE_TIMEOUT_S": ("KVMESH_ROUTER_INSTANCE_TIMEOUT_S", "KVMESH_CACHESVC_INSTANCE_TIMEOUT_S"),
}
# KVMESH_* variables that are not settings: compose-file interpolation and CI switches, never read by a service.
NOT_SETTINGS = frozenset({"KVMESH_TAG", "KVMESH_BASE_IMAGE", "KVMESH_HTTP_PUBLISH", "KVMESH_GRPC_PUBLISH",
                          "KVMESH_NATS_PORT", "KVMESH_CI_DOCKER", "KVMESH_CI_VLLM"})
# old TOML tables and where their keys went
RENAMED_TABLES = {"worker": "instance", "tls": "shared"}


class Source(NamedTuple):
    kind: str    # default | file | env | flag
    where: str   # "" (default), "<path> [section] field", "KVMESH_...", "--flag"

    def describe(self, section: str, field: str) -> str:
        return self.where or f"the default of {section}.{field}"


class SettingsError(ValueError):
    """Settings that cannot be used; ``problems`` holds one line each, naming where the value came from."""

    def __init__(self, problems: list[str]) -> None:
        self.problems = problems
        super().__init__("invalid settings:\n  " + "\n  ".join(problems) if len(problems) > 1 else problems[0])


@functools.cache
def env_names() -> dict[str, tuple[str, str]]:
    """Every variable a section reads -> (section, field). Two fields with one variable is a bug: ValueError."""
    out: dict[str, tuple[str, str]] = {}
    for section, cls in SECTIONS.items():
        for field in cls.model_fields:
            name = cls.env_name(field)
            if name in out:
                raise ValueError(f"{name} would set both {'.'.join(out[name])} and {section}.{field}")
            out[name] = (section, field)
    return out


def check_environment(env: Mapping[str, str]) -> None:
    """Stop on a ``KVMESH_*`` variable that no section reads, naming what replaced it (or what is close)."""
    known = env_names()
    problems = []
    for key in sorted(k for k in env if k.upper().startswith("KVMESH_")):
        name = key.upper()
        if name in known or name in NOT_SETTINGS:
            continue
        if name.endswith("_FILE") and name[:-len("_FILE")] in known:  # a docker secret file (docker/entrypoint)
            continue
        if name in RENAMED:
            new = RENAMED[name]
            where = " or ".join(f"{n} ({known[n][0]})" for n in new)
            problems.append(f"{key} is no longer read: set {where}")
        else:
            close = difflib.get_close_matches(name, list(known), n=1, cutoff=0.8)
            hint = f"; did you mean {close[0]}?" if close else ""
            problems.append(f"{key} is not a kvmesh setting{hint} (every one: docs/configuration.md)")
    if problems:
        raise SettingsError(problems)


class _EnvSource(EnvSettingsSource):
    """pydantic-settings' environment source over a given mapping instead of ``os.environ``."""

    def __init__(self, cls: type[Section], env: Mapping[str, str]) -> None:
        self._given = env
        super().__init__(cls)

    def _load_env_vars(self) -> Mapping[str, str | None]:
        return {k.lower(): v for k, v in self._given.items()}  # the sections' names are not case-sensitive


def _is_text(cls: type[Section], field: str) -> bool:
    return cls.model_fields[field].annotation in (str, str | None) or cls.enum_of(field) is not None


def _from_env(cls: type[Section], env: Mapping[str, str]) -> dict[str, Any]:
    """The fields ``env`` sets; an empty variable for a number, boolean or table means "not set"."""
    values = _EnvSource(cls, env)()
    return {k: v for k, v in values.items() if v != "" or _is_text(cls, k)}


@functools.cache
def _strict(cls: type[Section], field: str) -> TypeAdapter[Any]:
    """What a file's value for ``field`` must be: its type (for an enum: a string, whose choice the section
    checks)."""
    if cls.enum_of(field) is not None:
        return TypeAdapter(str)
    return TypeAdapter(cls.model_fields[field].rebuild_annotation())


def read_file(path: str | Path) -> dict[str, dict[str, Any]]:
    """The TOML file's tables, each key checked against its section (unknown ones stop with the known keys) and
    of its field's type (a file says what it means: ``block_size = "16"`` is an error, not a coercion)."""
    data = tomllib.loads(Path(path).read_text())
    problems, out = [], {}
    for table, values in data.items():
        if table not in SECTIONS:
            moved = f"; its settings are in [{RENAMED_TABLES[table]}] now" if table in RENAMED_TABLES else ""
            problems.append(f"{path}: unknown section [{table}]{moved}; the sections are {list(SECTIONS)}")
            continue
        if not isinstance(values, dict):
            problems.append(f"{path}: {table} = {values!r}: settings go in a [{table}] table")
            continue
        cls = SECTIONS[table]
        for key, value in values.items():
            if key not in cls.model_fields:
                elsewhere = [s for s, c in SECTIONS.items() if key in c.model_fields]
                moved = f" ({key} is in {', '.join(f'[{s}]' for s in elsewhere)})" if elsewhere else ""
                problems.append(f"{path} [{table}]: unknown key {key!r}{moved}; [{table}] has "
                                f"{sorted(cls.model_fields)}")
                continue
            try:
                _strict(cls, key).validate_python(value, strict=True)
            except ValidationError as e:
                shown = MASK if cls.is_secret(key) else repr(value)
                problems.append(f"{path} [{table}] {key} = {shown}: {e.errors()[0]['msg']}")
        out[table] = dict(values)
    if problems:
        raise SettingsError(problems)
    return out


class FlagValues(dict[str, dict[str, Any]]):
    """Overrides from parsed flags: ``{section: {field: value}}``, plus each one's flag for messages."""

    def __init__(self) -> None:
        super().__init__()
        self.flags: dict[tuple[str, str], str] = {}


@dataclass(frozen=True)
class Settings:
    """The loaded sections (``shared`` always) and where each field's value came from."""

    sections: Mapping[str, Section]
    sources: Mapping[str, Mapping[str, Source]]

    def __getitem__(self, name: str) -> Section:
        try:
            return self.sections[name]
        except KeyError:
            raise KeyError(f"section {name!r} was not loaded; loaded: {list(self.sections)}") from None

    @property
    def shared(self) -> SharedSettings:
        return cast(SharedSettings, self["shared"])

    @property
    def engine(self) -> EngineSettings:
        return cast(EngineSettings, self["engine"])

    @property
    def instance(self) -> InstanceSettings:
        return cast(InstanceSettings, self["instance"])

    @property
    def router(self) -> RouterSettings:
        return cast(RouterSettings, self["router"])

    @property
    def cachesvc(self) -> CacheServiceSettings:
        return cast(CacheServiceSettings, self["cachesvc"])

    @property
    def telemetry(self) -> TelemetrySettings:
        return cast(TelemetrySettings, self["telemetry"])


def load(sections: Iterable[str] | None = None, *, path: str | Path | None = None,
         env: Mapping[str, str] | None = None, overrides: Mapping[str, Mapping[str, Any]] | None = None,
         defaults: Mapping[str, Mapping[str, Any]] | None = None, check_env: bool = True) -> Settings:
    """``shared`` and ``sections`` (None: all) from field defaults < ``defaults`` (an entry point's, e.g.
    ``{"instance": {"role": "prefill"}}``) < the TOML file ``path`` < ``env`` (default ``os.environ``) <
    ``overrides`` (``{section: {field: value}}``, e.g. :func:`flag_overrides`; None values are ignored).
    A :class:`SettingsError` lists every unknown variable, unknown file key and bad value, each with its source."""
    names = ["shared", *(s for s in (SECTIONS if sections is None else sections) if s != "shared")]
    unknown = [s for s in names if s not in SECTIONS]
    if unknown:
        raise ValueError(f"unknown settings sections {unknown}; choose from {list(SECTIONS)}")
    env = os.environ if env is None else env
    if check_env:
        check_environment(env)
    table = read_file(path) if path is not None else {}
    flags = getattr(overrides, "flags", {})
    loaded, sources, problems = {}, {}, []
    for name in names:
        cls = SECTIONS[name]
        values: dict[str, Any] = {}
        src = {f: Source("default", "") for f in cls.model_fields}
        for f, v in (defaults or {}).get(name, {}).items():
            values[f] = v
        for f, v in table.get(name, {}).items():
            values[f], src[f] = v, Source("file", f"{path} [{name}] {f}")
        for f, v in _from_env(cls, env).items():
            values[f], src[f] = v, Source("env", cls.env_name(f))
        for f, v in (overrides or {}).get(name, {}).items():
            if v is None:
                continue
            if f not in cls.model_fields:
                raise ValueError(f"override {name}.{f}: [{name}] has no {f!r}")
            values[f], src[f] = v, Source("flag", flags.get((name, f), f"override {name}.{f}"))
        try:
            loaded[name] = cls.model_validate(values)
        except ValidationError as e:
            problems += _explain(cls, e, src, values)
        sources[name] = src
    if problems:
        raise SettingsError(problems)
    return Settings(loaded, sources)


def _explain(cls: type[Section], error: ValidationError, src: dict[str, Source],
             values: dict[str, Any]) -> list[str]:
    out = []
    for err in error.errors():
        if err["type"] == "settings_problems":
            for p in err["ctx"]["problems"]:
                out.append(f"{p.message} (from {src[p.field].describe(cls.name, p.field)})")
            continue
        field = str(err["loc"][0]) if err["loc"] else ""
        if field in src:
            shown = MASK if cls.is_secret(field) else repr(values.get(field, err["input"]))
            out.append(f"{src[field].describe(cls.name, field)}={shown}: {err['msg']}")
        else:
            out.append(f"[{cls.name}]: {err['msg']}")
    return out


# ---- flags


def flag_name(section: str, field: str, prefixed: bool = False) -> str:
    name = f"{section}-{field}" if prefixed and section != "shared" else field
    return "--" + name.replace("_", "-")


def add_flags(parser: argparse.ArgumentParser, sections: Iterable[str], *, prefixed: bool = False,
              skip: Iterable[str] = ()) -> None:
    """A ``--<field>`` option for every field of ``shared`` and ``sections`` (``--<section>-<field>`` with
    ``prefixed``, for a command that reads two sections with a field of the same name), typed as the field, with
    its description as help and its choices; unset, a flag changes nothing. ``skip``: ``section.field`` names
    the entry point handles itself. Read them back with :func:`flag_overrides`."""
    names = ["shared", *(s for s in sections if s != "shared")]
    skipped, seen = set(skip), dict[str, str]()
    for section in names:
        cls = SECTIONS[section]
        group = parser.add_argument_group(f"[{section}] settings", (cls.__doc__ or "").strip().splitlines()[0])
        for field, info in cls.model_fields.items():
            if f"{section}.{field}" in skipped:
                continue
            flag = flag_name(section, field, prefixed)
            if flag in seen:
                raise ValueError(f"{flag} would set both {seen[flag]} and {section}.{field}: pass prefixed=True "
                                 "or skip one")
            seen[flag] = f"{section}.{field}"
            test_only = "test only: " if cls.is_test_only(field) else ""
            default = _shown_default(info.default)
            help_ = f"{test_only}{info.description} [{cls.env_name(field)}; default {default}]"
            kwargs: dict[str, Any] = {"dest": f"{section}__{field}", "default": argparse.SUPPRESS,
                                      "help": help_.replace("%", "%%")}
            if info.annotation is bool:
                kwargs["action"] = argparse.BooleanOptionalAction
            else:
                number = {int: "N", float: "X"}
                kind = info.annotation if info.annotation in number else str
                kwargs["type"], kwargs["metavar"] = kind, number.get(kind, "TEXT")
                if cls.choices_of(field):
                    kwargs["choices"] = list(cls.choices_of(field))
                    kwargs.pop("metavar")
            group.add_argument(flag, **kwargs)


def flag_overrides(args: argparse.Namespace, prefixed: bool = False) -> FlagValues:
    """The flags given on the command line (of :func:`add_flags`' options) as ``load``'s ``overrides``."""
    out = FlagValues()
    for dest, value in vars(args).items():
        section, sep, field = dest.partition("__")
        if sep and section in SECTIONS and field in SECTIONS[section].model_fields:
            out.setdefault(section, {})[field] = value
            out.flags[(section, field)] = flag_name(section, field, prefixed)
    return out


def parse_args(parser: argparse.ArgumentParser, sections: Iterable[str], argv: list[str] | None = None, *,
               defaults: Mapping[str, Mapping[str, Any]] | None = None, prefixed: bool = False,
               skip: Iterable[str] = ()) -> tuple[argparse.Namespace, Settings]:
    """An entry point's command line and settings: ``--config FILE.toml`` plus the flags of ``shared`` and
    ``sections``, loaded with :func:`load`. Anything wrong (an unknown or renamed ``KVMESH_*`` variable, an
    unknown file key, a bad value, an unreadable file) exits 2 with the message, no traceback."""
    parser.add_argument("--config", metavar="FILE.toml",
                        help="TOML file, one [section] table per section (docs/configuration.md)")
    add_flags(parser, sections, prefixed=prefixed, skip=skip)
    args = parser.parse_args(argv)
    try:
        loaded = load(sections, path=args.config, overrides=flag_overrides(args, prefixed), defaults=defaults)
    except (SettingsError, OSError, tomllib.TOMLDecodeError) as e:
        parser.exit(2, f"{parser.prog}: {e}\n")
    return args, loaded


def env_value(value: object) -> str:
    """``value`` as its environment variable spells it (what :func:`load` reads back to the same value)."""
    if value is None:
        return ""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, dict):
        return ",".join(f"{k}:{v}" for k, v in value.items())
    return str(value)


def as_env(loaded: Settings, kinds: Iterable[str] = ("file", "flag")) -> dict[str, str]:
    """The variables that carry ``loaded``'s values of the given source kinds to a child process."""
    wanted = set(kinds)
    out = {}
    for name, section in loaded.sections.items():
        for field, src in loaded.sources[name].items():
            if src.kind in wanted:
                out[type(section).env_name(field)] = env_value(getattr(section, field))
    return out


def _shown_default(value: object) -> str:
    if value is None or value == "":
        return '""'
    if isinstance(value, bool):
        return "true" if value else "false"
    return str(value)


# ---- config show and the reference


def masked(cls: type[Section], field: str, value: object) -> object:
    """``value`` safe to print: a secret as ``***``, a URL's password likewise (``nats://user:***@host``)."""
    if not cls.is_secret(field) or not value:
        return value
    if isinstance(value, dict):
        return {MASK: f"{len(value)} keys"}
    if isinstance(value, str) and "://" in value:
        parts = urlsplit(value)
        if not parts.password:
            return value
        netloc = f"{parts.username}:{MASK}@{parts.hostname}" + (f":{parts.port}" if parts.port else "")
        return urlunsplit(parts._replace(netloc=netloc))
    return MASK


def show(path: str | Path | None = None, env: Mapping[str, str] | None = None,
         overrides: Mapping[str, Mapping[str, Any]] | None = None,
         defaults: Mapping[str, Mapping[str, Any]] | None = None) -> dict[str, dict[str, dict[str, Any]]]:
    """Every section's effective settings, as ``kvmesh config show --json`` prints them:
    ``{section: {field: {"value": ..., "source": "default"|"file"|"env"|"flag", "env": "KVMESH_..."}}}``,
    secrets masked."""
    loaded = load(None, path=path, env=env, overrides=overrides, defaults=defaults)
    out: dict[str, dict[str, dict[str, Any]]] = {}
    for name, section in loaded.sections.items():
        cls = type(section)
        dumped = section.model_dump(mode="json")
        out[name] = {f: {"value": masked(cls, f, dumped[f]), "source": loaded.sources[name][f].kind,
                         "env": cls.env_name(f)} for f in cls.model_fields}
    return out


def reference() -> str:
    """Markdown: every section, each field's variable, TOML key, flag, default and meaning (docs/configuration.md
    is this text; a test keeps them equal)."""
    lines = ["# Configuration", "",
             "<!-- generated by `python -m kvmesh.settings reference`; edit libs/kvmesh/settings/sections.py -->",
             "",
             "Every setting has one home: a field of one section below. Its value comes from the field's default <",
             "the TOML file (`--config`, one `[section]` table per section) < the environment < command-line",
             "flags. A field's variable is `KVMESH_<SECTION>_<FIELD>`; the `[shared]` fields, which every process",
             "reads, are `KVMESH_<FIELD>`. No variable belongs to two sections. An unknown `KVMESH_*` variable (an",
             "old flat name included) stops a service with the name that replaced it; so does an unknown file key.",
             "An empty variable for a number, boolean or table means \"not set\". A bad value stops a service with",
             "the variable, flag or file it came from.", ""]
    for name, cls in SECTIONS.items():
        lines += [f"## [{name}]", "", (cls.__doc__ or "").strip(), "",
                  "| variable | key | flag | default | meaning |", "|---|---|---|---|---|"]
        for field, info in cls.model_fields.items():
            meaning = ("**test only, never set in production.** " if cls.is_test_only(field) else "") \
                + (info.description or "")
            if cls.choices_of(field):
                meaning += "; one of " + ", ".join(f"`{c}`" if c else '`""`' for c in cls.choices_of(field))
            if cls.is_secret(field):
                meaning += " (secret: masked when shown)"
            lines.append(f"| `{cls.env_name(field)}` | `{field}` | `{flag_name(name, field)}` | "
                         f"`{_shown_default(info.default)}` | {meaning.replace('|', '/')} |")
        lines.append("")
    lines += ["## Renamed variables", "",
              ("Names read before the sections had their own (the flat names, the engine's kernel switches) "
               "stop a service with their replacement:"), "",
              "| old | now |", "|---|---|"]
    lines += [f"| `{old}` | {', '.join(f'`{n}`' for n in new)} |" for old, new in sorted(RENAMED.items())]
    lines += ["", "Not settings (never read by a service): "
              + ", ".join(f"`{n}`" for n in sorted(NOT_SETTINGS))
              + " (compose interpolation, CI); `<VARIABLE>_FILE` of any variable above (docker secrets, read by",
              "docker/entrypoint.py).", ""]
    return "\n".join(lines)
