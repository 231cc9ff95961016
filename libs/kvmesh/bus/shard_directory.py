"""The cachesvc shards as their beats on the bus tell them (``cache.shard.<shard>``, ``CacheShardBeat``): what a router
or an instance whose ``cachesvc_address`` is ``"nats"`` dials, instead of a list in its configuration.

A view is a whole shard list: ``shards`` addresses in shard order, every one of them heard with that same count
within ``fresh_s``. It changes only to another whole list, so a shard that restarts (silent for a few seconds) or
beats with a new count before its peers do (a resharding under way, one shard at a time) leaves the callers on the
list they have, calling that shard as down until it answers again, as a configured list would; once every shard
of the new count beats, the callers move to it (``kvmesh.contracts.shards`` maps keys over it, so every caller
that heard the same beats agrees without talking). A shard that is gone for good leaves the view only when the
others beat with a count without it. A shard leaving the cluster beats its own number, at or past the count it
serves (``CacheServiceSettings.leaving``): never in a view, only in :meth:`ShardDirectory.leaving`, for the other
shards' hand-over.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from kvmesh.bus.bus import Bus
from kvmesh.bus.subjects import Subjects
from kvmesh.contracts.messages import CacheShardBeat, Message

log = logging.getLogger(__name__)

DISCOVER = "nats"  # the cachesvc_address that means: find the shards through the bus
FRESH_S = 5.0  # a beat older than this does not count towards a new view


@dataclass
class ShardDirectory:
    """The latest beat of each shard, and the shard list they make (``view``); ``on_change`` is called with each
    new list."""

    fresh_s: float = FRESH_S
    on_change: Callable[[tuple[str, ...]], None] | None = None
    view: tuple[str, ...] = ()
    _beats: dict[int, tuple[CacheShardBeat, float]] = field(default_factory=dict)  # shard -> beat, when heard
    _changed: asyncio.Event = field(default_factory=asyncio.Event)

    async def start(self, bus: Bus, subjects: Subjects) -> None:
        await bus.subscribe(subjects.cachesvc_shards_all, self._heard)

    async def _heard(self, msg: Message, headers: dict[str, str]) -> None:
        if isinstance(msg, CacheShardBeat):
            self.heard(msg)

    def heard(self, beat: CacheShardBeat, now: float | None = None) -> None:
        now = time.monotonic() if now is None else now
        self._beats[beat.shard] = (beat, now)
        whole = self._whole(beat.shards, now)
        if whole is not None and whole != self.view:
            log.info("cachesvc shards from the bus: %s (was %s)", ", ".join(whole) or "-", ", ".join(self.view) or "-")
            self.view = whole
            self._changed.set()
            if self.on_change is not None:
                self.on_change(whole)

    def leaving(self, shards: int, now: float | None = None) -> dict[int, str]:
        """The shards leaving a cluster of ``shards`` (number past the count, beating it lately with an address):
        their addresses by shard number."""
        now = time.monotonic() if now is None else now
        return {i: beat.address for i, (beat, at) in sorted(self._beats.items())
                if i >= shards and beat.shards == shards and beat.address and now - at <= self.fresh_s}

    def _whole(self, shards: int, now: float) -> tuple[str, ...] | None:
        """The list of ``shards`` addresses if every shard of that count has beaten it lately with an address."""
        out = []
        for i in range(shards):
            beat, at = self._beats.get(i, (None, 0.0))
            if beat is None or beat.shards != shards or not beat.address or now - at > self.fresh_s:
                return None
            out.append(beat.address)
        return tuple(out)

    async def wait(self, timeout_s: float, shards: int = 0) -> tuple[str, ...]:
        """The view, once there is one (of ``shards`` shards, when given), else what it is after ``timeout_s``."""
        deadline = asyncio.get_running_loop().time() + timeout_s
        while not self.view or (shards and len(self.view) != shards):
            self._changed.clear()
            left = deadline - asyncio.get_running_loop().time()
            if left <= 0:
                break
            try:
                await asyncio.wait_for(self._changed.wait(), left)
            except TimeoutError:
                break
        return self.view
