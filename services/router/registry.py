"""Live instances, from heartbeats. An instance that stops beating is dropped after a timeout (not while the
router's own NATS connection is down: their silence is then the bus's), and whoever watches a dispatch to it is
told. What each instance has in flight: this router's own dispatches, plus what the other router replicas report
(``RouterLoad`` over NATS), so replicas do not all pick the instance that looks idle to each of them alone."""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from kvmesh.contracts.ids import InstanceId, Role
from kvmesh.contracts.messages import Heartbeat, InstanceLoad, RouterLoad
from kvmesh.routing import CostModel

log = logging.getLogger(__name__)


@dataclass
class Instance:
    beat: Heartbeat
    last_seen: float
    inflight: int = 0            # requests this router sent there and has not seen finish
    inflight_tokens: int = 0     # their prompt tokens (prefill work not yet done, as far as we know)
    loras_ts: float = 0.0        # the instance's clock when a reply to our LoRA call listed beat.loras
    peer_inflight: int = 0       # what the other router replicas last reported in flight there
    peer_tokens: int = 0
    progressed: float = 0.0      # when a heartbeat last showed its engine stepping (monotonic; joined: first beat)
    # (its load, the configured model, what it measured over that model): priced once per heartbeat, not per request
    _cost: tuple[InstanceLoad, CostModel, CostModel | None] | None = field(default=None, repr=False, compare=False)
    # the planner's view of it and what that view was built from (``scheduling.view``): rebuilt only when one of them
    # changed, as a large fleet is viewed whole on every request
    view_of: tuple[Any, ...] | None = field(default=None, repr=False, compare=False)

    def cost_model(self, default: CostModel) -> CostModel | None:
        """What the instance measured, over ``default`` (``CostModel.from_load``; None: it reports nothing usable),
        worked out once per heartbeat: a large fleet is priced on every request."""
        cached = self._cost
        if cached is None or cached[0] is not self.beat.load or cached[1] is not default:
            cached = self._cost = (self.beat.load, default, CostModel.from_load(self.beat.load, default))
        return cached[2]

    @property
    def id(self) -> InstanceId:
        return self.beat.instance_id

    @property
    def routed(self) -> int:
        """Requests in flight there that the routers (this one and its replicas) know they sent."""
        return self.inflight + self.peer_inflight

    @property
    def queue_depth(self) -> float:
        """The larger of what the instance last reported and what the routers know they sent it: a heartbeat
        sent before a request reached its engine must not make a busy instance look idle."""
        load = self.beat.load
        return max(load.running + load.waiting, self.routed)

    @property
    def waiting_tokens(self) -> float:
        return max(self.beat.load.waiting_tokens, self.inflight_tokens + self.peer_tokens)

    @property
    def ahead_tokens(self) -> tuple[int, ...]:
        """On a least-work engine, the queue a new prompt would wait for per edge of ``AHEAD_EDGES_S`` (what its
        heartbeat says, plus what the routers sent since that it does not show yet, ranked as ahead); empty: the
        whole queue (``waiting_tokens``)."""
        load = self.beat.load
        if not load.ahead_tokens:
            return ()
        unseen = max(0, self.inflight_tokens + self.peer_tokens - load.waiting_tokens)
        return tuple(n + unseen for n in load.ahead_tokens)

    @property
    def running(self) -> float:
        return self.beat.load.running

    @property
    def free_blocks(self) -> int:
        return self.beat.load.free_blocks

    @property
    def decode_step_s(self) -> float:
        """Its measured decode step (0: it reports none; vLLM's engine does not)."""
        return self.beat.load.speed.decode_step_s or 0.0


