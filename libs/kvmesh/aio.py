"""The services' event loop: uvloop where it is installed (a dependency on Linux), asyncio's own otherwise.

Measured on the router (``kvmesh bench routers --only "kvmesh cache_aware" --rounds 1 --seconds 15``, runs
interleaved on one machine): uvloop 421 and 421 decisions/s against asyncio's 406 and 398 in one sitting, 337 and
335 against 357 and 330 in a busier one: +1.5% over the four pairs, within a sitting's spread. It is kept as the
default for what it does not cost (vLLM's and SGLang's servers run on it too).
``shared.event_loop`` picks: ``auto`` (uvloop when importable), ``uvloop`` (an error without it), ``asyncio``.
"""

from __future__ import annotations

import asyncio
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


def run(main: Coroutine[Any, Any, T], choice: str = "auto") -> T:
    """``asyncio.run(main)`` on the loop ``choice`` names."""
    if loop_name(choice) == "uvloop":
        import uvloop

        log.debug("event loop: uvloop %s", uvloop.__version__)
        return uvloop.run(main)
    return asyncio.run(main)
