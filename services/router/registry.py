"""Live instances, from heartbeats. An instance that stops beating is dropped after a timeout."""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

from kvmesh.bus import Heartbeat

log = logging.getLogger(__name__)


@dataclass
class Instance:
    beat: Heartbeat
    last_seen: float

    @property
    def id(self) -> str:
        return self.beat.instance_id

    @property
    def queue_depth(self) -> float:
        load = self.beat.load
        return load.get("running", 0) + load.get("waiting", 0)


class Registry:
    def __init__(self, timeout_s: float, block_size: int, fingerprint: str) -> None:
        self.timeout_s = timeout_s
        self.block_size = block_size
        self.fingerprint = fingerprint
        self._instances: dict[str, Instance] = {}
        self._refused: set[str] = set()

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
        self._instances[beat.instance_id] = Instance(beat, time.monotonic())

    def alive(self, *roles: str) -> list[Instance]:
        now = time.monotonic()
        for iid in [i for i, inst in self._instances.items() if now - inst.last_seen > self.timeout_s]:
            log.warning("instance %s dropped: no heartbeat for %.1fs", iid, now - self._instances[iid].last_seen)
            del self._instances[iid]
        return [i for i in self._instances.values() if not roles or i.beat.role in roles]

    def note_dispatch(self, inst: Instance, prompt_tokens: int = 0) -> None:
        """Count a request we just sent, so concurrent decisions before its next heartbeat see it."""
        inst.beat.load["waiting"] = inst.beat.load.get("waiting", 0) + 1
        inst.beat.load["waiting_tokens"] = inst.beat.load.get("waiting_tokens", 0) + prompt_tokens
