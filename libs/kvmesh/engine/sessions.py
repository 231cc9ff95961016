"""Sessions as a cache sees them: which blocks each live session holds, which sessions are paused, and what that
makes of each block (its :class:`Mark`), for the session-aware eviction strategies (``eviction.SessionAware``).

A session is a conversation or an agent's task, named by the client (the router namespaces the id by tenant, so
``key`` is ``tenant/id``). Its context is the blocks of its latest request: a new request of the session
replaces it (blocks it moved past, such as the old partial tail, are let go), its last request ("this session is
over") or an explicit close lets go of all of it. A response that ends in a tool call pauses it: the session is
back once the tool ran, expected after its own usual pause (its cadence), and it stays paused until it is.

A block is ``RELEASED`` when the one session that used it holds it no more: nobody is expected back for it. A
block several sessions used (a system prompt, a tool preamble) stays held while any live session holds it, and
once none does it is ``UNKNOWN`` (the next session may well want it), like the blocks of requests without a
session id: they rank as they would without sessions. What a cache records per block for this is its
``session_owner`` (:func:`owner_after`): "" for none, the session's key, or ``SHARED``.

A session paused with its KV demoted (the client's ``session_retention: demote``) holds its blocks without
raising their mark: held by it alone they are ``UNKNOWN``, free to move down the tiers, until the engine warms
them back for its return (``retain``: from then on they are ``PAUSED``).

A paused session's blocks are ``PAUSED`` until it is overdue: twice its expected pause after the tool call (its
own median pause, else the median of every session's recent pauses, else ``default_pause_s``). A session that
is overdue (a tool that runs far longer than usual, a build, a crawl; or a user who walked away) says nothing
more: the blocks only overdue sessions hold are ``UNKNOWN``, ranked as if no session held them, so neither a
slow session nor an abandoned one keeps its blocks over those of requests without a session.

A cache too small for every paused session keeps those expected back soonest (:meth:`SessionTable.expected_back`),
as the offline optimum would with the real returns (``eviction.SessionAware``).

Torch-free and keyed on block keys (ints), so the native engine's tiers, cachesvc's tiers and ``kvmesh sim``
share it; not thread-safe (one owner each, like the eviction queue). Every method that changes marks returns the
blocks whose mark changed, for the cache to rank again.
"""

from __future__ import annotations

import enum
import math
import statistics
from collections import Counter, deque
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from kvmesh.contracts.sessions import SessionEvent

PAUSE_HISTORY = 8     # pause gaps a session remembers (its cadence)
GLOBAL_HISTORY = 256  # recent pause gaps of every session (the cadence of a session that has not paused yet)
OVERDUE = 2.0         # a paused session is overdue past this many times its expected pause
SHARED = "*"          # ``session_owner`` of a block more than one session (or one and sessionless requests) used


def owner_after(owner: str, session: str) -> str:
    """A block's ``session_owner`` once a request of ``session`` ("" = none) used it."""
    if owner == session or (not owner and not session):
        return owner
    return session if not owner and session and owner != SHARED else SHARED


class Mark(enum.IntEnum):
    """What the sessions say about a block; a lower mark is evicted first."""

    RELEASED = 0  # sessions used it; none holds it now (ended, or moved past it)
    UNKNOWN = 1   # no session speaks for it (none held it; only overdue or demoted ones hold it): as without
    LIVE = 2      # a live session holds it
    PAUSED = 3    # a paused session holds it: it will be back after its tool runs


@dataclass
class Session:
    key: str
    last_seen: float
    blocks: tuple[int, ...] = ()
    paused_at: float | None = None
    pause_gaps: list[float] = field(default_factory=list)  # its own pauses: tool call -> next request
    announced_s: float = 0.0  # the current pause's length as the client announced it (0: none; its cadence)
    due: float = math.inf     # when it is expected back (paused; a request of it waiting to run: then)
    demoted: bool = False     # the current pause let its blocks move down the tiers (they rank as LIVE)

    @property
    def paused(self) -> bool:
        return self.paused_at is not None


