"""A PD fleet whose size changes while a trace replays: prefill instances routed by the real cache-aware policy
(``kvmesh.routing``) over block caches evicted by the real strategies (``app.sim.BlockCache``) and the global
pool, decode instances chosen by the router's rule (``kvmesh.routing.plan.choose_decode``), and a scaler
consulted every ``window_s`` that sets each pool's size.

A new instance serves ``startup_s`` after it is asked for, with an empty cache. An instance scaled in takes no new
work and leaves when its queue (prefill) or its streams (decode) are done: nothing is lost. Every instance costs
from the moment it is asked for until it leaves (instance-hours).

Prefill: first come first served per instance, a prompt's time the prefill of the tokens not cached plus the
fetch of blocks taken from the pool. Decode: ticks of ``tick_s``; an instance with B streams steps
``step_base_s + B * step_per_stream_s``, every stream gets one token a step; a stream waits for an instance with
KV room. TTFT = until the first token (prefill done and a decode slot taken); ITL = a request's mean gap."""

from __future__ import annotations

import heapq
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from kvmesh.contracts.ids import Role
from kvmesh.planning import InstanceLoad, Speed, Traffic
from kvmesh.routing import CacheAware, Candidate, CostModel
from kvmesh.routing.plan import InstanceView, choose_decode

from app.bench.trace import TRACE_BLOCK_TOKENS, TraceRequest
from app.sim import BlockCache


@dataclass
class Prefill:
    id: str
    cache: BlockCache
    ready_at: float
    free_at: float = 0.0
    leaving: bool = False
    busy: list[tuple[float, float]] = field(default_factory=list)  # (start, end) of each prefill

    def queued_tokens(self, t: float, tok_per_s: float) -> float:
        return max(0.0, self.free_at - t) * tok_per_s

    def busy_s(self, since: float, until: float) -> float:
        return sum(max(0.0, min(e, until) - max(s, since)) for s, e in self.busy if e > since)


@dataclass
class Stream:
    n: int            # the request's index
    left: float       # tokens still to come
    context: float    # its tokens in KV
    gaps_s: float = 0.0
    tokens: float = 0.0


@dataclass
class Decode:
    id: str
    ready_at: float
    streams: list[Stream] = field(default_factory=list)
    leaving: bool = False

    def kv(self) -> float:
        return sum(s.context for s in self.streams)


@dataclass(frozen=True)
class Sizes:
    prefill: int
    decode: int


@dataclass
class Window:
    """What a scaler sees at ``now``: the fleet's loads (serving instances), the last window's traffic, each
    pool's size now (starting instances included), its prefill busy share and decode batch occupancy."""

    now: float
    fleet: list[InstanceLoad]
    traffic: Traffic
    sizes: Sizes
    prefill_busy: float
    decode_busy: float


Scaler = Callable[[Window], Sizes]


@dataclass(frozen=True)
class FleetModel:
    """The simulated instances: ``speed`` (what the planner is configured with, which the instances meet exactly),
    the blocks of 512 tokens each prefill instance caches, the global pool's, fetch cost, and how long an
    instance takes to start."""

    speed: Speed
    cache_blocks: int = 2000
    pool_blocks: int = 20000
    fetch_gbps: float = 10.0
    block_bytes: int = 64 * 2**20
    startup_s: float = 60.0
    window_s: float = 15.0
    tick_s: float = 0.25

    def cost(self) -> CostModel:
        return CostModel(self.speed.prefill_tok_per_s, self.speed.prefill_overhead_s, self.fetch_gbps,
                         self.block_bytes, calibrated=True)


@dataclass
class Result:
    ttft_s: list[float]
    itl_s: list[float]
    instance_s: float
    sizes: list[tuple[float, int, int]]  # (time, prefill, decode) at each window

    def attainment(self, ttft_target: float, itl_target: float) -> float:
        met = sum(t <= ttft_target and i <= itl_target for t, i in zip(self.ttft_s, self.itl_s, strict=True))
        return met / len(self.ttft_s)


