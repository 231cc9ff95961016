"""Settings of one engine instance (``KVMESH_<FIELD>`` env vars or the ``[worker]`` TOML section)."""

from __future__ import annotations

from dataclasses import dataclass

ROLES = ("prefill", "decode", "both")


@dataclass(frozen=True)
class WorkerConfig:
    role: str = "both"                 # prefill | decode | both
    instance_id: str = ""              # default: <role>-<port>
    cluster: str = "local"
    nats_url: str = "nats://127.0.0.1:4222"
    host: str = "127.0.0.1"
    port: int = 0                      # gRPC port (0 = a free one)
    transfer_backend: str = "tcp"      # tcp | shm | mooncake
    transfer_port: int = 0
    cachesvc_address: str = ""         # host:port of the cache service pool ("" = no write-back / pool hits)
    pool_fetch_min_blocks: int = 1     # fetch from the pool when it holds this many more leading blocks than us
    kv_timeout_s: float = 10.0         # decode: wait this long for kv.ready, then recompute the prompt locally
    heartbeat_s: float = 1.0
    metrics_port: int = 0              # Prometheus /metrics (0 = a free one; the log names it)
    fault_drop_kv_ready: bool = False  # fault injection (tests): prefill pushes KV but never announces it
    fault_corrupt_pushes: int = 0      # fault injection (tests): the first N KV pushes get a byte flipped on the wire
    fault_stall_pushes: int = 0        # fault injection (tests): the first N: kv.ready goes out, the blocks stall

    def __post_init__(self) -> None:
        if self.role not in ROLES:
            raise ValueError(f"role must be one of {ROLES}, not {self.role!r}")
