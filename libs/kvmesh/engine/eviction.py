"""Eviction strategies: each is one method returning a sort key; the smallest key is evicted first.

Adding a policy is adding a small class (SGLang's ``get_priority`` idea) and its name to
``kvmesh.contracts.names.Eviction``, which the registry here is keyed on and the settings list. The objects
being ranked only need the attributes of :class:`Evictable`; a cache that cannot see one (cachesvc does not
know a block's depth) leaves its default. Learned strategies also hear of every hit and eviction (``on_hit`` /
``on_evict``, no-ops elsewhere); that feedback is all they train on, so they need no knowledge of the future.
``belady`` is the exception: it reads ``next_use``, which only the simulator knows, and live caches refuse it
(:func:`make_policy`).

Prefix semantics: a block is only useful while its whole chain in front of it is cached, so every strategy ranks
a chain's tail before its head on ties, and the caches only evict leaves (the engine's radix tree) or take the
tail first (``kvmesh sim``, cachesvc).
"""

from __future__ import annotations

import math
import time
from abc import ABC, abstractmethod
from collections import OrderedDict
from collections.abc import Hashable
from dataclasses import dataclass
from typing import Protocol

from kvmesh.contracts.names import Eviction
from kvmesh.engine.eviction_queue import EvictionQueue
from kvmesh.engine.sessions import SHARED, Mark, SessionTable


class Evictable(Protocol):
    last_access: float
    hit_count: int
    priority: int          # retention priority: higher outlives lower (0 = default)
    priority_until: float  # monotonic deadline after which ``priority`` no longer applies (inf = forever)
    # Optional (read with defaults): depth (blocks before it in its chain), fanout (cached children),
    # prev_access (the access before ``last_access``; -inf when none), extended (it has had a child: not a
    # request's tail), key (the block's hash: what ``ghost`` remembers of evicted blocks, what sessions hold),
    # session_owner (the session that used it: "" none, ``sessions.SHARED`` several), replicated (another copy of it is
    # in the cluster: another instance or the pool holds it), next_use (the simulator only).


class EvictionPolicy(Protocol):
    name: Eviction

    def sort_key(self, item: Evictable, now: float) -> tuple: ...
    def on_hit(self, item: Evictable, now: float) -> None: ...
    def on_evict(self, item: Evictable, now: float) -> None: ...
    def key_drops_at(self, item: Evictable, now: float) -> float: ...


class Policy(ABC):
    """Base of the strategies here: no feedback, online."""

    name: Eviction     # ``name.needs_future``: it reads ``next_use``, which only the simulator knows
    dynamic = False    # keys drift as the strategy learns: a queue re-ranks an item before evicting it
    falling = False    # an item's key can fall by itself (``key_drops_at``): a queue ranks it again then

    @abstractmethod
    def sort_key(self, item: Evictable, now: float) -> tuple:
        """The order of eviction: the smallest key leaves first."""

    def on_hit(self, item: Evictable, now: float) -> None:
        """``item`` is about to be hit (called before its ``last_access`` / ``hit_count`` change)."""

    def on_evict(self, item: Evictable, now: float) -> None:
        """``item`` is leaving the cache."""

    def key_drops_at(self, item: Evictable, now: float) -> float:
        """With ``falling``: when ``item``'s key, as ranked at ``now``, falls by itself (an expiring priority);
        a queue ranks it again then, since a key that falls would otherwise stay buried where it was pushed.
        ``inf``: never."""
        return math.inf


def _depth(item: Evictable) -> int:
    return getattr(item, "depth", 0)


class LRU(Policy):
    name = Eviction.LRU

    def sort_key(self, item: Evictable, now: float) -> tuple:
        return (item.last_access,)


class LFU(Policy):
    name = Eviction.LFU

    def sort_key(self, item: Evictable, now: float) -> tuple:
        return (item.hit_count, item.last_access)


class SLRU(Policy):
    """Segmented LRU: blocks hit at least twice sit in the protected segment and go after all probation ones."""

    name = Eviction.SLRU

    def sort_key(self, item: Evictable, now: float) -> tuple:
        return (item.hit_count >= 2, item.last_access)


class PriorityLRU(Policy):
    """TensorRT-LLM-style retention priority: a higher priority outlives lower ones until its duration ends."""

    name = Eviction.PRIORITY
    falling = True  # a retention's end lowers the key

    def sort_key(self, item: Evictable, now: float) -> tuple:
        priority = item.priority if now < item.priority_until else 0
        return (priority, item.last_access)

    def key_drops_at(self, item: Evictable, now: float) -> float:
        return item.priority_until if item.priority > 0 and now < item.priority_until else math.inf


