"""NATS subjects of one kvmesh cluster: every subject starts with ``kvmesh.<cluster>.``."""

from __future__ import annotations

import re
from dataclasses import dataclass

_TOKEN = re.compile(r"[^\s.*>]+")          # one NATS subject token: no dots, wildcards or whitespace
_CLUSTER = re.compile(r"[A-Za-z0-9_-]+")   # also part of a JetStream stream name, so stricter


def token(value: str, what: str) -> str:
    """``value`` if it is usable as one subject token, else a ValueError that names ``what``."""
    if not isinstance(value, str) or not _TOKEN.fullmatch(value):
        raise ValueError(f"{what} {value!r} is not a valid NATS subject token: "
                         "it must be non-empty, without '.', '*', '>' or whitespace")
    return value


@dataclass(frozen=True)
class Subjects:
    cluster: str

    def __post_init__(self) -> None:
        if not isinstance(self.cluster, str) or not _CLUSTER.fullmatch(self.cluster):
            raise ValueError(f"cluster name {self.cluster!r} is invalid: use only letters, digits, '_' and '-'")

    @property
    def prefix(self) -> str:
        return f"kvmesh.{self.cluster}."

    def kv_ready(self, decode_instance: str) -> str:
        return f"{self.prefix}kv.ready.{token(decode_instance, 'decode instance')}"

    def kv_events(self, instance: str) -> str:
        return f"{self.prefix}kv.events.{token(instance, 'instance')}"

    @property
    def kv_events_all(self) -> str:
        return f"{self.prefix}kv.events.>"

    def heartbeat(self, role: str, instance: str) -> str:
        return f"{self.prefix}heartbeat.{token(role, 'role')}.{token(instance, 'instance')}"

    @property
    def heartbeats_all(self) -> str:
        return f"{self.prefix}heartbeat.>"

    @property
    def events_stream(self) -> str:
        """The JetStream stream that captures ``kv_events_all`` (cluster names are case-sensitive, so is this)."""
        return f"KVMESH_{self.cluster}_KV_EVENTS"
