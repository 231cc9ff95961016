"""Settings of the cache service: defaults < TOML file (its ``[cachesvc]`` table) < ``KVMESH_<FIELD>``
< flags."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvmesh import config
from kvmesh.bus import Subjects
from kvmesh.engine.eviction import make_policy


@dataclass(frozen=True)
class CacheServiceConfig:
    nats_url: str = "nats://127.0.0.1:4222"
    cluster: str = "local"            # subjects kvmesh.<cluster>.* and stream KVMESH_<cluster>_KV_EVENTS
    host: str = "127.0.0.1"           # gRPC listen address
    port: int = 50060                 # gRPC port (0 = any free port)
    durable_name: str = "cachesvc"    # JetStream consumer; one per cachesvc replica
    pool_capacity_mb: int = 256       # DRAM tier size
    eviction: str = "lru"             # lru | lfu | slru | priority
    instance_timeout_s: float = 5.0   # drop an instance's blocks after this long without a heartbeat
    max_message_mb: int = 64          # largest gRPC request/response (PutBlocks/GetBlocks data)

    def __post_init__(self) -> None:
        Subjects(self.cluster)  # ValueError on a bad cluster name
        make_policy(self.eviction)
        if not 0 <= self.port < 65536:
            raise ValueError(f"port must be in [0, 65535], got {self.port}")
        if self.pool_capacity_mb < 0 or self.max_message_mb < 1:
            raise ValueError("pool_capacity_mb must be >= 0 and max_message_mb >= 1")
        if self.instance_timeout_s <= 0:
            raise ValueError(f"instance_timeout_s must be > 0, got {self.instance_timeout_s}")
        if not self.durable_name or any(c in self.durable_name for c in ".*> \t"):
            raise ValueError(f"durable_name {self.durable_name!r} must be non-empty, "
                             "without '.', '*', '>' or spaces")


def load_config(path: str | Path | None = None, env: dict[str, str] | None = None,
                **overrides: Any) -> CacheServiceConfig:
    return config.load(CacheServiceConfig, path, env, section="cachesvc", **overrides)
