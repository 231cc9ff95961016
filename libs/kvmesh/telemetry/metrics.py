"""Prometheus pieces every service uses: one registry per service, its HTTP endpoint, latency buckets, and a
collector that reads an engine's queues, KV tiers and eviction counters at scrape time."""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable, Iterator, Mapping
from typing import Any, Generic, TypeVar

from prometheus_client import CollectorRegistry, ProcessCollector, disable_created_metrics, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from kvmesh.contracts.engine import EngineStats

log = logging.getLogger(__name__)
Label = TypeVar("Label", bound=str)  # a label value: a string, or a StrEnum of the values

TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.2, 0.35, 0.5, 0.75, 1.0, 1.5, 2.5, 5.0, 10.0, 30.0, 60.0)
ITL_BUCKETS = (0.005, 0.01, 0.02, 0.03, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 1.0, 2.5)
# prompt tokens a request computed (the planner reads the spread of prefill work from them): a bucket per
# quarter-power of two from 16 to 128k, so a quantile read back by interpolation is within ~10%
PROMPT_TOKEN_BUCKETS = tuple(round(16 * 2 ** (i / 4)) for i in range(53))


def new_registry() -> CollectorRegistry:
    """A service's registry (not the global one, so tests can build services twice in one process)."""
    disable_created_metrics()  # no *_created series: they double the exposition and nobody graphs them
    registry = CollectorRegistry()
    ProcessCollector(registry=registry)
    return registry


class MetricsServer:
    """``GET /metrics`` of one registry on its own port (a thread of prometheus-client's)."""

    def __init__(self, registry: CollectorRegistry, host: str, port: int,
                 setting: str = "--metrics-port / KVMESH_INSTANCE_METRICS_PORT") -> None:
        from kvmesh.ready import binding

        with binding("metrics", host, port, setting):  # port 0: any free port, read back below
            self._server, self._thread = start_http_server(port, host, registry)
        self.host = host
        self.port = self._server.server_port

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}/metrics"

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()


class HitRatio:
    """Prompt tokens and the part of them served from a cache, as two counters and their ratio."""

    def __init__(self, prefix: str, registry: CollectorRegistry, what: str) -> None:
        from prometheus_client import Counter, Gauge

        self.prompt = Counter(f"{prefix}_prompt_tokens", f"Prompt tokens of requests {what}",
                              registry=registry)
        self.hit = Counter(f"{prefix}_prefix_hit_tokens", f"Prompt tokens served from a KV cache {what}",
                           registry=registry)
        self._prompt = self._hit = 0
        Gauge(f"{prefix}_prefix_hit_ratio", f"Prefix hit ratio in tokens {what} (hit / prompt tokens)",
              registry=registry).set_function(lambda: self._hit / self._prompt if self._prompt else 0.0)

    def observe(self, prompt_tokens: int, hit_tokens: int) -> None:
        self.prompt.inc(prompt_tokens)
        self.hit.inc(hit_tokens)
        self._prompt += prompt_tokens
        self._hit += hit_tokens


