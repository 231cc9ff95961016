"""How a servicer of an engine instance ends the call of a request it cannot serve or that failed inside the
engine."""

from __future__ import annotations

import logging

import grpc
from opentelemetry.trace import Span

from kvmesh.engines import Engine, SequenceError
from kvmesh.proto.v1 import worker_pb2
from kvmesh.telemetry import tracing

log = logging.getLogger(__name__)


async def abort_failed(context: grpc.aio.ServicerContext, e: SequenceError, span: Span) -> None:
    """End the call of a request that failed inside the engine: INVALID_ARGUMENT when the request is at
    fault, INTERNAL (logged, with its trace) when we are; the details name the request."""
    if not e.client_fault:
        log.error("%s (trace %s)", e, tracing.trace_id(span))
    await context.abort(grpc.StatusCode.INVALID_ARGUMENT if e.client_fault else grpc.StatusCode.INTERNAL, str(e))


async def refuse_continuation(context: grpc.aio.ServicerContext, engine: Engine, work: worker_pb2.WorkRequest) -> None:
    """A migrated request (``generated_tokens``) on an engine that cannot continue one: FAILED_PRECONDITION, so
    the router takes it elsewhere. Nothing otherwise."""
    if not work.generated_tokens:
        return
    why = engine.continuation_refused(work.sampling.WhichOneof("structured") is not None)
    if why:
        await context.abort(grpc.StatusCode.FAILED_PRECONDITION, why)