class Belady(Policy):
    """The offline optimum (Belady's MIN): evict the block used again farthest in the future, a chain's tail
    before its head on ties. Needs ``next_use`` (``inf`` = never), which only ``kvmesh sim`` can fill in."""

    name = Eviction.BELADY  # needs_future

    def sort_key(self, item: Evictable, now: float) -> tuple:
        return (-item.next_use, -_depth(item))  # type: ignore[attr-defined]


class TailFirst(Policy):
    """Predicted expiry, learned online: a block is kept for ``f`` × the cache's eviction age (how long blocks
    have recently lived between their last access and eviction, an online average in the cache's own time
    unit), counted from its last access; the block whose time is up first goes. ``f`` is 0 for a chain's tail
    that was never extended or hit (a request's last block, almost never reused under prefix semantics), 1 for
    any other block, and ``1 + sqrt(hits)`` once it has been hit: reuse earns a longer stay but, unlike SLRU's
    protected segment, never a permanent one. Keys are fixed when a block is touched, so a heap ranks them."""

    name = Eviction.TAILFIRST

    def __init__(self, smoothing: float = 0.01) -> None:
        self.smoothing = smoothing
        self.eviction_age = 0.0

    def sort_key(self, item: Evictable, now: float) -> tuple:
        if item.hit_count:
            stay = 1.0 + math.sqrt(item.hit_count)
        else:
            stay = 1.0 if getattr(item, "extended", True) else 0.0
        return (item.last_access + stay * self.eviction_age, -_depth(item))

    def on_evict(self, item: Evictable, now: float) -> None:
        self.eviction_age += self.smoothing * (now - item.last_access - self.eviction_age)


class Ghost(TailFirst):
    """TailFirst's predicted expiry, with reuse remembered past eviction and rewarded linearly.

    On the chat trace most blocks are never used again, and the reuses that do come are far apart (median 434
    requests, almost none within 50): beyond the cache's window, so most reuses are misses and a block's own
    ``hit_count`` rarely sees them. A ghost list (the keys of recently evicted blocks, with how often each had
    been used, ``ghost_blocks`` of them at most, FIFO) tells a returning block from a new one. A block's reuse
    count ``r`` is its hits plus what the ghost remembers of it; it is kept for ``f`` × the cache's eviction
    age after its last access, with ``f`` = 0 for a chain's tail never extended or reused, ``new_stay`` (0.1)
    for any other block never reused (admitted on probation, like S3-FIFO's small queue), and ``1 + r`` once
    reused. Blocks without a ``key`` (cachesvc) are ranked on their hits alone. O(1) per access besides the
    heap; the ghost costs one dict entry per remembered key."""

    name = Eviction.GHOST

    def __init__(self, smoothing: float = 0.01, ghost_blocks: int = 1 << 18, new_stay: float = 0.1) -> None:
        super().__init__(smoothing)
        self.ghost_blocks = ghost_blocks
        self.new_stay = new_stay
        self.ghost: OrderedDict[object, int] = OrderedDict()  # evicted key -> uses before it was evicted

    def _reuses(self, item: Evictable) -> int:
        key = getattr(item, "key", None)
        return item.hit_count + (self.ghost.get(key, 0) if key is not None else 0)

    def sort_key(self, item: Evictable, now: float) -> tuple:
        r = self._reuses(item)
        if r:
            stay = 1.0 + r
        else:
            stay = self.new_stay if getattr(item, "extended", True) else 0.0
        return (item.last_access + stay * self.eviction_age, -_depth(item))

    def on_evict(self, item: Evictable, now: float) -> None:
        super().on_evict(item, now)
        key = getattr(item, "key", None)
        if key is None:
            return
        ghost = self.ghost
        ghost[key] = ghost.pop(key, 0) + item.hit_count + 1
        if len(ghost) > self.ghost_blocks:
            ghost.popitem(last=False)


@dataclass(slots=True, eq=False)
class _Shadow:
    """A sampled block as a shadow cache holds it (its own hits: the shadow's, not the real cache's)."""

    last_access: float
    depth: int
    extended: bool
    key: Hashable
    hit_count: int = 0
    priority: int = 0
    priority_until: float = 0.0


