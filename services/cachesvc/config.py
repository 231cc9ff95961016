"""Settings of the cache service: defaults < TOML file (its ``[cachesvc]`` table) < ``KVMESH_<FIELD>``
< flags."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvmesh import config
from kvmesh.bus import Subjects
from kvmesh.contracts.ids import TransferBackend, choices
from kvmesh.engine.eviction import make_policy


@dataclass(frozen=True)
class CacheServiceConfig:
    nats_url: str = "nats://127.0.0.1:4222"
    cluster: str = "local"            # subjects kvmesh.<cluster>.* and stream KVMESH_<cluster>_KV_EVENTS
    host: str = "127.0.0.1"           # gRPC listen address
    port: int = 50060                 # gRPC port (0 = any free port)
    metrics_port: int = 0             # Prometheus /metrics (0 = any free port, named in the log)
    durable_name: str = "cachesvc"    # JetStream consumer; one per cachesvc replica
    pool_capacity_mb: int = 256       # DRAM tier size (0 = no DRAM tier)
    eviction: str = "lru"             # lru | lfu | slru | priority | ... (every tier; not belady)
    instance_timeout_s: float = 5.0   # drop an instance's blocks after this long without a heartbeat
    max_message_mb: int = 64          # largest gRPC request/response (PutBlocks/GetBlocks data)
    disk_dir: str = ""                # disk tier directory ("" = no disk tier); survives restarts
    disk_capacity_mb: int = 10240     # bytes of segment files at most
    disk_segment_mb: int = 64         # one segment file; eviction drops whole segments
    max_lease_s: float = 300.0        # longest lease a reader may ask for
    snapshot_timeout_s: float = 5.0   # wait this long for an instance's snapshot before applying events as they are
    external: str = ""                # "" or "mooncake": an external store as the last tier
    external_capacity_mb: int = 4096  # what cachesvc keeps in the external store at most
    mooncake_master: str = "127.0.0.1:50051"                     # mooncake_master RPC address
    mooncake_metadata_url: str = "http://127.0.0.1:8080/metadata"  # the master's HTTP metadata server
    mooncake_host: str = "127.0.0.1"  # this process's address as other store nodes reach it
    mooncake_segment_mb: int = 256    # memory lent to the store (0 or >= 16); blocks in it go with cachesvc
    mooncake_replicas: int = 1        # copies the store keeps of each block
    mooncake_manifest_s: float = 5.0  # write the external tier's index to the store at most this often
    transfer_backend: str = "tcp"     # tcp | shm | mooncake: the transfer endpoint engines push blocks to
    transfer_port: int = 0            # its port (0 = any free port; Stats names it)
    transfer_timeout_s: float = 10.0  # a GetBlocks push, or PutBlocks' wait for its pushed blocks, at most
    transfer_buffer_mb: int = 1024    # pushed blocks held at once before their PutBlocks takes them
    max_transfer_mb: int = 256        # the most one GetBlocks pushes (the rest is for the next call)

    def __post_init__(self) -> None:
        Subjects(self.cluster)  # ValueError on a bad cluster name
        make_policy(self.eviction)
        if not 0 <= self.port < 65536:
            raise ValueError(f"port must be in [0, 65535], got {self.port}")
        if self.pool_capacity_mb < 0 or self.max_message_mb < 1:
            raise ValueError("pool_capacity_mb must be >= 0 and max_message_mb >= 1")
        if self.instance_timeout_s <= 0:
            raise ValueError(f"instance_timeout_s must be > 0, got {self.instance_timeout_s}")
        if self.disk_dir and not 0 < self.disk_segment_mb <= self.disk_capacity_mb:
            raise ValueError(f"disk_segment_mb ({self.disk_segment_mb}) must be in [1, disk_capacity_mb "
                             f"({self.disk_capacity_mb})]")
        if self.max_lease_s <= 0 or self.snapshot_timeout_s <= 0:
            raise ValueError("max_lease_s and snapshot_timeout_s must be > 0")
        if self.external not in ("", "mooncake"):
            raise ValueError(f"external {self.external!r} is not supported: use '' or 'mooncake'")
        if self.external and (self.external_capacity_mb < 1 or 0 < self.mooncake_segment_mb < 16
                              or self.mooncake_segment_mb < 0 or self.mooncake_replicas < 1):
            raise ValueError("with external = 'mooncake', external_capacity_mb and mooncake_replicas must be >= 1 "
                             "and mooncake_segment_mb 0 (lend none) or >= 16")
        if self.mooncake_manifest_s <= 0:
            raise ValueError(f"mooncake_manifest_s must be > 0 seconds, got {self.mooncake_manifest_s}")
        if self.transfer_backend not in choices(TransferBackend):
            raise ValueError(f"transfer_backend {self.transfer_backend!r} is not one of "
                             f"{', '.join(choices(TransferBackend))}")
        if not 0 <= self.transfer_port < 65536:
            raise ValueError(f"transfer_port must be in [0, 65535], got {self.transfer_port}")
        if self.transfer_timeout_s <= 0 or self.transfer_buffer_mb < 1 or self.max_transfer_mb < 1:
            raise ValueError("transfer_timeout_s must be > 0, transfer_buffer_mb and max_transfer_mb >= 1")
        if not self.durable_name or any(c in self.durable_name for c in ".*> \t"):
            raise ValueError(f"durable_name {self.durable_name!r} must be non-empty, "
                             "without '.', '*', '>' or spaces")


def load_config(path: str | Path | None = None, env: dict[str, str] | None = None,
                **overrides: Any) -> CacheServiceConfig:
    return config.load(CacheServiceConfig, path, env, section="cachesvc", **overrides)
