"""NATS subjects of one kvmesh cluster: every subject starts with ``kvmesh.<cluster>.``."""

from __future__ import annotations

from dataclasses import dataclass

from kvmesh.contracts.ids import cluster_name
from kvmesh.contracts.ids import subject_token as token


@dataclass(frozen=True)
class Subjects:
    cluster: str

    def __post_init__(self) -> None:
        cluster_name(self.cluster)

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

    def router_load(self, router: str) -> str:
        return f"{self.prefix}router.load.{token(router, 'router')}"

    @property
    def router_load_all(self) -> str:
        return f"{self.prefix}router.load.*"

    @property
    def sessions(self) -> str:
        """Session signals (ended, paused, back) from the routers, for every engine instance, cachesvc and the
        other routers."""
        return f"{self.prefix}sessions"

    @property
    def router_sessions(self) -> str:
        """Router to router: where each session's request was sent (``SessionEvent.ROUTED``), so every replica
        keeps a session where its KV is."""
        return f"{self.prefix}router.sessions"

    def cachesvc_shard(self, shard: int) -> str:
        """A cachesvc shard's beat (``CacheShardBeat``): where callers that find cachesvc through the bus learn it."""
        return f"{self.prefix}cache.shard.{int(shard)}"

    @property
    def cachesvc_shards_all(self) -> str:
        return f"{self.prefix}cache.shard.*"

    def kv_copies(self, instance: str) -> str:
        """cachesvc tells an instance which of its blocks have another copy in the cluster."""
        return f"{self.prefix}kv.copies.{token(instance, 'instance')}"

    @property
    def kv_quarantine(self) -> str:
        """Block keys an instance's KV canary caught diverging: cachesvc's pool never serves them again."""
        return f"{self.prefix}kv.quarantine"

    @property
    def pool_events(self) -> str:
        """cachesvc's pool: blocks each tier stored and removed (``KVEventBatch`` of instance ``pool``), for the
        routers' hit attribution (a block evicted from the pool is a miss with a cause)."""
        return f"{self.prefix}pool.events"

    @property
    def events_stream(self) -> str:
        """The JetStream stream that captures ``kv_events_all`` (cluster names are case-sensitive, so is this)."""
        return f"KVMESH_{self.cluster}_KV_EVENTS"