class Fleet:
    def __init__(self, model: FleetModel, start: Sizes) -> None:
        self.m = model
        self.cost = model.cost()
        self.prefills: list[Prefill] = []
        self.decodes: list[Decode] = []
        self.serial = 0
        self.instance_s = 0.0
        self.pool = BlockCache(model.pool_blocks)
        self.resize(Sizes(start.prefill, start.decode), at=-math.inf)

    def _name(self, role: str) -> str:
        self.serial += 1
        return f"{role}{self.serial:03d}"

    def sizes(self) -> Sizes:
        return Sizes(sum(not p.leaving for p in self.prefills), sum(not d.leaving for d in self.decodes))

    def resize(self, want: Sizes, at: float) -> None:
        """Start instances (serving ``startup_s`` after ``at``) or mark the least loaded ones leaving."""
        ready = at + self.m.startup_s if at > -math.inf else 0.0
        have = self.sizes()
        for _ in range(want.prefill - have.prefill):
            self.prefills.append(Prefill(self._name("p"), BlockCache(self.m.cache_blocks), ready, free_at=ready))
        for _ in range(want.decode - have.decode):
            self.decodes.append(Decode(self._name("d"), ready))
        # a starting one leaves first (nothing to drain), then the least loaded
        staying = sorted((p for p in self.prefills if not p.leaving), key=lambda p: (p.ready_at <= at, p.free_at))
        for p in staying[:max(0, have.prefill - want.prefill)]:
            p.leaving = True
        staying_d = sorted((d for d in self.decodes if not d.leaving), key=lambda d: (d.ready_at <= at, len(d.streams)))
        for d in staying_d[:max(0, have.decode - want.decode)]:
            d.leaving = True

    def tend(self, t: float, dt: float) -> None:
        """Count ``dt`` of every instance's time; let go the leaving ones with nothing left."""
        self.instance_s += dt * (len(self.prefills) + len(self.decodes))
        self.prefills = [p for p in self.prefills if not (p.leaving and (p.free_at <= t or p.ready_at > t))]
        self.decodes = [d for d in self.decodes if not (d.leaving and (not d.streams or d.ready_at > t))]


