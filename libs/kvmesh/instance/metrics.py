"""Prometheus metrics of one engine instance (``kvmesh_worker_*``), served on its own ``metrics_port``."""

from __future__ import annotations

from typing import TYPE_CHECKING

from prometheus_client import Counter, Gauge, Histogram

from kvmesh.telemetry.metrics import (
    ITL_BUCKETS,
    TTFT_BUCKETS,
    CountsCollector,
    EngineCollector,
    HitRatio,
    new_registry,
)

if TYPE_CHECKING:
    from kvmesh.authz import Authorizer
    from kvmesh.engines import Engine
    from kvmesh.transfer import TransferServer

P = "kvmesh_worker"
FALLBACK_REASONS = ("timeout", "prefill_failed", "blocks_missing", "rejected", "mismatch", "other")


class WorkerMetrics:
    def __init__(self) -> None:
        r = self.registry = new_registry()
        self.ttft = Histogram(f"{P}_ttft_seconds", "Prefill: request received to first token sampled. "
                              "Decode: request received to first token sent (includes waiting for prefill)",
                              buckets=TTFT_BUCKETS, registry=r)
        self.itl = Histogram(f"{P}_itl_seconds", "Time between consecutive tokens sent (decode)",
                             buckets=ITL_BUCKETS, registry=r)
        self.prefix = HitRatio(P, r, "computed by this instance")
        self.transfer_bytes = Counter(f"{P}_kv_transfer_bytes", "KV bytes moved: pushed to decode, received "
                                      "from prefill (receive_in_place: of those, the bytes that landed straight "
                                      "in the KV pool), fetched from or written back to the pool",
                                      ["direction"], registry=r)
        self.requests = Counter(f"{P}_requests", "Requests handled, by RPC and outcome", ["rpc", "outcome"],
                                registry=r)
        self.kv_ready_dropped = Counter(f"{P}_kv_ready_dropped", "kv.ready announcements decode dropped: not MACed "
                                        "under the request's push capability (unauthenticated), or naming another "
                                        "request's transfer (transfer_id)", ["reason"], registry=r)
        self.rejections = Counter(f"{P}_rejections", "Requests refused (invalid input, no room)", ["reason"],
                                  registry=r)
        self.fallbacks = Counter(f"{P}_kv_fallbacks", "Decode recomputed the prompt instead of using the "
                                 "pushed KV", ["reason"], registry=r)
        self.session_warm_blocks = Counter(f"{P}_session_warm_blocks", "Blocks of paused sessions' contexts "
                                           "fetched from the pool ahead of their next request: when it reached a "
                                           "router (resume) or before it was expected (due)", ["trigger"],
                                           registry=r)
        for trigger in ("resume", "due"):
            self.session_warm_blocks.labels(trigger)
        for direction in ("push", "receive", "receive_in_place", "pool_fetch", "pool_write"):
            self.transfer_bytes.labels(direction)  # exported from the start, at 0
        for reason in FALLBACK_REASONS:
            self.fallbacks.labels(reason)

    def watch(self, async_engine: Engine) -> None:
        self.registry.register(EngineCollector(async_engine, P))
        self.registry.register(CountsCollector(
            f"{P}_kv_canary_checks", "Reused prefixes the KV canary recomputed and compared with what was served, "
            "by path (local, pool, handoff) and outcome (ok, diverged: its blocks were quarantined)", "check",
            lambda: {f"{path}:{outcome}": n for (path, outcome), n in async_engine.canary_counts().items()}))

    def watch_authorizer(self, authorizer: Authorizer) -> None:
        """Export the calls the mesh authorizer refused, by RPC (``calls_refused_total``)."""
        self.registry.register(CountsCollector(
            f"{P}_calls_refused", "gRPC calls refused for the caller's mesh identity (none, or a role the RPC is "
            "not for), by RPC", "rpc", lambda: authorizer.refused))

    def watch_transfers(self, server: TransferServer) -> None:
        """Export the bytes ``server`` holds (received and not taken yet, or arriving) and
        the transfers it refused, by reason (``kv_transfer_refused_total``)."""
        Gauge(f"{P}_kv_transfer_buffered_bytes", "KV bytes the transfer endpoint holds: being received, or "
              "verified and not yet taken", registry=self.registry).set_function(lambda: server.buffered_bytes)
        self.registry.register(CountsCollector(
            f"{P}_kv_transfer_refused", "Transfers the transfer endpoint refused, by reason: unsolicited / "
            "bad_token / expired / blocks (no valid push capability), tls (TLS on one end only), and checksum, layout, "
            "capacity, duplicate, discarded..., connections / idle (connections closed: over a cap, or silent)",
            "reason", lambda: server.refused))


def fallback_reason(message: str) -> str:
    """A small, fixed label for a fallback message (the message itself goes to the log and the trace)."""
    m = message.lower()
    if "not received within" in m:
        return "timeout"
    if m.startswith("prefill"):
        return "prefill_failed"
    if "did not" in m:
        return "blocks_missing"
    if "rejected" in m:
        return "rejected"
    if "does not match" in m:
        return "mismatch"
    return "other"
