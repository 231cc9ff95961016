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


@pytest.fixture
def thresholds():
    import gc

    before = gc.get_threshold()
    yield
    gc.set_threshold(*before)


def test_run_sets_the_collectors_first_threshold_and_keeps_the_others(thresholds):
    import gc

    gc.set_threshold(700, 11, 12)
    aio.run(loop_type(), "asyncio")
    assert gc.get_threshold() == (700, 11, 12)  # not asked: left as it is
    aio.run(loop_type(), "asyncio", gc_threshold=12_345)
    assert gc.get_threshold() == (12_345, 11, 12)


def test_gc_threshold_default_and_floor():
    assert SharedSettings().gc_threshold == 10_000
    with pytest.raises(ValueError, match="gc_threshold must be >= 100, not 50"):
        SharedSettings(gc_threshold=50)


@pytest.mark.parametrize("entry", ["router", "cachesvc", "prefill"])
def test_every_service_entry_point_runs_with_the_configured_threshold(entry, monkeypatch):
    """Each service's ``main`` hands ``shared.gc_threshold`` (here from the environment) to ``aio.run``."""
    seen = []

    def fake_run(main, choice="auto", gc_threshold=None):
        main.close()  # the service itself is not started
        seen.append(gc_threshold)

    monkeypatch.setattr(aio, "run", fake_run)
    monkeypatch.setenv("KVMESH_GC_THRESHOLD", "4321")
    if entry == "router":
        from services.router.__main__ import main as router_main

        router_main([])
    elif entry == "cachesvc":
        from services.cachesvc.__main__ import main as cachesvc_main

        assert cachesvc_main([]) == 0
    else:
        from kvmesh.instance.cli import main as instance_main

        instance_main("prefill", [], [])
    assert seen == [4321]
