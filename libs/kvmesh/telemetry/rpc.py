"""One wrapper for a traced gRPC method: its server span (a child of the caller's, from the call's metadata),
its outcome counted, its latency observed, and the errors it maps to statuses whose message says what to fix.

Every servicer method of an engine instance or the cache service is wrapped the same way::

    @traced_rpc("prefill.request", metrics=lambda self: self.w.metrics, attributes=...)
    async def Prefill(self, request, context, span): ...

The wrapped method receives the span as a third argument and may add attributes or child spans to it. Works
for unary methods (``async def``) and server-streaming ones (``async def`` with ``yield``).
"""

from __future__ import annotations

import functools
import inspect
import time
from collections.abc import AsyncIterator, Callable, Mapping
from typing import Any, Protocol

import grpc
from opentelemetry.trace import Span, SpanKind, StatusCode

from kvmesh.telemetry import tracing

# An exception type, the outcome label it counts as, and the status code the call ends with.
ErrorMap = Mapping[type[BaseException], tuple[str, grpc.StatusCode]]


class RpcMetrics(Protocol):
    """What a service counts per RPC: ``requests{rpc, outcome}``; ``latency{rpc}`` where it has one."""

    requests: Any


def traced_rpc(span_name: str | Callable[[str], str], *, rpc: str | None = None,
               metrics: Callable[[Any], RpcMetrics], attributes: Callable[[Any, Any, Any], dict[str, Any]],
               errors: ErrorMap | None = None) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """Decorate a servicer method ``(self, request, context, span)``.

    ``span_name``: the span's name, or a function of the RPC name (e.g. ``lambda rpc: f"cachesvc.{rpc}"``).
    ``rpc``: the ``rpc`` label of the metrics (default: the method's name).
    ``metrics(self)``: the service's metrics; ``requests.labels(rpc, outcome).inc()`` once per call, and
    ``latency.labels(rpc).observe(seconds)`` when it has ``latency``.
    ``attributes(self, request, context)``: the span's attributes.
    ``errors``: exceptions that are the caller's (or a peer's) fault: each ends the call with its status code
    and the exception's text, counted under its outcome. Any other exception counts as ``error`` and
    propagates (an ``abort`` from inside the method among them)."""
    errors = dict(errors or {})

    def decorate(method: Callable[..., Any]) -> Callable[..., Any]:
        label = rpc or method.__name__
        name = span_name(method.__name__) if callable(span_name) else span_name

        def opened(self: Any, request: Any, context: Any) -> tuple[Span, _Call]:
            span = tracing.start(name, tracing.from_grpc(context), SpanKind.SERVER,
                                 attributes(self, request, context))
            return span, _Call(metrics(self), label, span)

        if inspect.isasyncgenfunction(method):
            @functools.wraps(method)
            async def streaming(self: Any, request: Any, context: Any) -> AsyncIterator[Any]:
                span, call = opened(self, request, context)
                try:
                    async for item in method(self, request, context, span):
                        yield item
                    call.outcome = "ok"
                except tuple(errors) as e:
                    await call.abort(context, e, errors)
                except BaseException as e:
                    call.failed(e)
                    raise
                finally:
                    call.close()
            return streaming

        @functools.wraps(method)
        async def unary(self: Any, request: Any, context: Any) -> Any:
            span, call = opened(self, request, context)
            try:
                result = await method(self, request, context, span)
                call.outcome = "ok"
                return result
            except tuple(errors) as e:
                await call.abort(context, e, errors)
            except BaseException as e:
                call.failed(e)
                raise
            finally:
                call.close()
        return unary

    return decorate


class _Call:
    """The bookkeeping of one call: outcome, span status, metrics at the end."""

    def __init__(self, metrics: RpcMetrics, rpc: str, span: Span) -> None:
        self.metrics, self.rpc, self.span = metrics, rpc, span
        self.outcome = "error"
        self.t0 = time.perf_counter()

    def failed(self, e: BaseException) -> None:
        self.span.set_status(StatusCode.ERROR, str(e) or type(e).__name__)

    async def abort(self, context: Any, e: BaseException, errors: ErrorMap) -> None:
        outcome, code = next(v for t, v in errors.items() if isinstance(e, t))
        self.outcome = outcome
        self.span.set_status(StatusCode.ERROR, outcome)
        await context.abort(code, getattr(e, "reason", None) or str(e))

    def close(self) -> None:
        self.metrics.requests.labels(self.rpc, self.outcome).inc()
        latency = getattr(self.metrics, "latency", None)
        if latency is not None:
            latency.labels(self.rpc).observe(time.perf_counter() - self.t0)
        self.span.end()