class _ShadowCache:
    """A miniature cache run by one strategy on the sampled blocks only (Waldspurger et al., "Cache Modeling
    and Optimization using Miniature Simulations", ATC'17): its hit count estimates the strategy's on the
    whole cache. ``score`` is that count, decayed per sampled access."""

    def __init__(self, policy: Policy) -> None:
        self.policy = policy
        self.items: dict[Hashable, _Shadow] = {}
        self.queue: EvictionQueue[Hashable] = EvictionQueue(policy, self.items.__getitem__)
        self.score = 0.0

    def access(self, key: Hashable, item: Evictable, capacity: int, decay: float) -> None:
        t = item.last_access
        self.score *= decay
        e = self.items.get(key)
        if e is None:
            e = self.items[key] = _Shadow(t, _depth(item), getattr(item, "extended", True), key)
        else:
            self.policy.on_hit(e, t)
            e.hit_count += 1
            e.last_access, e.extended = t, getattr(item, "extended", True)
            self.score += 1.0
        self.queue.push(key, t)
        while len(self.items) > capacity:
            victim = self.queue.pop(t)
            if victim is None:
                break
            self.policy.on_evict(self.items.pop(victim), t)


class Duel(Policy):
    """Whichever of two strategies is doing better here and now: ``candidate`` (``ghost``) or ``baseline``
    (``lru``), judged on miniature simulations. Blocks whose key hashes into a ``1/2**sample_shift`` sample are
    replayed, as they are used, into two shadow caches of the same fraction of the real cache's size, one per
    strategy; the real cache ranks by the baseline until the candidate's shadow has caught ``margin`` more hits
    (decayed by ``decay`` per sampled access, so it follows a workload that changes), and back again when the
    baseline leads by as much. A change of mind bumps ``epoch``: the eviction queue ranks everything afresh.
    Between changes keys stay as the ranking strategy set them when a block was pushed (re-ranking ghost's at
    ``pop`` with its later eviction age, ``dynamic``, measured 16.7% instead of 17.1% at 6,000 blocks).

    Both real strategies hear every hit and eviction, so the one not ranking keeps learning (ghost's eviction
    age and ghost list). On the chat trace the candidate wins within a few thousand requests; on the agentic
    trace, where ghost's probation evicts blocks the next agent step wants, the baseline keeps its place. So
    the duel tracks the better of the two: not below LRU by more than the cost of finding out. A block without
    a ``key`` (cachesvc) is not sampled: there it ranks by the baseline. O(1) per access besides the heaps; a
    sampled access also updates both shadows (O(log n))."""

    name = Eviction.DUEL

    def __init__(self, candidate: Eviction = Eviction.GHOST, baseline: Eviction = Eviction.LRU,
                 sample_shift: int = 2, decay: float = 0.9995, margin: float = 0.1) -> None:
        self.experts = (make_policy(candidate), make_policy(baseline))
        self.shadows = (_ShadowCache(make_policy(candidate)), _ShadowCache(make_policy(baseline)))
        self.mask = (1 << sample_shift) - 1
        self.decay, self.margin = decay, margin
        self.sampled: dict[Hashable, float] = {}  # sampled key in the real cache -> its last access seen
        self.winner = 1   # index into ``experts``: the baseline until the candidate proves better
        self.epoch = 0
        self._full = 0    # sampled blocks in the real cache when it last evicted: its size × the sample rate

    def _observe(self, item: Evictable) -> None:
        key = getattr(item, "key", None)
        if key is None or (hash(key) * 2654435761) >> 7 & self.mask:
            return
        t = item.last_access
        if self.sampled.get(key) == t:
            return  # re-ranked, not used
        self.sampled[key] = t
        capacity = self._full or len(self.sampled)
        for shadow in self.shadows:
            shadow.access(key, item, capacity, self.decay)
        lead, other = self.shadows[self.winner].score, self.shadows[1 - self.winner].score
        if other > lead * (1.0 + self.margin) + 1.0:
            self.winner, self.epoch = 1 - self.winner, self.epoch + 1

    def sort_key(self, item: Evictable, now: float) -> tuple:
        self._observe(item)
        return self.experts[self.winner].sort_key(item, now)

    def on_hit(self, item: Evictable, now: float) -> None:
        for p in self.experts:
            p.on_hit(item, now)

    def on_evict(self, item: Evictable, now: float) -> None:
        for p in self.experts:
            p.on_evict(item, now)
        key = getattr(item, "key", None)
        if key is not None:
            self.sampled.pop(key, None)
        self._full = len(self.sampled)


