"""Settings with one home each: one pydantic-settings section per service plus ``shared`` (cluster, NATS, TLS,
state and log), loaded as field defaults < TOML file < environment < flags. An entry point names the sections it
reads::

    parser = argparse.ArgumentParser()
    parser.add_argument("--config")
    settings.add_flags(parser, ["instance", "engine", "telemetry"])
    args = parser.parse_args()
    cfg = settings.load(["instance", "engine", "telemetry"], path=args.config,
                        overrides=settings.flag_overrides(args), defaults={"instance": {"role": "prefill"}})
    cfg.shared.cluster, cfg.instance.port, cfg.engine.block_size

The variables, keys and flags of every section: docs/configuration.md (``python -m kvmesh.settings reference``).
"""

from kvmesh.settings.entry_points import ENTRY_POINT_SECTIONS, entry_point_defaults, load_entry_point
from kvmesh.settings.load import (
    NOT_SETTINGS,
    RENAMED,
    FlagValues,
    Settings,
    SettingsError,
    Source,
    add_flags,
    as_env,
    check_environment,
    env_names,
    env_value,
    flag_name,
    flag_overrides,
    load,
    masked,
    parse_args,
    read_file,
    reference,
    show,
)
from kvmesh.settings.sections import (
    SECTIONS,
    CacheServiceSettings,
    EngineSettings,
    Faults,
    InstanceSettings,
    Problem,
    RouterSettings,
    Section,
    SharedSettings,
    TelemetrySettings,
    parse_api_keys,
    slo_targets,
)

__all__ = [
    "ENTRY_POINT_SECTIONS", "NOT_SETTINGS", "RENAMED", "SECTIONS", "CacheServiceSettings", "EngineSettings",
    "Faults", "FlagValues", "InstanceSettings", "Problem", "RouterSettings", "Section", "Settings",
    "SettingsError", "SharedSettings", "Source", "TelemetrySettings", "add_flags", "as_env",
    "check_environment", "entry_point_defaults", "env_names", "env_value", "flag_name", "flag_overrides",
    "load", "load_entry_point", "masked", "parse_api_keys", "parse_args", "read_file", "reference", "show",
    "slo_targets",
]