class SessionTable:
    """The live sessions of one cache and the blocks they hold. ``default_pause_s``: the expected pause of a
    session that has not paused before; ``idle_s``: a session silent this long is dropped as if it had ended
    (clients that never say so), checked by :meth:`expire`."""

    def __init__(self, default_pause_s: float = 30.0, idle_s: float = math.inf) -> None:
        self.default_pause_s = default_pause_s
        self.idle_s = idle_s
        self._sessions: dict[str, Session] = {}
        self._held: Counter[int] = Counter()    # block -> live sessions holding it (paused ones included)
        self._paused: Counter[int] = Counter()  # block -> paused sessions holding it
        self._demoted: Counter[int] = Counter()  # block -> demoted (paused, KV let down the tiers) sessions holding it
        self._paused_until: dict[int, float] = {}  # block -> when its paused holders are overdue (the latest)
        self._recent: deque[float] = deque(maxlen=GLOBAL_HISTORY)  # every session's recent pauses

    def __len__(self) -> int:
        return len(self._sessions)

    def __contains__(self, key: str) -> bool:
        return key in self._sessions

    def get(self, key: str) -> Session | None:
        return self._sessions.get(key)

    def mark(self, block: int | None, owner: str, now: float) -> Mark:
        """The mark of ``block`` at ``now``; ``owner``: its ``session_owner``."""
        held = self._held.get(block, 0) if block is not None else 0
        demoted = self._demoted.get(block, 0)  # type: ignore[arg-type]
        if held > demoted:
            if now < self._paused_until.get(block, -math.inf):  # type: ignore[arg-type]
                return Mark.PAUSED
            if held > demoted + self._paused.get(block, 0):  # type: ignore[arg-type]
                return Mark.LIVE  # a session that is not paused holds it
            return Mark.UNKNOWN  # only overdue paused sessions hold it: slow or gone, they say nothing more
        if held:  # only demoted sessions hold it: ranked as if none did, until they are about to return
            return Mark.UNKNOWN
        return Mark.RELEASED if owner and owner != SHARED else Mark.UNKNOWN

    def mark_drops_at(self, block: int | None, now: float) -> float:
        """When ``block``'s mark falls by itself (its paused holders become overdue); ``inf``: never."""
        until = self._paused_until.get(block, -math.inf) if block is not None else -math.inf
        return until if now < until and self._held.get(block) else math.inf  # type: ignore[arg-type]

    def expected_back(self, key: str) -> float:
        """When paused session ``key`` is expected back: its expected return, or when its next request arrived
        (:meth:`back`); ``inf`` when it is not paused, or has no expected pause yet."""
        s = self._sessions.get(key)
        return s.due if s is not None and s.paused_at is not None else math.inf

    def holders(self, block: int) -> int:
        return self._held.get(block, 0)

    def holding(self, blocks: Sequence[int]) -> list[tuple[str, ...]]:
        """The sessions that hold each of ``blocks``, in order (none: ``()``): what a copy of them tells another
        cache (a pool shard's repair). One pass over the sessions' blocks when any of ``blocks`` is held."""
        wanted = {b for b in blocks if b in self._held}
        found: dict[int, list[str]] = {}
        if wanted:
            for s in self._sessions.values():
                for b in wanted.intersection(s.blocks):
                    found.setdefault(b, []).append(s.key)
        return [tuple(found.get(b, ())) for b in blocks]

    def hold_too(self, key: str, blocks: Sequence[int], now: float) -> set[int]:
        """Session ``key`` holds ``blocks`` as well as what it held: a copy of them from another cache says so (a
        pool shard's repair). A session not known here is recorded as seen ``now``; a paused one stays paused and
        its new blocks with it. The blocks whose holders changed."""
        s = self._sessions.get(key)
        if s is None:
            s = self._sessions[key] = Session(key, now)
        have = set(s.blocks)
        return self._hold(s, s.blocks + tuple(dict.fromkeys(b for b in blocks if b not in have)))

    # ---- signals -------------------------------------------------------------------------------------------
    def request(self, key: str, blocks: Sequence[int], now: float, end: bool = False,
                resume: bool = True) -> set[int]:
        """A request of session ``key`` used ``blocks`` (its context, in order): they are what it holds now.
        ``end``: it was the session's last, so it holds nothing any more. A paused session is back, unless
        ``resume`` is False: a cache that hears of requests only after they finished (the pool, from their
        write-backs) cannot tell the turn that paused from the next one, and leaves the pause to run out."""
        s = self._sessions.get(key)
        if s is None:
            if end:
                return set()
            s = self._sessions[key] = Session(key, now)
        changed = self._resume(s, now) if resume else set()
        new = () if end else tuple(blocks)
        changed |= self._hold(s, new)
        s.last_seen = now
        if end:
            del self._sessions[key]
        return changed

    def signal(self, key: str, event: SessionEvent, now: float, expected_s: float = 0.0,
               create: bool = False) -> set[int]:
        """Apply a session signal (``contracts.sessions.SessionEvent``): pause, demote, release or end; the
        others (``RESUME``, ``ROUTED``) say nothing of what the session holds. ``expected_s``: the pause's
        length as the client announced it (0: none); ``create``: as for :meth:`pause`."""
        if event is SessionEvent.PAUSE or event is SessionEvent.DEMOTE:
            return self.pause(key, now, create, expected_s, demote=event is SessionEvent.DEMOTE)
        if event is SessionEvent.RELEASE:
            return self.release(key)
        if event is SessionEvent.END:
            return self.end(key)
        return set()

    def pause(self, key: str, now: float, create: bool = False, expected_s: float = 0.0,
              demote: bool = False) -> set[int]:
        """Session ``key``'s last response ended in a tool call (or it said it pauses): it is back once the tool
        ran, after ``expected_s`` when the client announced that, else its cadence. A session not known here is
        ignored, or with ``create`` recorded as paused (a write-back of its blocks may come after the signal);
        one paused already is paused afresh from ``now``. ``demote``: its blocks rank as if no session held
        them (they may move down the tiers; the engine warms them back before it returns, ``retain``)."""
        s = self._sessions.get(key)
        if s is None:
            if not create:
                return set()
            s = self._sessions[key] = Session(key, now)
        if s.paused_at is not None:
            self._unmark_pause(s, s.blocks)
        s.paused_at, s.announced_s, s.demoted = now, expected_s, demote
        s.due = now + self.expected_pause(s)
        self._mark_pause(s, s.blocks)
        return set(s.blocks)

    def retain(self, key: str) -> set[int]:
        """Demoted session ``key`` is about to return (its KV is being warmed back): from now on its pause keeps
        its blocks as a retained one does. The blocks whose mark changed (none when it is not demoted)."""
        s = self._sessions.get(key)
        if s is None or not s.demoted:
            return set()
        self._unmark_pause(s, s.blocks)
        s.demoted = False
        self._mark_pause(s, s.blocks)
        return set(s.blocks)

    def back(self, key: str, now: float) -> set[int]:
        """A request of paused session ``key`` arrived and waits to run: what the session holds is kept as a
        paused session's (a demoted one's too) for another ``OVERDUE`` times its expected pause from ``now``, so
        the queue it waits in does not evict the KV it is about to reuse. It is back (the pause ends, its cadence
        learns the gap) when that request finishes. The blocks whose mark changed."""
        s = self._sessions.get(key)
        if s is None or s.paused_at is None:
            return set()
        changed = self.retain(key)
        self._hold_paused(s.blocks, now + OVERDUE * self.expected_pause(s))
        s.due = now  # needed as soon as it runs
        return changed | set(s.blocks)

    def release(self, key: str) -> set[int]:
        """Session ``key`` goes on, but nothing it holds now is worth keeping: it holds nothing until its next
        request."""
        s = self._sessions.get(key)
        if s is None:
            return set()
        return self._resume(s, s.last_seen, count=False) | self._hold(s, ())

    def end(self, key: str) -> set[int]:
        """Session ``key`` is over (an explicit close): it holds nothing any more."""
        s = self._sessions.pop(key, None)
        if s is None:
            return set()
        return self._resume(s, s.last_seen) | self._hold(s, ())

    def expire(self, now: float) -> set[int]:
        """Drop the sessions silent for longer than ``idle_s`` (paused ones: past twice their expected
        return too), as if they had ended."""
        changed: set[int] = set()
        for s in list(self._sessions.values()):
            due = s.last_seen + self.idle_s
            if s.paused_at is not None:
                due = max(due, s.paused_at + 2 * self.expected_pause(s))
            if now > due:
                changed |= self.end(s.key)
        return changed

    # ---- cadence -------------------------------------------------------------------------------------------
    def expected_pause(self, s: Session) -> float:
        """How long the session's current pause lasts: what the client announced, else the median of its own
        pauses, else of every session's recent ones, else ``default_pause_s``."""
        if s.paused_at is not None and s.announced_s > 0:
            return s.announced_s
        gaps = s.pause_gaps or self._recent
        return statistics.median(gaps) if gaps else self.default_pause_s

    def expected_return(self, key: str) -> float | None:
        """When paused session ``key`` is expected back (None: it is not paused)."""
        s = self._sessions.get(key)
        if s is None or s.paused_at is None:
            return None
        return s.paused_at + self.expected_pause(s)

    def paused(self) -> Iterable[Session]:
        return (s for s in self._sessions.values() if s.paused)

    # ---- internals -----------------------------------------------------------------------------------------
    def _resume(self, s: Session, now: float, count: bool = True) -> set[int]:
        """``s`` is no longer paused; ``count``: the pause ended with its next request (a cadence sample)."""
        if s.paused_at is None:
            return set()
        if count:
            gap = max(0.0, now - s.paused_at)
            s.pause_gaps = [*s.pause_gaps[-(PAUSE_HISTORY - 1):], gap]
            self._recent.append(gap)
        self._unmark_pause(s, s.blocks)
        s.paused_at, s.announced_s, s.demoted, s.due = None, 0.0, False, math.inf
        return set(s.blocks)

    def _mark_pause(self, s: Session, blocks: Iterable[int]) -> None:
        """Paused ``s`` holds ``blocks``: demoted, they rank as held by no one; retained, as paused."""
        if s.demoted:
            self._demoted.update(blocks)
        else:
            blocks = list(blocks)
            self._paused.update(blocks)
            self._hold_paused(blocks, s.paused_at + OVERDUE * self.expected_pause(s))  # type: ignore[operator]

    def _unmark_pause(self, s: Session, blocks: Iterable[int]) -> None:
        if s.demoted:
            self._demoted.subtract(blocks)
            for b in set(blocks):
                if self._demoted[b] <= 0:
                    del self._demoted[b]
        else:
            self._unpause(blocks)

    def _hold_paused(self, blocks: Iterable[int], until: float) -> None:
        for b in blocks:
            self._paused_until[b] = max(self._paused_until.get(b, -math.inf), until)

    def _unpause(self, blocks: Iterable[int]) -> None:
        self._paused.subtract(blocks)
        for b in blocks:
            if self._paused[b] <= 0:
                del self._paused[b]
                self._paused_until.pop(b, None)

    def _hold(self, s: Session, blocks: tuple[int, ...]) -> set[int]:
        """``s`` holds ``blocks`` instead of what it held; the blocks whose holders changed."""
        old, new = set(s.blocks), set(blocks)
        for b in old - new:
            self._held[b] -= 1
            if self._held[b] <= 0:
                del self._held[b]
        for b in new - old:
            self._held[b] += 1
        if s.paused_at is not None:
            self._unmark_pause(s, old - new)
            self._mark_pause(s, new - old)
        s.blocks = blocks
        return old ^ new
