"""The router's request telemetry: the root span of each request (``router.request``), its TTFT clock, and the
router's Prometheus metrics (``kvmesh_router_*``, served at ``GET /metrics`` on the HTTP port).

TTFT is measured here, from the moment the API handler has the request to the moment the first token is sent
(streaming) or is in hand (non-streaming and unary calls). The root span records it as the ``first_token``
event and ``kvmesh.ttft_ms``; the spans under it (this service's, and prefill's and decode's through the trace
context on every call) are the segments that make it up.
"""

from __future__ import annotations

import copy
import time
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

from kvmesh.contracts.ids import Role
from kvmesh.contracts.slo import NO_SLO, late_gaps_allowed
from kvmesh.routing.hits import Attribution
from kvmesh.telemetry import tracing
from kvmesh.telemetry.metrics import ITL_BUCKETS, PROMPT_TOKEN_BUCKETS, TTFT_BUCKETS, HitRatio, new_registry
from kvmesh.telemetry.spans import FIRST_TOKEN, ROOT
from opentelemetry.trace import Span, SpanKind, StatusCode
from prometheus_client import CONTENT_TYPE_LATEST, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from services.router.errors import ErrorKind

if TYPE_CHECKING:
    from kvmesh.model_source.prefix_tokens import PrefixTokens

    from services.router.registry import Registry
    from services.router.sessions import Sessions

P = "kvmesh_router"


class RouterMetrics:
    def __init__(self) -> None:
        r = self.registry = new_registry()
        self.ttft = Histogram(f"{P}_ttft_seconds", "Request received to first token sent",
                              buckets=TTFT_BUCKETS, registry=r)
        self.itl = Histogram(f"{P}_itl_seconds", "Time between consecutive chunks arriving from decode",
                             buckets=ITL_BUCKETS, registry=r)
        self.requests = Counter(f"{P}_requests", "Finished requests by API and outcome", ["api", "outcome"],
                                registry=r)
        self.rejections = Counter(f"{P}_rejections", "Requests answered with an error, by kind", ["reason"],
                                  registry=r)
        self.in_flight = Gauge(f"{P}_in_flight", "Requests being served (the router's queue depth)",
                               registry=r)
        self.prefix = HitRatio(P, r, "served through this router (cached_tokens of the usage)")
        self.computed_prompt = Histogram(f"{P}_computed_prompt_tokens", "Prompt tokens each finished request "
                                         "computed (its prompt less its cached tokens): the spread of prefill work "
                                         "kvmesh plan sizes prefill for", buckets=PROMPT_TOKEN_BUCKETS, registry=r)
        self.fallbacks = Counter(f"{P}_kv_fallbacks", "Requests whose decode instance recomputed the prompt "
                                 "because pushed KV did not arrive or verify", registry=r)
        self.match_errors = Counter(f"{P}_match_prefix_errors",
                                    "MatchPrefix calls that failed (routed by load)", registry=r)
        self.retries = Counter(f"{P}_retries", "Calls re-sent to another instance after one was unreachable, "
                               "by the role of the instance that failed", ["role"], registry=r)
        self.migrations = Counter(f"{P}_migrations", "Streams whose instance failed mid-stream: moved to another "
                                  "one (migrated; queued: it first waited for a slot, max_concurrent_migrations) "
                                  "or ended with the error (over_request_limit)", ["outcome"], registry=r)
        for outcome in ("migrated", "queued", "over_request_limit"):
            self.migrations.labels(outcome)
        self.slo = Counter(f"{P}_slo_requests", "Requests with a latency target that completed, by outcome "
                           "(met: every target, the goodput; missed, and missed_ttft / missed_itl: which target a "
                           "missed one missed), as the router saw them", ["outcome"], registry=r)
        self.missed = Counter(f"{P}_missed_prefill_tokens", "Prompt tokens computed rather than reused, by why "
                              "(kvmesh.routing.hits.Cause), the instance that computed them and the tenant",
                              ["cause", "instance", "tenant"], registry=r)
        self.predicted = Counter(f"{P}_predicted_hit_tokens", "Prompt tokens the router expected the chosen "
                                 "instance (or the pool) to reuse, when it routed", ["instance", "tenant"], registry=r)
        self.delivered = Counter(f"{P}_delivered_hit_tokens", "Prompt tokens the engines reported reused",
                                 ["instance", "tenant"], registry=r)
        for kind in ErrorKind:
            if kind != ErrorKind.CANCELLED:
                self.rejections.labels(kind)

    def hits(self, att: Attribution, tenant: str) -> None:
        """A finished request's hit attribution."""
        self.predicted.labels(att.instance, tenant).inc(att.predicted_tokens)
        self.delivered.labels(att.instance, tenant).inc(att.delivered_tokens)
        for cause, tokens in att.by_cause().items():
            self.missed.labels(cause, att.instance, tenant).inc(tokens)

    def watch(self, registry: Registry) -> None:
        self.registry.register(_InstancesCollector(registry))

    def watch_sessions(self, sessions: Sessions) -> None:
        self.registry.register(_SessionsCollector(sessions))

    def watch_tokenizing(self, cache: PrefixTokens) -> None:
        self.registry.register(_PrefixTokensCollector(cache))

    def exposition(self) -> tuple[bytes, str]:
        return generate_latest(self.registry), CONTENT_TYPE_LATEST


