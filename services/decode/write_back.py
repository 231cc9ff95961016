"""Write-back: a finished request's full blocks (prompt + output) go to cachesvc's pool, so the next turn of the
conversation reuses its whole history on any instance. A failure is logged and skipped."""

from __future__ import annotations

import logging
from typing import Any

from kvmesh.contracts.ids import BlockKey
from kvmesh.instance.host import EngineHost
from kvmesh.instance.pool_client import PoolError
from kvmesh.telemetry import tracing
from opentelemetry.trace import Span, SpanKind, StatusCode

log = logging.getLogger(__name__)


async def write_back(host: EngineHost, keys: list[BlockKey], blocks, parent: Span | None = None,
                     attrs: dict[str, Any] | None = None) -> None:
    """Store ``keys``' blocks (the first ``len(keys)`` of ``blocks``) in the pool, traced as ``pool.write_back``."""
    if host.pool is None or not keys:
        return
    span = tracing.start("pool.write_back", parent, SpanKind.CLIENT,
                         {**(attrs or {}), tracing.SEGMENT: False, "kvmesh.tier": "pool",
                          "kvmesh.blocks": len(keys)})
    try:
        sent = await host.pool.write_back(keys, blocks[:len(keys)],
                                          tracing.grpc_metadata(span) + tracing.request_metadata(attrs))
        host.metrics.transfer_bytes.labels("pool_write").inc(sent * host.layout.block_nbytes)
        span.set_attributes({"kvmesh.blocks_sent": sent, "kvmesh.bytes": sent * host.layout.block_nbytes})
    except PoolError as e:
        log.warning("write-back of %d blocks skipped: %s", len(keys), e)
        span.set_status(StatusCode.ERROR, f"write-back failed: {e}")
    finally:
        span.end()