class EngineCollector(Collector):
    """Queue depth, KV occupancy per tier, evictions and preemptions of an engine, read when scraped from its
    ``stats()`` (a snapshot, never a lock on the hot path)."""

    def __init__(self, engine: Any, prefix: str = "kvmesh_worker") -> None:
        self.engine = engine  # a kvmesh.engines.Engine
        self.prefix = prefix

    def collect(self) -> Iterator[Any]:
        p = self.prefix
        try:
            st: EngineStats = self.engine.stats()
        except RuntimeError:  # its state kept changing while read: skip this scrape
            return
        load = st.load
        q = GaugeMetricFamily(f"{p}_queue_depth", "Sequences in the engine by state", labels=["state"])
        q.add_metric(["running"], load.running)
        q.add_metric(["waiting"], load.waiting)
        yield q
        yield GaugeMetricFamily(f"{p}_waiting_tokens", "Tokens of the sequences waiting to be scheduled",
                                value=load.waiting_tokens)
        blocks = GaugeMetricFamily(f"{p}_kv_blocks", "KV blocks per tier and state", labels=["tier", "state"])
        blocks.add_metric(["device", "capacity"], load.total_blocks)
        blocks.add_metric(["device", "used"], load.total_blocks - load.free_blocks)
        blocks.add_metric(["device", "cached"], load.cached_blocks)
        blocks.add_metric(["host", "capacity"], st.host_capacity)
        blocks.add_metric(["host", "used"], load.host_blocks)
        if st.blocks is not None:  # (contracts.engine.BlockStates says what each state means)
            for state, n in dataclasses.asdict(st.blocks).items():
                blocks.add_metric(["device", state], n)
        yield blocks
        yield GaugeMetricFamily(f"{p}_kv_block_bytes", "Bytes of one KV block (every layer, K and V) as stored: "
                                "blocks moved times this is bytes moved", value=self.engine.layout.block_nbytes)
        occ = GaugeMetricFamily(f"{p}_kv_occupancy_ratio", "Used share of each KV tier", labels=["tier"])
        occ.add_metric(["device"], (load.total_blocks - load.free_blocks) / max(1, load.total_blocks))
        occ.add_metric(["host"], load.host_blocks / st.host_capacity if st.host_capacity else 0.0)
        yield occ
        ev = CounterMetricFamily(f"{p}_kv_evictions", "KV blocks evicted from a tier", labels=["tier"])
        ev.add_metric(["device"], st.evicted_device)
        ev.add_metric(["host"], st.evicted_host)
        yield ev
        moves = CounterMetricFamily(f"{p}_kv_host_moves", "KV blocks moved between device and host tiers",
                                    labels=["direction"])
        moves.add_metric(["spill"], st.spilled_host)
        moves.add_metric(["load"], st.loaded_host)
        yield moves
        yield CounterMetricFamily(f"{p}_preemptions", "Sequences preempted for lack of KV blocks",
                                  value=st.preemptions)
        prefetch = CounterMetricFamily(f"{p}_kv_prefetch_blocks", "KV blocks of paused sessions warmed back from "
                                       "the host tier before the session's expected return (loaded), then hit by "
                                       "it (used) or evicted first (wasted)", labels=["outcome"])
        prefetch.add_metric(["loaded"], st.prefetch_loaded)
        prefetch.add_metric(["used"], st.prefetch_used)
        prefetch.add_metric(["wasted"], st.prefetch_wasted)
        yield prefetch
        yield GaugeMetricFamily(f"{p}_sessions", "Live sessions whose blocks the session-aware eviction keeps",
                                value=st.sessions)
        # "prefill": every step with prompt tokens, decode rows mixed in or not
        families = (CounterMetricFamily(f"{p}_engine_steps", "Forward steps", labels=["kind"]),
                    CounterMetricFamily(f"{p}_engine_step_rows", "Sequences in those steps (the batch, summed)",
                                        labels=["kind"]),
                    CounterMetricFamily(f"{p}_engine_step_seconds", "Wall time of those steps", labels=["kind"]),
                    CounterMetricFamily(f"{p}_engine_step_cpu_seconds", "CPU time the engine thread spent in "
                                        "those steps (below the wall time: it waited for the GIL or a core)",
                                        labels=["kind"]))
        for kind, counts in (("decode", st.decode_steps), ("prefill", st.prefill_steps)):
            for family, value in zip(families, dataclasses.astuple(counts)):
                family.add_metric([kind], value)
        yield from families
        if st.slo is not None:  # goodput: finished requests with a latency target that met all of theirs
            outcomes = CounterMetricFamily(f"{p}_slo_requests", "Finished requests with a latency target, by "
                                           "outcome (met: goodput; missed_ttft / missed_itl: which target a missed "
                                           "one missed, both for some)", labels=["outcome"])
            for outcome, n in dataclasses.asdict(st.slo).items():
                outcomes.add_metric([outcome], n)
            yield outcomes
        speed = st.speed  # what this instance beats to the router's cost model
        if speed.prefill_tok_per_s is not None:
            yield GaugeMetricFamily(f"{p}_prefill_tokens_per_second", "Measured prefill speed (fit of step time = "
                                    "overhead + tokens / speed over recent forward steps)",
                                    value=speed.prefill_tok_per_s)
        if speed.prefill_overhead_s is not None:
            yield GaugeMetricFamily(f"{p}_prefill_overhead_seconds", "Measured fixed cost of one forward step",
                                    value=speed.prefill_overhead_s)


class CountsCollector(Collector, Generic[Label]):
    """A counter family with one label, read at scrape time from counts another object keeps (``counts()``:
    label value -> count since start, keyed by a string or a StrEnum; every value it lists is exported, zeros
    included)."""

    def __init__(self, name: str, documentation: str, label: str, counts: Callable[[], Mapping[Label, int]]) -> None:
        self.name, self.documentation, self.label, self.counts = name, documentation, label, counts

    def collect(self) -> Iterator[CounterMetricFamily]:
        family = CounterMetricFamily(self.name, self.documentation, labels=[self.label])
        for value, count in self.counts().items():
            family.add_metric([str(value)], count)
        yield family