class _InstancesCollector(Collector):
    """Live engine instances per role (scraped on the event loop that owns the registry)."""

    def __init__(self, registry: Registry) -> None:
        self.registry = registry

    def collect(self) -> Iterator[GaugeMetricFamily]:
        g = GaugeMetricFamily(f"{P}_instances", "Live engine instances (heartbeating) per role",
                              labels=["role"])
        roles = [i.beat.role for i in self.registry.alive()]
        for role in Role.engines():
            g.add_metric([role], roles.count(role))
        yield g


class _SessionsCollector(Collector):
    """The sessions this router knows and what it did for them (scraped on the router's event loop)."""

    def __init__(self, sessions: Sessions) -> None:
        self.sessions = sessions

    def collect(self) -> Iterator[GaugeMetricFamily | CounterMetricFamily]:
        yield GaugeMetricFamily(f"{P}_sessions", "Sessions whose instance this router knows (its own placements "
                                "and the other replicas')", value=len(self.sessions))
        c = CounterMetricFamily(f"{P}_session_placements", "Session requests placed by what the router knew: "
                                "resumed (a paused session back; its instance told to warm its KV at once), moved "
                                "(its instance was overloaded), forked (a sub-agent sent where its parent ran)",
                                labels=["kind"])
        s = self.sessions
        for kind, n in (("resumed", s.resumed), ("moved", s.moved), ("forked", s.forked)):
            c.add_metric([kind], n)
        yield c


class _PrefixTokensCollector(Collector):
    """What the prefix token cache saved the router's tokenizing."""

    def __init__(self, cache: PrefixTokens) -> None:
        self.cache = cache

    def collect(self) -> Iterator[GaugeMetricFamily | CounterMetricFamily]:
        c = self.cache
        t = CounterMetricFamily(f"{P}_prompt_tokens_tokenized", "Prompt tokens of long texts by how the router "
                                "got them: reused (a leading part seen before, from the prefix token cache) or "
                                "encoded (tokenized now)", labels=["how"])
        t.add_metric(["reused"], c.reused_tokens)
        t.add_metric(["encoded"], c.encoded_tokens)
        yield t
        yield GaugeMetricFamily(f"{P}_prefix_token_cache_bytes", "Estimated memory the prefix token cache holds",
                                value=c.bytes)
        yield GaugeMetricFamily(f"{P}_prefix_token_cache_enabled", "1 while the prefix token cache is used (0: off "
                                "by setting, or for this tokenizer: the router's log says why)", value=int(c.enabled))


