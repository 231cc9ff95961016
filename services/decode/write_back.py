"""Write-back: a finished request's full blocks (prompt + output) go to cachesvc's pool, so the next turn of the
conversation reuses its whole history on any instance. A failure is logged and skipped."""

from __future__ import annotations

import logging
from typing import Any

from kvmesh.contracts.engine import ExportedKV, SessionHint
from kvmesh.instance.host import EngineHost
from kvmesh.instance.pool_client import PoolError
from kvmesh.telemetry import tracing
from opentelemetry.trace import Span, SpanKind, StatusCode

log = logging.getLogger(__name__)


async def write_back(host: EngineHost, kv: ExportedKV, parent: Span | None = None,
                     attrs: dict[str, Any] | None = None, session: SessionHint | None = None,
                     held: int = 0) -> None:
    """Store the full blocks of ``kv`` (a finished request's, read out whole) in the pool, traced as
    ``pool.write_back``; ``session``: the request's, which holds them in the pool's tiers too (or, its last
    request, lets them go first); ``held``: the prompt's leading blocks the pool held when it was routed (not
    sent again)."""
    keys = list(kv.piece_keys)
    if host.pool is None or not keys or kv.layers is not None:
        return
    span = tracing.start("pool.write_back", parent, SpanKind.CLIENT,
                         {**(attrs or {}), tracing.SEGMENT: False, "kvmesh.tier": "pool",
                          "kvmesh.blocks": len(keys)})
    try:
        sent = await host.pool.write_back(keys, kv.data[:len(keys) * host.layout.block_nbytes],
                                          tracing.grpc_metadata(span) + tracing.request_metadata(attrs),
                                          session, list(kv.block_keys), held)
        host.metrics.transfer_bytes.labels("pool_write").inc(sent * host.layout.block_nbytes)
        span.set_attributes({"kvmesh.blocks_sent": sent, "kvmesh.bytes": sent * host.layout.block_nbytes})
    except PoolError as e:
        log.warning("write-back of %d blocks skipped: %s", len(keys), e)
        span.set_status(StatusCode.ERROR, f"write-back failed: {e}")
    finally:
        span.end()
