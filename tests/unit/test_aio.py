"""The services' event loop (``kvmesh.aio``): uvloop where installed, asyncio's on request, a clear error when
uvloop is asked for and missing."""

from __future__ import annotations

import asyncio
import builtins

import pytest
from kvmesh import aio
from kvmesh.settings import SharedSettings


async def loop_type() -> str:
    return type(asyncio.get_running_loop()).__module__


def test_auto_runs_on_uvloop_and_asyncio_on_its_own_loop():
    pytest.importorskip("uvloop")
    assert aio.run(loop_type(), "auto").startswith("uvloop")
    assert aio.run(loop_type(), "asyncio").startswith("asyncio")
    assert SharedSettings().event_loop == "auto" and SharedSettings.choices_of("event_loop") == aio.LOOPS


def test_without_uvloop_auto_falls_back_and_uvloop_says_what_to_do(monkeypatch):
    real = builtins.__import__

    def no_uvloop(name, *a, **kw):
        if name == "uvloop":
            raise ImportError(name)
        return real(name, *a, **kw)

    monkeypatch.setattr(builtins, "__import__", no_uvloop)
    assert aio.loop_name("auto") == "asyncio"
    with pytest.raises(RuntimeError, match="uvloop is not installed: pip install uvloop"):
        aio.loop_name("uvloop")
    with pytest.raises(ValueError, match="event_loop must be one of auto, uvloop, asyncio"):
        aio.loop_name("trio")
