"""Request migration: a stream whose instance failed after it delivered tokens goes on elsewhere.

The router keeps every token it streamed to the client. When the instance serving the stream fails with the
instance at fault (unreachable, killed, silent past ``instance_timeout_s``, or an engine that cannot continue a
request), the request is dispatched again, routed like a new one, with the prompt plus those tokens as its prompt
and ``WorkRequest.generated_tokens`` saying how many of them are output already: the engine goes on from there (the
same greedy text, seeded sampling continuing its sequence, grammar and stop strings across the seam,
``max_tokens`` counting them), and the client's stream simply continues. Dynamo's ``--migration-limit`` works the
same way.

Limits: ``migration_limit`` per request, ``max_concurrent_migrations`` across the router (a decode that dies with a
hundred streams must not turn into a hundred recomputes at once on the survivors: past the cap a stream waits, in
order, for a migration under way to end, and is counted ``queued``; its client sees a longer gap, not an error).
A stream also moves when its instance stalls: no token for ``inter_token_timeout_s`` once the first came
(``core.Router._chunks``), however its heartbeats go. Each migration is a ``router.migrate`` span, from the
failure to the first token after it, with the reason, the instance left and the tokens carried over;
``kvmesh_router_migrations_total{outcome}`` counts them.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from dataclasses import dataclass

from opentelemetry.trace import Span, StatusCode

from services.router.errors import RequestError
from services.router.telemetry import RequestTrace, RouterMetrics

log = logging.getLogger(__name__)


@dataclass
class Migration:
    """One migration under way: its span, and its slot in the router's budget (given back once the stream
    delivers again, or fails). Ends once; later calls do nothing."""

    span: Span
    leave: Callable[[], None]
    over: bool = False

    def arrived(self) -> None:
        """The first chunk after the seam reached the router: the migration is over."""
        if not self.over:
            self.over = True
            self.leave()
            self.span.end()

    def failed(self, e: RequestError) -> None:
        if not self.over:
            self.over = True
            self.leave()
            self.span.set_status(StatusCode.ERROR, e.message)
            self.span.end()


class Migrations:
    """The router's budget of migrations under way at once, and the per-request limit."""

    def __init__(self, per_request: int, concurrent: int, metrics: RouterMetrics) -> None:
        self.per_request = per_request
        self.concurrent = concurrent
        self.metrics = metrics
        self.under_way = 0
        self._slots = asyncio.Semaphore(concurrent)  # FIFO: the streams queued first move first

    async def start(self, rt: RequestTrace, e: RequestError, done: int, carried: int) -> Migration | None:
        """Move a request whose instance failed (``e``) after ``done`` migrations, carrying ``carried`` tokens,
        once a slot is free (waits past ``concurrent``); None when the per-request limit says the error stands."""
        if done >= self.per_request:
            self.metrics.migrations.labels("over_request_limit").inc()
            return None
        if self._slots.locked():
            self.metrics.migrations.labels("queued").inc()
            log.warning("request %s: %d migrations under way (max_concurrent_migrations): queued for a slot",
                        rt.request_id, self.under_way)
        await self._slots.acquire()
        self.under_way += 1
        self.metrics.migrations.labels("migrated").inc()
        span = rt.child("router.migrate", attrs={"kvmesh.reason": e.message, "kvmesh.migration.from": e.instance,
                                                 "kvmesh.migration.tokens": carried,
                                                 "kvmesh.migration.number": done + 1})
        rt.root.add_event("migrate", {"kvmesh.reason": e.message, "kvmesh.instance": e.instance,
                                      "kvmesh.migration.tokens": carried})
        return Migration(span, self._leave)

    def _leave(self) -> None:
        self.under_way -= 1
        self._slots.release()
