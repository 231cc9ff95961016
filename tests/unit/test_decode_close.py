"""A graceful stop of decode lets its write-backs in flight finish (bounded), so the last turn reaches the pool."""

from __future__ import annotations

import asyncio

import pytest

from services.decode import servicer as decode_servicer
from services.decode.servicer import DecodeServicer


def _servicer() -> DecodeServicer:
    s = DecodeServicer.__new__(DecodeServicer)  # only the background set: no engine host needed here
    s._background = set()
    return s


def _track(s: DecodeServicer, coro) -> asyncio.Task:
    task = asyncio.ensure_future(coro)
    s._background.add(task)
    task.add_done_callback(s._background.discard)
    return task


def test_close_waits_for_a_write_back_in_flight():
    async def main() -> list[str]:
        s, done = _servicer(), []

        async def write_back() -> None:
            await asyncio.sleep(0.05)
            done.append("stored")

        _track(s, write_back())
        await s.close()
        return done

    assert asyncio.run(main()) == ["stored"]


def test_close_cancels_what_outlives_the_drain(monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setattr(decode_servicer, "WRITE_BACK_DRAIN_S", 0.05)

    async def main() -> bool:
        s = _servicer()
        task = _track(s, asyncio.Event().wait())  # a write-back that never ends
        await s.close()
        await asyncio.sleep(0)
        return task.cancelled()

    assert asyncio.run(main())