class SessionAware(Policy):
    """What the clients said about their sessions first, then ``base`` (LRU): a block under a retention hint
    (a TTL pin) outranks every block with a lower one until it expires; then a block held by a paused session
    (waiting on a tool, and not overdue) outranks one held by a live session, which outranks one no session
    speaks for (shared, of requests without a session, or held only by overdue paused sessions), which outranks
    one whose one session ended or moved past it (``kvmesh.engine.sessions.Mark``); within a mark, a block that
    has another copy in the cluster goes before the last copy of anything. Among paused sessions' blocks, those
    of one session alone go first, the session expected back last first (``SessionTable.expected_back``) and a
    chain's tail before its head (a block is of use only with its whole chain in front of it); a block several
    sessions hold or used (a preamble, a parent's context its sub-agents read) goes after all of those, since
    whichever of them comes first needs it, and so may the next session to start with it. Without any signal
    the order is ``base``'s.

    ``sessions`` is the cache's :class:`~kvmesh.engine.sessions.SessionTable`: the cache tells it of every
    session's requests, pauses and ends, and ranks again the blocks whose mark changed (the table returns them).
    Blocks are ranked by ``key``; a cache whose blocks have none ranks them as ``UNKNOWN``."""

    name = Eviction.SESSION
    base_name = Eviction.LRU
    falling = True  # a retention's end lowers the key

    def __init__(self, base: Eviction | None = None, sessions: SessionTable | None = None) -> None:
        self.base = make_policy(base or self.base_name)
        self.sessions = sessions if sessions is not None else SessionTable()

    @property
    def dynamic(self) -> bool:  # type: ignore[override]
        return self.base.dynamic

    @property
    def epoch(self) -> int:
        """The base strategy's (``duel``'s changes of mind): the queue ranks everything again on a change."""
        return getattr(self.base, "epoch", 0)

    def sort_key(self, item: Evictable, now: float) -> tuple:
        retained = item.priority if now < item.priority_until else 0
        key, owner = getattr(item, "key", None), getattr(item, "session_owner", "")
        mark = self.sessions.mark(key, owner, now)
        later, depth = 0.0, 0
        if mark is Mark.PAUSED and owner and owner != SHARED and (key is None or self.sessions.holders(key) <= 1):
            later, depth = -self.sessions.expected_back(owner), -_depth(item)  # one session's: back last, tail first
        elif mark is Mark.PAUSED:  # read by several sessions (and the next to start may): after all of those
            later = math.inf
        return (retained, int(mark), not getattr(item, "replicated", False), later, depth,
                *self.base.sort_key(item, now))

    def on_hit(self, item: Evictable, now: float) -> None:
        self.base.on_hit(item, now)

    def on_evict(self, item: Evictable, now: float) -> None:
        self.base.on_evict(item, now)

    def key_drops_at(self, item: Evictable, now: float) -> float:
        retention = item.priority_until if item.priority > 0 and now < item.priority_until else math.inf
        return min(retention, self.sessions.mark_drops_at(getattr(item, "key", None), now))


class SessionDuel(SessionAware):
    """:class:`SessionAware` over ``duel`` instead of LRU: the same marks, ``duel``'s order within each."""

    name = Eviction.SESSION_DUEL
    base_name = Eviction.DUEL


POLICIES: dict[Eviction, type[Policy]] = {p.name: p for p in (LRU, LFU, SLRU, PriorityLRU, TailFirst, Ghost,
                                                              Duel, SessionAware, SessionDuel, Belady)}


def make_policy(name: Eviction | str, online: bool = True) -> Policy:
    """A fresh strategy object (learned ones keep state: one object per cache, shared by its tiers).
    ``online``: refuse a strategy that needs the future."""
    online_names = [e.value for e in Eviction.online()]
    try:
        key = Eviction(name)
    except ValueError:
        choices = online_names if online else sorted(e.value for e in Eviction)
        raise ValueError(f"eviction {name!r} is unknown; choose one of {choices}") from None
    if online and key.needs_future:
        raise ValueError(f"eviction {key.value!r} needs the future (when each block is used next) and is for "
                         f"`kvmesh sim` only; choose one of {online_names}")
    return POLICIES[key]()


def online_policies() -> list[Eviction]:
    return list(Eviction.online())


def now() -> float:
    return time.monotonic()
