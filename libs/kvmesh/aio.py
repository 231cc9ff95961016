"""The services' event loop: uvloop where it is installed (a dependency on Linux), asyncio's own otherwise.

Measured on the router (``kvmesh bench routers --only "kvmesh cache_aware" --rounds 1 --seconds 15``, runs
interleaved on one machine): uvloop 421 and 421 decisions/s against asyncio's 406 and 398 in one sitting, 337 and
335 against 357 and 330 in a busier one: +1.5% over the four pairs, within a sitting's spread. It is kept as the
default for what it does not cost (vLLM's and SGLang's servers run on it too).
``shared.event_loop`` picks: ``auto`` (uvloop when importable), ``uvloop`` (an error without it), ``asyncio``.

The cyclic garbage collector, also set here for the whole process (``shared.gc_threshold``, 10,000): Python scans
its youngest generation each time 700 more tracked objects were allocated than freed, and a service's bursts of
short-lived objects (a request's plan, its candidates, gRPC's call objects) cross that all the time though almost
all of them are freed by reference counting moments later. Measured on the router (the same bench, 15 s windows,
runs interleaved): at 700 it ran ~60 young collections a second, 8% of its CPU, and every ~2 s a full one of
~34 ms that showed in the latency p99; at 10,000, three collections in 15 s. Against the commit before, 3 runs
each: 572-585 against 515-528 decisions/s (1.71-1.75 against 1.89-1.94 ms of CPU a request), p99 66-68 against
93-101 ms, the same RSS. An engine process (``app.bench.engine_serving --quick``) spent 0.17 s collecting against
0.78 s over the same run, at the same tokens/s. Garbage in cycles is still collected, after 10,000 net allocations
instead of 700.
"""

from __future__ import annotations

import asyncio
import gc
import logging
from collections.abc import Coroutine
from typing import Any, TypeVar

T = TypeVar("T")
LOOPS = ("auto", "uvloop", "asyncio")  # shared.event_loop's values
log = logging.getLogger(__name__)


def loop_name(choice: str) -> str:
    """The loop ``choice`` runs on here: ``uvloop`` or ``asyncio``."""
    if choice not in LOOPS:
        raise ValueError(f"event_loop must be one of {', '.join(LOOPS)}, not {choice!r}")
    if choice == "asyncio":
        return "asyncio"
    try:
        import uvloop  # noqa: F401
    except ImportError:
        if choice == "uvloop":
            raise RuntimeError("event_loop is uvloop but uvloop is not installed: pip install uvloop, or set "
                               "event_loop = \"auto\"") from None
        return "asyncio"
    return "uvloop"


def run(main: Coroutine[Any, Any, T], choice: str = "auto", gc_threshold: int | None = None) -> T:
    """``asyncio.run(main)`` on the loop ``choice`` names, the collector's first threshold set to ``gc_threshold``
    first (None: left as it is)."""
    if gc_threshold is not None:
        gc.set_threshold(gc_threshold, *gc.get_threshold()[1:])
    if loop_name(choice) == "uvloop":
        import uvloop

        log.debug("event loop: uvloop %s", uvloop.__version__)
        return uvloop.run(main)
    return asyncio.run(main)
