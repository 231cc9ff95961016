"""Fault injection for the fault tests (``[instance]``'s test-only ``fault_hang_after_tokens``): decode's stream
of a request stops after N tokens and hangs, as a decode that is about to die looks to the router. The test then
kills the instance at that point, so a migration starts from a known token, never from a timing guess. With
``fault_resume_on_drain`` the hang ends when the instance starts draining (a graceful stop): the stream is then
certainly in flight when the drain begins, and goes on there."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator

from kvmesh.proto.v1 import worker_pb2

log = logging.getLogger(__name__)


async def hang_after_tokens(chunks: AsyncIterator[worker_pb2.DecodeChunk], n: int, request_id: str,
                            until: asyncio.Event | None = None) -> AsyncIterator[worker_pb2.DecodeChunk]:
    """``chunks`` until ``n`` tokens went out (unless it finished by then), then nothing, until cancelled (or until
    ``until`` is set: then the rest)."""
    sent, hung = 0, False
    async for chunk in chunks:
        yield chunk
        sent += len(chunk.token_ids)
        if sent >= n and not chunk.finished and not hung:
            log.warning("request %s: fault injection: the stream hangs after %d tokens", request_id, sent)
            await (until or asyncio.Event()).wait()
            hung = True
