"""Settings of one engine instance (``KVMESH_<FIELD>`` env vars or the ``[worker]`` TOML section)."""

from __future__ import annotations

from dataclasses import dataclass
from urllib.parse import urlparse

from kvmesh.contracts.ids import Role, TransferBackend, choices

ROLES = tuple(r.value for r in Role.engines())
TRANSFER_BACKENDS = choices(TransferBackend)


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
        problems = self.problems()
        if problems:
            raise ValueError("invalid worker settings: " + "; ".join(problems))

    def problems(self) -> list[str]:
        """Every setting that is out of range, each with what to set instead."""
        from kvmesh.bus.subjects import Subjects, token

        out = []
        if self.role not in ROLES:
            out.append(f"role must be one of {ROLES}, not {self.role!r}")
        if self.transfer_backend not in TRANSFER_BACKENDS:
            out.append(f"transfer_backend must be one of {TRANSFER_BACKENDS}, not {self.transfer_backend!r}")
        try:
            Subjects(self.cluster)
            if self.instance_id:
                token(self.instance_id, "instance_id")
        except ValueError as e:
            out.append(str(e))
        for name in ("port", "transfer_port", "metrics_port"):
            if not 0 <= getattr(self, name) <= 65535:
                out.append(f"{name} must be in [0, 65535] (0 = a free port), not {getattr(self, name)}")
        if urlparse(self.nats_url).scheme not in ("nats", "tls", "ws", "wss"):
            out.append(f"nats_url must look like nats://host:port, not {self.nats_url!r}")
        if self.cachesvc_address and ":" not in self.cachesvc_address:
            out.append(f"cachesvc_address must be host:port (\"\" = none), not {self.cachesvc_address!r}")
        for name in ("kv_timeout_s", "heartbeat_s"):
            if not getattr(self, name) > 0:
                out.append(f"{name} must be > 0, not {getattr(self, name)}")
        for name in ("pool_fetch_min_blocks", "fault_corrupt_pushes", "fault_stall_pushes"):
            if getattr(self, name) < 0:
                out.append(f"{name} must be >= 0, not {getattr(self, name)}")
        return out
