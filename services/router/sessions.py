"""What the router knows of sessions: where each one's last request ran (affinity), whether a response ended in
a tool call (the session pauses), and the signals every cache hears (``SessionSignal`` on
``kvmesh.<cluster>.sessions``: the engine instances and cachesvc).

Placement. A session's next request goes where its last one ran, since that instance holds its KV, unless the
instance is overloaded: ``session_overload`` more requests queued or running than the least loaded candidate.
Then it goes where the routing policy sends it, and the KV follows through the pool (the last turn's
write-back; the new instance warms from it). The router forgets a session when it ends, and the least recent
ones beyond ``max_sessions``.

Pause. A response that ends in a tool call (its text ends with a ``</tool_call>`` block, opens one a stop string
cut short, or is a JSON object naming a function and its arguments) means the session is back once the tool
ran: the caches keep its blocks, and the engine warms back what it demoted before the session is expected.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections import OrderedDict
from collections.abc import Awaitable, Callable

from kvmesh.contracts.engine import SessionHint
from kvmesh.contracts.messages import SessionSignal
from kvmesh.contracts.sessions import SessionEvent
from kvmesh.routing import CostModel
from kvmesh.routing.plan import place_session

from services.router.registry import Instance
from services.router.scheduling import view

log = logging.getLogger(__name__)

Publish = Callable[[SessionSignal], Awaitable[None]]


def ends_in_tool_call(text: str, finish_reason: str = "") -> bool:
    """Whether a response's text ends in a tool call (Hermes / Qwen ``<tool_call>`` blocks, or a JSON call)."""
    t = text.strip()
    if t.endswith("</tool_call>"):
        return True
    if finish_reason == "stop" and t.rfind("<tool_call>") > t.rfind("</tool_call>"):
        return True  # a stop string ("</tool_call>") ended it inside the block
    if t.startswith("{") and t.endswith("}"):
        try:
            call = json.loads(t)
        except ValueError:
            return False
        return isinstance(call, dict) and isinstance(call.get("name"), str) and (
            "arguments" in call or "parameters" in call)
    return False


class Sessions:
    def __init__(self, publish: Publish, affinity: bool = True, overload: int = 2,
                 max_sessions: int = 100_000) -> None:
        self.publish = publish
        self.affinity = affinity
        self.overload = overload
        self.max_sessions = max_sessions
        self._where: OrderedDict[str, str] = OrderedDict()  # session key -> the instance of its last request
        self._sending: set[asyncio.Task] = set()  # signals being published
        self.moved = 0  # requests that left their session's instance because it was overloaded

    def __len__(self) -> int:
        return len(self._where)

    def instance_of(self, key: str) -> str | None:
        return self._where.get(key)

    def place(self, session: SessionHint | None, candidates: list[Instance]) -> tuple[Instance | None, str]:
        """The candidate the session should stay on, and why (None: choose as for any request, and why not):
        ``kvmesh.routing.plan.place_session`` over registry records (the planner calls that itself)."""
        if session is None or not self.affinity:
            return None, ""
        views = [view(i, CostModel()) for i in candidates]
        home, why, moved = place_session(self._where.get(session.key), views, self.overload)
        self.moved += moved
        return next((i for i in candidates if home is not None and i.id == home.id), None), why

    def ran(self, session: SessionHint | None, instance: str) -> None:
        """``session``'s request ran on ``instance`` (it is forgotten when that was its last)."""
        if session is None:
            return
        if session.end:
            self._where.pop(session.key, None)
            return
        self._where[session.key] = instance
        self._where.move_to_end(session.key)
        while len(self._where) > self.max_sessions:
            self._where.popitem(last=False)

    def finished(self, session: SessionHint | None, text: str, finish_reason: str) -> SessionEvent | None:
        """A request of ``session`` finished with ``text``: tell every cache, in the background (the answer does
        not wait for it), when that ended the session or paused it (a tool call). Returns what is said."""
        if session is None:
            return None
        event = SessionEvent.END if session.end else (
            SessionEvent.PAUSE if ends_in_tool_call(text, finish_reason) else None)
        if event is not None:
            task = asyncio.get_running_loop().create_task(self._signal(session.key, event))
            self._sending.add(task)
            task.add_done_callback(self._sending.discard)
        return event

    async def close(self, key: str) -> None:
        """The client closed session ``key``: every cache lets its blocks go first."""
        self._where.pop(key, None)
        await self._signal(key, SessionEvent.END)

    async def _signal(self, key: str, event: SessionEvent) -> None:
        msg = SessionSignal(key, event, time.time(), self._where.get(key, ""))
        try:
            await self.publish(msg)
        except Exception as e:  # noqa: BLE001 - advisory: the caches rank as if they had not heard
            log.warning("could not signal that session %s %s: %s", key, "ended" if event is SessionEvent.END
                        else "paused", e)