def replay(trace: Sequence[TraceRequest], model: FleetModel, start: Sizes, scaler: Scaler | None = None) -> Result:
    """Replay ``trace`` (arrival times in seconds, sorted) on a fleet of ``start`` sizes, resized by ``scaler``
    every ``window_s``."""
    fleet, speed, cost = Fleet(model, start), model.speed, model.cost()
    chooser = CacheAware(cost, use_pool=True)
    n_req = len(trace)
    ttft = [math.inf] * n_req
    itl = [math.inf] * n_req
    ready: list[tuple[float, int]] = []  # (prefill done, request): waiting for a decode slot
    window: list[tuple[int, int]] = []   # (request, prompt tokens served from cache) of this window
    sizes: list[tuple[float, int, int]] = []
    end = trace[-1].arrival_s if trace else 0.0
    t, nxt, last_plan = 0.0, 0, 0.0
    while nxt < n_req or ready or any(d.streams for d in fleet.decodes):
        t_next = t + model.tick_s
        while nxt < n_req and trace[nxt].arrival_s < t_next:  # prefill, exactly, in arrival order
            r, at = trace[nxt], trace[nxt].arrival_s
            live = [p for p in fleet.prefills if not p.leaving and p.ready_at <= at] or \
                [min((p for p in fleet.prefills if not p.leaving), key=lambda p: p.ready_at)]
            pool_prefix = fleet.pool.prefix(r.hash_ids)
            cands = [Candidate(p.id, queued_tokens=int(p.queued_tokens(at, speed.prefill_tok_per_s)),
                               local_blocks=p.cache.prefix(r.hash_ids)) for p in live]
            chosen = chooser.choose(cands, r.input_length, TRACE_BLOCK_TOKENS, pool_prefix).chosen
            assert chosen is not None
            inst = next(p for p in live if p.id == chosen.id)
            fetched = max(0, pool_prefix - chosen.local_blocks)
            hit = min(r.input_length - 1, (chosen.local_blocks + fetched) * TRACE_BLOCK_TOKENS)
            begin = max(at, inst.free_at)
            inst.free_at = begin + cost.prefill_s(r.input_length - hit) + cost.fetch_s(fetched)
            inst.busy.append((begin, inst.free_at))
            inst.cache.touch(r.hash_ids, chosen.local_blocks)
            fleet.pool.touch(r.hash_ids, pool_prefix)
            heapq.heappush(ready, (inst.free_at, nxt))
            window.append((nxt, hit))
            nxt += 1
        live_d = [d for d in fleet.decodes if not d.leaving and d.ready_at <= t_next]
        while ready and ready[0][0] < t_next and live_d:  # decode takes those whose KV fits
            views = [InstanceView(d.id, "decode", queue_depth=len(d.streams),
                                  free_blocks=int(speed.kv_tokens - d.kv())) for d in live_d]
            n = ready[0][1]
            need = trace[n].input_length + 1
            room = [v for v in views if v.free_blocks >= need]
            if not room:
                break
            done_at, _ = heapq.heappop(ready)
            d = next(x for x in live_d if x.id == choose_decode(room).id)
            ttft[n] = max(done_at, t) - trace[n].arrival_s
            d.streams.append(Stream(n, max(0, trace[n].output_length - 1), need))
        for d in fleet.decodes:  # every stream gets tick_s / step of tokens
            if not d.streams:
                continue
            step = speed.step_s(len(d.streams))
            got = model.tick_s / step
            done = []
            for s in d.streams:
                k = min(got, s.left)
                s.left -= k
                s.context += k
                s.tokens += k
                s.gaps_s += k * step
                if s.left <= 0:
                    done.append(s)
            for s in done:
                d.streams.remove(s)
                itl[s.n] = s.gaps_s / s.tokens if s.tokens else 0.0
        t = t_next
        fleet.tend(t, model.tick_s)
        if scaler is not None and t - last_plan >= model.window_s and t <= end:
            last_plan = t
            w = _window(fleet, trace, window, t, model)
            window = []
            want = scaler(w)
            fleet.resize(Sizes(max(1, want.prefill), max(1, want.decode)), at=t)
        if t - (sizes[-1][0] if sizes else -math.inf) >= model.window_s:
            s = fleet.sizes()
            sizes.append((t, s.prefill, s.decode))
    return Result(ttft, itl, fleet.instance_s, sizes)


def _window(fleet: Fleet, trace: Sequence[TraceRequest], window: list[tuple[int, int]], t: float,
            model: FleetModel) -> Window:
    speed = model.speed
    prompts = [trace[n].input_length for n, _ in window]
    traffic = Traffic.of(model.window_s, prompts, [trace[n].output_length for n, _ in window],
                         sum(h for _, h in window))
    loads = [InstanceLoad(p.id, Role.PREFILL, waiting_tokens=p.queued_tokens(t, speed.prefill_tok_per_s),
                          prefill_tok_per_s=speed.prefill_tok_per_s, prefill_overhead_s=speed.prefill_overhead_s)
             for p in fleet.prefills if not p.leaving and p.ready_at <= t]
    loads += [InstanceLoad(d.id, Role.DECODE, running=len(d.streams), kv_used=d.kv() / speed.kv_tokens,
                           kv_tokens=speed.kv_tokens, decode_step_s=speed.step_s(len(d.streams) + 1))
              for d in fleet.decodes if not d.leaving and d.ready_at <= t]
    serving = [p for p in fleet.prefills if p.ready_at <= t]
    for p in serving:
        p.busy = [b for b in p.busy if b[1] > t - model.window_s]
    busy = sum(p.busy_s(t - model.window_s, t) for p in serving) / (model.window_s * max(1, len(serving)))
    decoding = [d for d in fleet.decodes if d.ready_at <= t]
    return Window(t, loads, traffic, fleet.sizes(), busy,
                  sum(len(d.streams) for d in decoding) / max(1, len(decoding)))
