"""cachesvc's Prometheus metrics: RPC outcomes and latency, the index, each pool tier's occupancy and
evictions, bytes in and out, leases, event gaps and snapshots, pushes its transfer endpoint refused. Tier and index
figures are read at scrape time (racy reads of sizes owned by the storage thread; a scrape never blocks storage)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING

from kvmesh.telemetry.metrics import CountsCollector, new_registry
from prometheus_client import Counter, Histogram
from prometheus_client.core import GaugeMetricFamily

if TYPE_CHECKING:
    from services.cachesvc.server import CacheServer

P = "kvmesh_cachesvc"


class _StateCollector:
    def __init__(self, server: CacheServer) -> None:
        self.server = server

    def collect(self) -> Iterator[GaugeMetricFamily]:
        s = self.server
        yield GaugeMetricFamily(f"{P}_indexed_blocks", "Block keys in the global index", value=len(s.index))
        yield GaugeMetricFamily(f"{P}_instances", "Engine instances with indexed blocks",
                                value=len(s.index.instances()))
        yield GaugeMetricFamily(f"{P}_event_gaps", "Gaps seen in instances' KV event sequences",
                                value=s.resync.gaps)
        yield GaugeMetricFamily(f"{P}_snapshots_applied", "Instance snapshots applied after a gap",
                                value=s.resync.applied)
        blocks = GaugeMetricFamily(f"{P}_pool_blocks", "Blocks held per pool tier", labels=["tier"])
        used = GaugeMetricFamily(f"{P}_pool_bytes", "Bytes held per pool tier", labels=["tier"])
        occupancy = GaugeMetricFamily(f"{P}_pool_occupancy_ratio", "Used / capacity per pool tier",
                                      labels=["tier"])
        evicted = GaugeMetricFamily(f"{P}_pool_evictions", "Blocks evicted per pool tier since start",
                                    labels=["tier"])
        leased = GaugeMetricFamily(f"{P}_leased_blocks", "Blocks pinned by live leases")
        failed = GaugeMetricFamily(f"{P}_pool_write_failures", "Puts a pool tier refused since start, by reason "
                                   "(disk: no_space = the free-space reserve, write_error = a write that failed)",
                                   labels=["tier", "reason"])
        if s.pool is not None:
            for t in s.pool.tiers:
                blocks.add_metric([t.name], len(t))
                used.add_metric([t.name], t.used_bytes)
                occupancy.add_metric([t.name], t.used_bytes / t.capacity_bytes if t.capacity_bytes else 0.0)
                evicted.add_metric([t.name], t.evicted)
                for reason, n in getattr(t, "failed", {}).items():
                    failed.add_metric([t.name, reason], n)
            leased.add_metric([], s.pool.leases.pinned_keys)
        yield from (blocks, used, occupancy, evicted, leased, failed)


class CacheMetrics:
    def __init__(self, server: CacheServer) -> None:
        self.registry = new_registry()
        self.requests = Counter(f"{P}_requests", "RPCs by method and outcome", ["rpc", "outcome"],
                                registry=self.registry)
        self.matches = Counter(f"{P}_matches", "Prompts MatchPrefix answered, each call's one and each of a "
                               "MatchPrefixBatch's", registry=self.registry)
        self.latency = Histogram(f"{P}_rpc_seconds", "RPC handling time", ["rpc"], registry=self.registry,
                                 buckets=(0.0001, 0.0003, 0.001, 0.003, 0.01, 0.03, 0.1, 0.3, 1, 3))
        self.bytes = Counter(f"{P}_block_bytes", "Block bytes stored (put) and served (get)", ["direction"],
                             registry=self.registry)
        self.repaired_blocks = Counter(f"{P}_repaired_blocks", "Blocks a (re)started shard fetched from the other "
                                       "copies' shards, by the shard they came from", ["source"],
                                       registry=self.registry)
        self.repaired_bytes = Counter(f"{P}_repaired_bytes", "Block bytes a (re)started shard fetched from the "
                                      "other copies' shards, by the shard they came from", ["source"],
                                      registry=self.registry)
        self.registry.register(_StateCollector(server))
        if server.authorizer is not None:
            self.registry.register(CountsCollector(
                f"{P}_calls_refused", "gRPC calls refused for the caller's mesh identity (none, or a role the RPC "
                "is not for), by RPC", "rpc", lambda: server.authorizer.refused if server.authorizer else {}))
        self.registry.register(CountsCollector(
            f"{P}_transfer_refused", "Pushes the transfer endpoint refused, by reason (unsolicited / bad_token / "
            "expired / blocks: no valid capability from GrantPut; tls: TLS on one end only; checksum, layout...)",
            "reason", lambda: server.transfers_refused))
