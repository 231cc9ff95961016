"""What the router knows of sessions: where each one's last request ran (affinity), whether it is paused (its
response ended in a tool call, or the client announced a pause), and the signals every cache hears
(``SessionSignal`` on ``kvmesh.<cluster>.sessions``: the engine instances, cachesvc and the other routers).

Placement. A session's next request goes where its last one ran, since that instance holds its KV, unless the
instance is overloaded: ``session_overload`` more requests queued or running than the least loaded candidate.
Then it goes where the routing policy sends it, and the KV follows through the pool (the last turn's
write-back; the new instance warms from it). A sub-agent's first request (a session with a ``parent``) goes where
its parent's last one ran: the prefix they share is there. The router forgets a session when it ends, and the
least recent ones beyond ``max_sessions``.

Shared by the replicas. Every placement is told to the other routers (``ROUTED`` on ``router.sessions``), and
every router hears the pauses and ends the others signal, so a session whose requests alternate between
replicas keeps its instance, and is known paused wherever it comes back.

Pause and resume. A response that ends in a tool call (its text ends with a ``</tool_call>`` block, opens one a
stop string cut short, or is a JSON object naming a function and its arguments; a request whose ``tool_choice``
forces a call always does), or a request that announced a pause (``session_pause_s``), means the session is
back once the tool ran: the caches keep its blocks (``PAUSE``; with ``session_retention: demote``, ``DEMOTE``:
they may move down the tiers meanwhile, and come back before the expected return), and the engine warms back
what it demoted before then. When the session's next request reaches
a router, before it is tokenized and routed, its home instance hears ``RESUME`` and warms the session's KV back
onto the device at once, overlapped with the routing and the queue.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import OrderedDict
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any

from kvmesh.contracts.engine import SessionHint
from kvmesh.contracts.messages import Message, SessionSignal
from kvmesh.contracts.sessions import Retention, SessionEvent
from kvmesh.routing import CostModel
from kvmesh.routing.plan import place_session

from services.router.registry import Instance
from services.router.scheduling import view
from services.router.tool_formats import CLOSE, FORMATS, OPEN, CallFormat

log = logging.getLogger(__name__)

Publish = Callable[[SessionSignal], Awaitable[None]]


def ends_in_tool_call(text: str, finish_reason: str = "", fmt: CallFormat | None = None) -> bool:
    """Whether a response's text ends in a tool call: Hermes / Qwen ``<tool_call>`` blocks, a JSON call, or a call
    in ``fmt`` (the router's ``tool_call_parser``), whether or not the request listed its tools."""
    t = text.strip()
    if t.endswith(CLOSE):
        return True
    if finish_reason == "stop" and t.rfind(OPEN) > t.rfind(CLOSE):
        return True  # a stop string ("</tool_call>") ended it inside the block
    if t.startswith("{") and FORMATS["llama3_json"].looks_like_call(t):
        return True
    return fmt is not None and fmt.looks_like_call(t)


class Sessions:
    """``publish``: a signal for every cache and router (``sessions``); ``share``: a placement for the other
    routers (``router.sessions``; None: this router keeps its own)."""

    def __init__(self, publish: Publish, affinity: bool = True, overload: int = 2,
                 max_sessions: int = 100_000, share: Publish | None = None) -> None:
        self.publish = publish
        self.share = share
        self.call_format: CallFormat | None = None  # the model's form of a tool call (the router sets it)
        self.affinity = affinity
        self.overload = overload
        self.max_sessions = max_sessions
        self._where: OrderedDict[str, str] = OrderedDict()  # session key -> the instance of its last request
        self._paused: dict[str, float] = {}  # session key -> when it paused (wall clock: the replicas share it)
        self._sending: set[asyncio.Task] = set()  # signals being published
        self.moved = 0  # requests that left their session's instance because it was overloaded
        self.resumed = 0  # paused sessions back whose instance was told to warm their KV (RESUME)
        self.forked = 0  # sub-agents' first requests placed where their parent's last one ran

    def __len__(self) -> int:
        return len(self._where)

    def instance_of(self, key: str) -> str | None:
        return self._where.get(key)

    def home(self, session: SessionHint | None) -> str | None:
        """Where ``session``'s KV is: its last request's instance, else (a sub-agent's first request) its
        parent's."""
        if session is None:
            return None
        where = self._where.get(session.key)
        if where is None and session.parent:
            where = self._where.get(session.parent)
        return where

    def paused_at(self, key: str) -> float | None:
        """When session ``key`` paused, as this router heard it (wall clock; None: it is not paused)."""
        return self._paused.get(key)

    def place(self, session: SessionHint | None, candidates: list[Instance]) -> tuple[Instance | None, str]:
        """The candidate the session should stay on, and why (None: choose as for any request, and why not):
        ``kvmesh.routing.plan.place_session`` over registry records (the planner calls that itself)."""
        if session is None or not self.affinity:
            return None, ""
        views = [view(i, CostModel()) for i in candidates]
        home, why, moved = place_session(self.home(session), views, self.overload)
        self.moved += moved
        return next((i for i in candidates if home is not None and i.id == home.id), None), why

    def arrived(self, session: SessionHint | None) -> str | None:
        """A request of ``session`` reached this router. When the session is paused and has a home, that instance
        is told at once (``RESUME``, in the background) to warm the session's KV back while the request is
        tokenized, routed and queued. Returns the instance told (None: none)."""
        if session is None or session.key not in self._paused:
            return None
        del self._paused[session.key]
        home = self.home(session) if self.affinity else None
        if home is not None:
            self.resumed += 1
            self._background(self._signal(session.key, SessionEvent.RESUME, home))
        return home

    def ran(self, session: SessionHint | None, instance: str) -> None:
        """``session``'s request ran on ``instance`` (it is forgotten when that was its last); the other routers
        are told."""
        if session is None:
            return
        if session.parent and session.key not in self._where and self._where.get(session.parent) == instance:
            self.forked += 1
        self._record(session.key, None if session.end else instance)
        if self.share is not None:
            msg = SessionSignal(session.key, SessionEvent.END if session.end else SessionEvent.ROUTED, time.time(),
                                instance)
            self._background(self._send(self.share, msg))

    def finished(self, session: SessionHint | None, text: str, finish_reason: str) -> SessionEvent | None:
        """A request of ``session`` finished with ``text``: tell every cache, in the background (the answer does
        not wait for it), what that says of the session: it ended, it pauses (a tool call, or a pause the request
        announced; ``DEMOTE`` when it asked for that), or what it holds may go (``session_retention: release``).
        Returns what is said (None: nothing)."""
        if session is None:
            return None
        pauses = (session.pause_s > 0 or session.retention == Retention.DEMOTE or session.calls_tool
                  or ends_in_tool_call(text, finish_reason, self.call_format))
        if session.end:
            event: SessionEvent | None = SessionEvent.END
        elif session.retention == Retention.RELEASE:
            event = SessionEvent.RELEASE
        elif pauses:
            event = SessionEvent.DEMOTE if session.retention == Retention.DEMOTE else SessionEvent.PAUSE
        else:
            event = None
        if event in (SessionEvent.PAUSE, SessionEvent.DEMOTE):
            self._paused[session.key] = time.time()
        if event is not None:
            self._background(self._signal(session.key, event, self._where.get(session.key, ""), session.pause_s))
        return event

    async def close(self, key: str) -> None:
        """The client closed session ``key``: every cache lets its blocks go first."""
        self._record(key, None)
        await self._signal(key, SessionEvent.END)

    async def heard(self, msg: Message, headers: dict[str, str]) -> None:
        """Another router's word (``sessions``, ``router.sessions``; this router's own come back too and change
        nothing): where a session's request went, that it paused, is back or ended."""
        if not isinstance(msg, SessionSignal):
            return
        if msg.event is SessionEvent.ROUTED and msg.instance:
            self._record(msg.session, msg.instance)
        elif msg.event is SessionEvent.END:
            self._record(msg.session, None)
        elif msg.event in (SessionEvent.PAUSE, SessionEvent.DEMOTE):
            self._paused[msg.session] = msg.ts
        elif msg.event is SessionEvent.RESUME:
            self._paused.pop(msg.session, None)

    def _record(self, key: str, instance: str | None) -> None:
        """``key``'s last request ran on ``instance`` (None: the session is over, forget it)."""
        if instance is None:
            self._where.pop(key, None)
            self._paused.pop(key, None)
            return
        self._where[key] = instance
        self._where.move_to_end(key)
        while len(self._where) > self.max_sessions:
            old, _ = self._where.popitem(last=False)
            self._paused.pop(old, None)

    def _background(self, coro: Coroutine[Any, Any, None]) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self._sending.add(task)
        task.add_done_callback(self._sending.discard)

    async def _signal(self, key: str, event: SessionEvent, instance: str | None = None,
                      expected_s: float = 0.0) -> None:
        where = self._where.get(key, "") if instance is None else instance
        await self._send(self.publish, SessionSignal(key, event, time.time(), where, expected_s))

    @staticmethod
    async def _send(publish: Publish, msg: SessionSignal) -> None:
        try:
            await publish(msg)
        except Exception as e:  # noqa: BLE001 - advisory: the caches rank as if they had not heard
            log.warning("could not signal that session %s: %s: %s", msg.session, msg.event.value, e)
