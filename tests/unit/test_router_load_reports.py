"""A router's in-flight counts reach its replicas after every change, at most every ``LOAD_EVERY_S``: the changes
of one turn of the event loop, and those made within that time after a report, go out as one report carrying the
latest counts (one report per dispatch start and end cost a busy router ~3% of its CPU)."""

from __future__ import annotations

import asyncio
import time

from kvmesh.contracts.messages import Message, RouterLoad
from kvmesh.settings import RouterSettings

from services.router import core


def test_changes_within_the_interval_go_out_as_one_later_report_with_the_latest_counts(monkeypatch):
    monkeypatch.setattr(core, "LOAD_EVERY_S", 0.5)  # far longer than the changes below take on any machine
    sent: list[tuple[float, RouterLoad]] = []

    class Bus:
        async def publish(self, subject: str, msg: Message) -> None:
            assert isinstance(msg, RouterLoad)
            sent.append((time.monotonic(), msg))

    async def body() -> None:
        router = core.Router(RouterSettings())
        router.bus = Bus()  # type: ignore[assignment]
        counts = iter(range(1, 100))

        class Registry:  # what start() makes from the model; only the counts matter here
            def own_load(self) -> tuple[dict[str, int], dict[str, int]]:
                return {"e": next(counts)}, {}

        router.registry = Registry()  # type: ignore[assignment]
        for _ in range(3):  # one turn: one report, at once
            router._load_changed()
        await asyncio.sleep(0)
        await asyncio.sleep(0)
        assert [m.inflight for _, m in sent] == [{"e": 1}]
        for _ in range(10):  # ten turns within the interval: nothing yet ...
            router._load_changed()
            await asyncio.sleep(0)
        assert len(sent) == 1
        deadline = time.monotonic() + 10
        while len(sent) < 2:  # ... then one report, the interval after the first, with the counts then
            assert time.monotonic() < deadline, "the changes were never reported"
            await asyncio.sleep(0.01)
        assert [m.inflight for _, m in sent] == [{"e": 1}, {"e": 2}]
        assert sent[1][0] - sent[0][0] >= 0.5 - 0.01
        await asyncio.sleep(0.6)
        assert len(sent) == 2  # nothing changed since: nothing more
        router.tokenize_pool.shutdown(wait=False)

    asyncio.run(body())
