"""Live instances, from heartbeats. An instance that stops beating is dropped after a timeout."""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

from kvmesh.contracts.messages import Heartbeat

log = logging.getLogger(__name__)


@dataclass
class Instance:
    beat: Heartbeat
    last_seen: float
    inflight: int = 0            # requests this router sent there and has not seen finish
    inflight_tokens: int = 0     # their prompt tokens (prefill work not yet done, as far as we know)
    loras_ts: float = 0.0        # the instance's clock when a reply to our LoRA call listed beat.loras

    @property
    def id(self) -> str:
        return self.beat.instance_id

    @property
    def queue_depth(self) -> float:
        """The larger of what the instance last reported and what we know we sent it: a heartbeat sent before
        our request reached its engine must not make a busy instance look idle."""
        load = self.beat.load
        return max(load.get("running", 0) + load.get("waiting", 0), self.inflight)

    @property
    def waiting_tokens(self) -> float:
        return max(self.beat.load.get("waiting_tokens", 0), self.inflight_tokens)


class Registry:
    def __init__(self, timeout_s: float, block_size: int, fingerprint: str) -> None:
        self.timeout_s = timeout_s
        self.block_size = block_size
        self.fingerprint = fingerprint
        self._instances: dict[str, Instance] = {}
        self._refused: set[str] = set()
        self._gone: dict[str, Instance] = {}

    def observe(self, beat: Heartbeat) -> None:
        if beat.block_size != self.block_size or beat.model != self.fingerprint:
            if beat.instance_id not in self._refused:
                log.warning("ignoring instance %s: model %s / block size %d differ from the router's %s / %d",
                            beat.instance_id, beat.model[:12], beat.block_size, self.fingerprint[:12],
                            self.block_size)
                self._refused.add(beat.instance_id)
            return
        if beat.instance_id not in self._instances:
            log.info("instance %s (%s) joined at %s", beat.instance_id, beat.role, beat.grpc_address)
        old = self._instances.get(beat.instance_id)
        loras_ts = old.loras_ts if old else 0.0
        if old is not None and beat.ts < loras_ts:  # built before our LoRA call's reply: its adapters are stale
            beat = dataclasses.replace(beat, loras=old.beat.loras)
        self._instances[beat.instance_id] = Instance(beat, time.monotonic(), old.inflight if old else 0,
                                                     old.inflight_tokens if old else 0, loras_ts)

    def update_loras(self, iid: str, loras: tuple[tuple[str, str, str], ...], ts: float) -> None:
        """An instance's adapters as the reply to a LoRA call lists them (taken at ``ts``, its clock): fresher
        than its heartbeats stamped before ``ts``, which may still be in flight."""
        for inst in {id(i): i for i in (self._instances.get(iid), self._gone.get(iid)) if i is not None}.values():
            if ts >= inst.loras_ts:
                inst.beat = dataclasses.replace(inst.beat, loras=loras)
                inst.loras_ts = ts

    def alive(self, *roles: str) -> list[Instance]:
        now = time.monotonic()
        for iid in [i for i, inst in self._instances.items() if now - inst.last_seen > self.timeout_s]:
            log.warning("instance %s dropped: no heartbeat for %.1fs", iid, now - self._instances[iid].last_seen)
            del self._instances[iid]
        return [i for i in self._instances.values() if not roles or i.beat.role in roles]

    def dispatched(self, inst: Instance, prompt_tokens: int = 0) -> Callable[[], None]:
        """Count a request we are sending to ``inst`` until the returned ``done`` is called (once)."""
        iid = inst.id
        self._live(iid).inflight += 1
        self._live(iid).inflight_tokens += prompt_tokens
        called = False

        def done() -> None:
            nonlocal called
            if not called:
                called = True
                cur = self._live(iid)
                cur.inflight = max(0, cur.inflight - 1)
                cur.inflight_tokens = max(0, cur.inflight_tokens - prompt_tokens)
        return done

    def role_of(self, iid: str) -> str:
        """The role ``iid`` beats with (decode when it is no longer known: only decode streams are retried)."""
        inst = self._instances.get(iid)
        return inst.beat.role if inst else "decode"

    def _live(self, iid: str) -> Instance:
        """The current record of an instance (heartbeats replace records); a dropped one gets a scratch record."""
        return self._instances.get(iid) or self._gone.setdefault(iid, Instance(Heartbeat(
            instance_id=iid, role="decode", grpc_address="", transfer_address="", ts=0.0, load={}, model="",
            block_size=0), 0.0))