class Registry:
    def __init__(self, timeout_s: float, block_size: int, fingerprint: str) -> None:
        self.timeout_s = timeout_s
        self.block_size = block_size
        self.fingerprint = fingerprint
        self._instances: dict[str, Instance] = {}
        self._refused: set[str] = set()
        self._gone: dict[str, Instance] = {}
        self._watchers: dict[str, set[Callable[[str], None]]] = {}
        self._peers: dict[str, tuple[float, RouterLoad]] = {}  # router id -> (received, monotonic; its report)
        self.bus_up: Callable[[], bool] = lambda: True  # the router's NATS connection, which heartbeats need
        self.on_change: Callable[[], None] = lambda: None  # this router's own in-flight counts changed
        self.on_drop: Callable[[str], None] = lambda iid: None  # an instance was dropped (silent too long)

    def observe(self, beat: Heartbeat) -> None:
        if beat.block_size != self.block_size or beat.model != self.fingerprint:
            if beat.instance_id not in self._refused:
                log.warning("ignoring instance %s: model %s / block size %d differ from the router's %s / %d",
                            beat.instance_id, beat.model[:12], beat.block_size, self.fingerprint[:12],
                            self.block_size)
                self._refused.add(beat.instance_id)
            return
        old = self._instances.get(beat.instance_id)
        if old is None:
            log.info("instance %s (%s) joined at %s", beat.instance_id, beat.role, beat.grpc_address)
        if beat.draining and (old is None or not old.beat.draining):
            log.info("instance %s draining: no new requests go to it; the ones it runs finish there",
                     beat.instance_id)
        loras_ts = old.loras_ts if old else 0.0
        if old is not None and beat.ts < loras_ts:  # built before our LoRA call's reply: its adapters are stale
            beat = dataclasses.replace(beat, loras=old.beat.loras)
        now = time.monotonic()
        progressed = old.progressed if old is not None and beat.load.steps == old.beat.load.steps else now
        self._instances[beat.instance_id] = Instance(beat, now, old.inflight if old else 0,
                                                     old.inflight_tokens if old else 0, loras_ts,
                                                     old.peer_inflight if old else 0, old.peer_tokens if old else 0,
                                                     progressed)

    def update_loras(self, iid: str, loras: tuple[tuple[str, str, str], ...], ts: float) -> None:
        """An instance's adapters as the reply to a LoRA call lists them (taken at ``ts``, its clock): fresher
        than its heartbeats stamped before ``ts``, which may still be in flight."""
        for inst in {id(i): i for i in (self._instances.get(iid), self._gone.get(iid)) if i is not None}.values():
            if ts >= inst.loras_ts:
                inst.beat = dataclasses.replace(inst.beat, loras=loras)
                inst.loras_ts = ts

    def alive(self, *roles: str) -> list[Instance]:
        """The instances that take requests (of ``roles``): heard lately, and not draining."""
        self.expire()
        return [i for i in self._instances.values() if (not roles or i.beat.role in roles) and not i.beat.draining]

    def get(self, iid: str) -> Instance:
        """A live instance's record by id (one that ``alive`` just listed)."""
        return self._instances[iid]

    def expire(self) -> None:
        """Drop the instances silent for ``timeout_s`` and tell their watchers; while the bus is down nothing is
        dropped, and once it is back every instance gets ``timeout_s`` to be heard again."""
        now = time.monotonic()
        if not self.bus_up():
            for inst in self._instances.values():
                inst.last_seen = now
            return
        for iid in [i for i, inst in self._instances.items() if now - inst.last_seen > self.timeout_s]:
            why = f"instance {iid} stopped answering: no heartbeat for {now - self._instances[iid].last_seen:.1f}s"
            log.warning("%s; dropped", why)
            del self._instances[iid]
            self.on_drop(iid)
            for lost in list(self._watchers.pop(iid, ())):
                lost(why)
        self._expire_peers(now)

    def stepping(self, iid: str, within_s: float) -> bool:
        """Whether ``iid``'s heartbeats showed its engine stepping within the last ``within_s`` seconds (a stream
        that waits its turn there, preempted or queued, is not stalled)."""
        inst = self._instances.get(iid)
        return inst is not None and time.monotonic() - inst.progressed < within_s

    def watch(self, iid: str, lost: Callable[[str], None]) -> Callable[[], None]:
        """Call ``lost(reason)`` once if ``iid`` is dropped (a dispatch there then moves elsewhere); returns the
        function that stops watching."""
        self._watchers.setdefault(iid, set()).add(lost)
        return lambda: self._watchers.get(iid, set()).discard(lost)

    # ---- what the other router replicas have in flight ----------------------------------------------------------
    def peer_load(self, load: RouterLoad) -> None:
        """Another replica's report (absolute counts, replacing its last one)."""
        self._peers[load.router_id] = (time.monotonic(), load)
        self._sum_peers()

    def replica_rank(self, router_id: str) -> int:
        """``router_id``'s place among the router replicas heard from (0 when alone)."""
        return sorted({router_id, *self._peers}).index(router_id)

    def own_load(self) -> tuple[dict[str, int], dict[str, int]]:
        """This router's in-flight requests and prompt tokens per instance (what it reports to its replicas)."""
        records = {**self._gone, **self._instances}
        return ({iid: i.inflight for iid, i in records.items() if i.inflight},
                {iid: i.inflight_tokens for iid, i in records.items() if i.inflight_tokens})

    def _expire_peers(self, now: float) -> None:
        """A replica silent for ``timeout_s`` has died (or lost the bus): its counts no longer hold."""
        stale = [r for r, (seen, _) in self._peers.items() if now - seen > self.timeout_s]
        for router in stale:
            log.warning("router replica %s silent for %.1fs: its in-flight counts are dropped", router,
                        now - self._peers[router][0])
            del self._peers[router]
        if stale:
            self._sum_peers()

    def _sum_peers(self) -> None:
        for inst in self._instances.values():
            inst.peer_inflight = sum(load.inflight.get(inst.id, 0) for _, load in self._peers.values())
            inst.peer_tokens = sum(load.inflight_tokens.get(inst.id, 0) for _, load in self._peers.values())

    def dispatched(self, inst: Instance, prompt_tokens: int = 0) -> Callable[..., None]:
        """Count a request we are sending to ``inst`` until the returned ``done`` is called (once), and the
        ``prompt_tokens`` it will compute there until ``done(prefilled=True)`` says its prompt is computed (its
        first token came) or ``done()`` ends it: a request that is decoding queues no prefill."""
        iid = inst.id
        self._live(iid).inflight += 1
        self._live(iid).inflight_tokens += prompt_tokens
        self.on_change()
        called = tokens_out = False

        def done(prefilled: bool = False) -> None:
            nonlocal called, tokens_out
            if called:
                return
            cur = self._live(iid)
            if not tokens_out:
                tokens_out = True
                cur.inflight_tokens = max(0, cur.inflight_tokens - prompt_tokens)
            if not prefilled:
                called = True
                cur.inflight = max(0, cur.inflight - 1)
            self.on_change()
        return done

    def role_of(self, iid: str) -> str:
        """The role ``iid`` beats with (decode when it is no longer known: only decode streams are retried)."""
        inst = self._instances.get(iid)
        return inst.beat.role if inst else "decode"

    def _live(self, iid: str) -> Instance:
        """The current record of an instance (heartbeats replace records); a dropped one gets a scratch record."""
        return self._instances.get(iid) or self._gone.setdefault(iid, Instance(Heartbeat(
            instance_id=InstanceId(iid), role=Role.DECODE, grpc_address="", transfer_address="", ts=0.0,
            load=InstanceLoad(), model="", block_size=0), 0.0))