class RequestTrace:
    """One request at the router: its root span (a child of the caller's ``traceparent`` when there is one),
    the attributes every span of it carries, its TTFT, and its metrics. Not thread-safe: one event loop."""

    def __init__(self, metrics: RouterMetrics | None, request_id: str, api: str,
                 headers: Mapping[str, str] | None = None) -> None:
        self.metrics = metrics
        self.api = api
        self.request_id = request_id
        self.t0 = time.monotonic()
        self.attrs: dict[str, Any] = {tracing.REQUEST_ID: request_id}
        self.root = tracing.start(ROOT, tracing.extract(headers), SpanKind.SERVER,
                                  {**self.attrs, "kvmesh.api": api})
        self.ttft_s: float | None = None
        self._last = 0.0
        self.slo = NO_SLO  # the request's targets, once admitted
        self.gaps = self.late_gaps = 0  # its gaps between chunks, and those over its ITL target
        self._respond: Span | None = None
        self._done = False
        self.sibling = False  # a later choice's trace (``choice``)
        self.prompt_metrics: RouterMetrics | None = None  # a batch's further prompt's: its prefix metrics
        if metrics is not None:
            metrics.in_flight.inc()

    def choice(self, index: int, prompt: bool = False) -> RequestTrace:
        """The trace of this request's choice ``index`` past the first (``n`` > 1, or a batch's further prompt):
        its spans go under this request's root, tagged ``kvmesh.choice``; it has no root to end, no TTFT or ITLs
        (its chunks interleave with the other choices'), no metrics and no root attributes of its own: the
        request counts once. ``prompt``: the first choice of a batch's further prompt, whose prompt tokens and
        cached share count in the prefix metrics as every prompt's do."""
        sibling = copy.copy(self)  # the root, the targets, the id, the clock: this request's
        sibling.prompt_metrics = self.metrics if prompt else None
        sibling.metrics, sibling.sibling, sibling._done = None, True, True
        sibling.attrs = {**self.attrs, "kvmesh.choice": index}
        sibling.ttft_s, sibling._last, sibling.gaps, sibling.late_gaps, sibling._respond = 0.0, 0.0, 0, 0, None
        return sibling

    @property
    def traceparent(self) -> str:
        return tracing.traceparent(self.root)

    @property
    def trace_id(self) -> str:
        return tracing.trace_id(self.root)

    def headers(self) -> dict[str, str]:
        """What every response carries: the request id and the trace context (the root span)."""
        tp = self.traceparent
        return {"x-request-id": self.request_id, **({"traceparent": tp} if tp else {})}

    def describe(self, model: str, tenant: str, prompt_tokens: int) -> None:
        self.attrs.update({tracing.MODEL: model, tracing.TENANT: tenant})
        if self.sibling:
            return
        self.root.set_attributes({tracing.MODEL: model, tracing.TENANT: tenant,
                                  "kvmesh.tokens.prompt": prompt_tokens})

    def child(self, name: str, kind: SpanKind = SpanKind.INTERNAL, attrs: Mapping[str, Any] | None = None) -> Span:
        """A span under the root with the request's attributes and ``attrs``."""
        return tracing.start(name, self.root, kind, {**self.attrs, **(attrs or {})})

    @contextmanager
    def segment(self, name: str) -> Iterator[Span]:
        """A child span around a block of synchronous-or-awaiting code (never around a ``yield``)."""
        span = self.child(name)
        try:
            yield span
        except BaseException as e:
            span.set_status(StatusCode.ERROR, getattr(e, "message", None) or str(e) or type(e).__name__)
            raise
        finally:
            span.end()

    def chunk_arrived(self) -> None:
        """A chunk came from the engine instance: the first opens ``router.respond``; the rest are ITLs."""
        if self.sibling:
            return
        now = time.monotonic()
        if self._respond is None and self.ttft_s is None:
            self._respond = self.child("router.respond")
        elif self._last:
            self.gaps += 1
            self.late_gaps += bool(self.slo.itl_s) and now - self._last > self.slo.itl_s
            if self.metrics is not None:
                self.metrics.itl.observe(now - self._last)
        self._last = now

    def first_token_sent(self) -> None:
        """The first token left for the client (or, not streaming, is in hand): TTFT ends here."""
        if self.ttft_s is not None:
            return
        now_ns = time.time_ns()
        self.ttft_s = time.monotonic() - self.t0
        if self._respond is not None:
            self._respond.end(now_ns)
            self._respond = None
        self.root.add_event(FIRST_TOKEN, timestamp=now_ns)
        self.root.set_attribute("kvmesh.ttft_ms", round(self.ttft_s * 1e3, 3))
        if self.metrics is not None:
            self.metrics.ttft.observe(self.ttft_s)

    def fallback(self, reason: str) -> None:
        self.root.add_event("kv_fallback", {"kvmesh.reason": reason})
        if self.metrics is not None:
            self.metrics.fallbacks.inc()

    def retry(self, role: str, instance: str, reason: str) -> None:
        """``instance`` (a ``role``) could not serve the request before its first token; it goes elsewhere."""
        self.root.add_event("retry", {"kvmesh.role": role, "kvmesh.instance": instance, "kvmesh.reason": reason})
        if self.metrics is not None:
            self.metrics.retries.labels(role).inc()

    def usage(self, prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> None:
        if self.sibling:
            if self.prompt_metrics is not None:
                self.prompt_metrics.prefix.observe(prompt_tokens, cached_tokens)
                self.prompt_metrics.computed_prompt.observe(max(0, prompt_tokens - cached_tokens))
            return
        self.root.set_attributes({"kvmesh.tokens.completion": completion_tokens,
                                  "kvmesh.tokens.cached": cached_tokens})
        if self.metrics is not None:
            self.metrics.prefix.observe(prompt_tokens, cached_tokens)
            self.metrics.computed_prompt.observe(max(0, prompt_tokens - cached_tokens))

    def finish(self, error_kind: ErrorKind | None = None, message: str = "") -> None:
        """End the request (idempotent): ``error_kind`` is how it failed (``CANCELLED``: the client went away),
        None for success."""
        if self._done:
            return
        self._done = True
        if self._respond is not None:
            self._respond.end()
        if error_kind:
            self.root.set_status(StatusCode.ERROR, f"{error_kind}: {message}")
            self.root.set_attribute("kvmesh.error", error_kind)
        self.root.end()
        if self.metrics is not None:
            self.metrics.in_flight.dec()
            self.metrics.requests.labels(self.api, error_kind or "ok").inc()
            if error_kind and error_kind != ErrorKind.CANCELLED:
                self.metrics.rejections.labels(error_kind).inc()
            if not error_kind and self.slo:
                for outcome in self.slo_outcome():
                    self.metrics.slo.labels(outcome).inc()

    def slo_outcome(self) -> list[str]:
        """``["met"]``, or ``"missed"`` and the targets it missed: TTFT to the first token sent, the p99 of its
        gaps between chunks (``contracts.slo.late_gaps_allowed``)."""
        missed = []
        if self.slo.ttft_s and (self.ttft_s is None or self.ttft_s > self.slo.ttft_s):
            missed.append("missed_ttft")
        if self.slo.itl_s and self.late_gaps > late_gaps_allowed(self.gaps):
            missed.append("missed_itl")
        return ["missed", *missed] if missed else ["met"]
