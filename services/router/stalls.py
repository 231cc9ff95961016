"""The inter-token watchdog: a stream that sent its first token and then none for ``inter_token_timeout_s``, from an
instance whose heartbeats show no engine step in that time either, has stalled (an engine thread that hangs while
its process still beats); it is given up on like a dropped instance's, and migrates. A stream that waits its turn
while its engine steps (preempted, queued behind others) is left alone, and the wait for the first token (a long
prefill) is never watched. Checked by the router's tending loop; a token costs one clock read."""

from __future__ import annotations

import time
from collections.abc import Callable

from services.router.registry import Registry


class Watched:
    """One stream's last token (monotonic)."""

    __slots__ = ("instance", "last", "lost")

    def __init__(self, instance: str, lost: Callable[[str], None]) -> None:
        self.instance, self.lost, self.last = instance, lost, time.monotonic()

    def tick(self) -> None:
        self.last = time.monotonic()


class StallWatch:
    def __init__(self, registry: Callable[[], Registry], limit_s: float) -> None:
        self.registry, self.limit_s = registry, limit_s
        self._streams: set[Watched] = set()

    def arm(self, instance: str, lost: Callable[[str], None]) -> Watched | None:
        """Watch a stream from its first token on (None when the watchdog is off); ``lost(reason)`` gives it up."""
        if not self.limit_s:
            return None
        watched = Watched(instance, lost)
        self._streams.add(watched)
        return watched

    def disarm(self, watched: Watched | None) -> None:
        if watched is not None:
            self._streams.discard(watched)

    def check(self) -> None:
        now, limit = time.monotonic(), self.limit_s
        for s in [s for s in self._streams if now - s.last > limit]:
            if not self.registry().stepping(s.instance, limit):
                self._streams.discard(s)
                s.lost(f"instance {s.instance} stalled: no token and no engine step for {now - s.last:.1f}s "
                       "(inter_token_timeout_s)")
