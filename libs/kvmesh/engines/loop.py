"""One thread owns an engine; coroutines hand it commands and receive each request's outputs.

``EngineLoop`` is the part every backend shares: the command queue, the thread that runs the commands in order
and steps the engine while it has work, and the per-request output queues on the event loop. A backend says what
"busy" and "one step" mean (``busy``, ``step``) and what to do after each round (``after_round``: hand KV events
over, say).

Ownership: only the loop's thread touches the engine. ``call`` runs a command there and awaits its result;
``submit`` queues one nobody waits for (releases that must happen even while the caller is being cancelled),
in the same order as the rest. Outputs reach a request's stream through ``deliver`` (from the thread) and
``loop.call_soon_threadsafe``.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

log = logging.getLogger(__name__)
_NOTHING = object()


class EngineLoop:
    def __init__(self, loop: asyncio.AbstractEventLoop, name: str = "engine") -> None:
        self.loop = loop
        self._commands: queue.Queue[Callable[[], Any] | None] = queue.Queue()
        self._streams: dict[str, asyncio.Queue[Any]] = {}
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)

    # ---- what a backend defines (run on the loop's thread) -------------------------------------------------
    def busy(self) -> bool:
        """Whether the engine has work (the thread steps it instead of waiting for a command)."""
        raise NotImplementedError

    def step(self) -> None:
        """One step of the engine; outputs go out through ``deliver``."""
        raise NotImplementedError

    def after_round(self) -> None:
        """After the commands that arrived and the step they led to."""

    def idle_in(self) -> float | None:
        """While not busy: seconds until ``idle`` has work (None: none), e.g. the KV canary's next recompute."""
        return None

    def idle(self) -> None:
        """One short piece of background work, run only when the engine has nothing else to do."""

    # ---- called from the event loop ------------------------------------------------------------------------
    def start(self) -> None:
        self._thread.start()

    async def run(self, fn: Callable[[], Any]) -> Any:
        """Run ``fn()`` on the loop's thread and await its result (exceptions propagate)."""
        fut: Future[Any] = Future()

        def command() -> None:
            if not fut.set_running_or_notify_cancel():
                return  # the caller went away before the engine got to it: nothing to run, no one to answer
            try:
                fut.set_result(fn())
            except BaseException as e:  # noqa: BLE001 - handed to the awaiting coroutine
                fut.set_exception(e)

        self._commands.put(command)
        return await asyncio.wrap_future(fut)

    def queue(self, fn: Callable[[], Any]) -> None:
        """Run ``fn()`` on the loop's thread, in order with the other commands; nobody waits for it. Failures are
        logged."""
        self._commands.put(fn)

    def open_stream(self, request_id: str) -> asyncio.Queue[Any]:
        stream: asyncio.Queue[Any] = asyncio.Queue()
        self._streams[request_id] = stream
        return stream

    def close_stream(self, request_id: str) -> bool:
        """Forget a request's stream; True when it was still open (the request may still run: abort it)."""
        return self._streams.pop(request_id, None) is not None

    async def stop(self, timeout: float = 10.0) -> None:
        self._commands.put(None)
        await self.loop.run_in_executor(None, self._thread.join, timeout)

    def stop_now(self, timeout: float = 10.0) -> None:
        """``stop`` for a caller without a running event loop (tools, tests)."""
        self._commands.put(None)
        self._thread.join(timeout)

    # ---- on the loop's thread ------------------------------------------------------------------------------
    def deliver(self, request_id: str, item: Any) -> None:
        stream = self._streams.get(request_id)
        if stream is not None:
            self.loop.call_soon_threadsafe(stream.put_nowait, item)

    def _run(self) -> None:
        cmd: Callable[[], Any] | object | None
        while True:
            try:
                wait = None if self.busy() else self.idle_in()
                if self.busy() or wait == 0:
                    cmd = self._commands.get_nowait()
                else:
                    cmd = self._commands.get(timeout=wait)
            except queue.Empty:
                cmd = _NOTHING
            while cmd is not _NOTHING:  # run every command that arrived, then step once
                if cmd is None:
                    return
                try:
                    cmd()  # type: ignore[operator]
                except Exception:
                    log.exception("engine command failed")
                try:
                    cmd = self._commands.get_nowait()
                except queue.Empty:
                    cmd = _NOTHING
            if self.busy():
                self.step()
            elif self.idle_in() == 0:
                try:
                    self.idle()
                except Exception:
                    log.exception("idle work failed")
            self.after_round()
