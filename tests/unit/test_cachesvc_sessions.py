"""cachesvc and sessions: the pool's tiers rank by the sessions' signals (a put names its session, signals end
or pause it), and cachesvc tells instances which of their blocks have another copy in the cluster."""

from __future__ import annotations

from kvmesh.contracts.events import BlockRemoved, BlockStored
from kvmesh.contracts.messages import KVEventBatch
from kvmesh.contracts.sessions import SessionEvent
from kvmesh.engine.eviction import make_policy

from services.cachesvc.copies import CopyTracker
from services.cachesvc.dram import DramTier
from services.cachesvc.index import BlockIndex
from services.cachesvc.pool import Pool
from services.cachesvc.store import Leases
from tests.unit.test_cachesvc_pool import LAYOUT, NB, Clock, blocks, held


def session_pool(dram_blocks: int, policy: str = "session") -> Pool:
    clock = Clock()
    leases = Leases(clock)
    strategy = make_policy(policy)
    return Pool([DramTier(dram_blocks * NB, strategy, leases.pinned, clock)], leases,
                getattr(strategy, "sessions", None))


def put(pool: Pool, *keys: int, session: str = "", end: bool = False) -> None:
    pool.put(LAYOUT, *blocks(*keys), session=session, session_end=end)


def test_an_ended_sessions_blocks_leave_the_pool_before_a_live_ones():
    pool = session_pool(4)
    put(pool, 1, 2, session="t/live")
    put(pool, 3, 4, session="t/done", end=True)
    put(pool, 5, 6)
    assert held(pool, 1, 2, 3, 4, 5, 6) == [1, 2, 5, 6]


def test_a_session_signal_reaches_the_pool_and_tenants_do_not_mix():
    pool = session_pool(4)
    put(pool, 1, 2, session="a/chat")
    put(pool, 3, 4, session="b/chat")
    pool.session_signal("b/chat", SessionEvent.END)  # tenant b's "chat", not tenant a's
    put(pool, 5, 6)
    assert held(pool, 1, 2, 3, 4) == [1, 2]


def test_a_paused_session_keeps_its_pool_blocks_while_others_churn():
    pool = session_pool(4)
    put(pool, 1, 2, session="t/agent")
    pool.session_signal("t/agent", SessionEvent.PAUSE)
    for k in range(10, 20, 2):
        put(pool, k, k + 1, session="t/other")
    assert held(pool, 1, 2) == [1, 2]


def test_a_write_back_without_new_blocks_still_says_what_the_session_holds():
    pool = session_pool(4)
    put(pool, 1, 2, session="t/a", end=True)  # released
    pool.put(LAYOUT, [], [], b"", session="t/b", session_blocks=[1, 2])  # another session holds them now
    put(pool, 3, 4, session="t/c", end=True)
    put(pool, 5, 6)
    assert held(pool, 1, 2, 3, 4) == [1, 2]


def test_the_pools_blocks_an_instance_holds_too_go_first():
    pool = session_pool(4)
    put(pool, 1, 2)
    put(pool, 3, 4)
    pool.mark_replicated([3, 4], [])
    put(pool, 5, 6)
    assert held(pool, 1, 2, 3, 4) == [1, 2]


def batch(instance: str, seq: int, *events) -> KVEventBatch:
    return KVEventBatch(instance, seq, 0.0, tuple(events))


def test_instances_hear_when_their_blocks_gain_or_lose_other_copies():
    index, pooled = BlockIndex(), {7}
    tracker = CopyTracker(index, pooled.__contains__)
    a1 = batch("a", 1, BlockStored((1, 2, 7), None, 16, "device"))
    index.apply(a1)
    first = tracker.after_batch(a1)
    assert set(first.instances) == {"a"} and first.instances["a"].shared == (7,)  # 7 is in the pool too
    assert first.pool_shared == [7]
    b1 = batch("b", 1, BlockStored((1,), None, 16, "device"))
    index.apply(b1)
    second = tracker.after_batch(b1)
    assert second.instances["a"].shared == (1,) and second.instances["b"].shared == (1,)
    b2 = batch("b", 2, BlockRemoved((1,), "device"))
    index.apply(b2)
    third = tracker.after_batch(b2)
    assert list(third.instances) == ["a"] and third.instances["a"].sole == (1,)


def test_a_move_between_an_instances_own_tiers_tells_nobody():
    index = BlockIndex()
    tracker = CopyTracker(index, lambda key: False)
    index.apply(batch("a", 1, BlockStored((1,), None, 16, "device")))
    move = batch("a", 2, BlockRemoved((1,), "device"), BlockStored((1,), None, 16, "host"))
    index.apply(move)
    assert not tracker.after_batch(move)


def test_a_paused_sessions_write_back_in_two_puts_keeps_the_first_puts_blocks():
    """The first put's blocks, which the instance also holds (replicated), are not the second put's victims when
    both puts name the session; stored under no session they would be (the defect a vLLM instance's write-backs
    showed: a paused session's pool copy cut to its first blocks)."""
    for first_session, survivors in (("t/agent", [1, 2, 3]), ("", [1])):
        pool = session_pool(6)
        put(pool, 10, 11, 12)  # older blocks of no session, not held elsewhere
        pool.session_signal("t/agent", SessionEvent.PAUSE, 60.0)
        context = [1, 2, 3, 4, 5] if first_session else []
        pool.put(LAYOUT, *blocks(1, 2, 3), session=first_session, session_blocks=context)
        pool.mark_replicated([1, 2, 3], [])  # the instance that wrote them holds them too
        pool.put(LAYOUT, *blocks(4, 5), session="t/agent", session_blocks=[1, 2, 3, 4, 5])
        assert held(pool, 1, 2, 3) == survivors, first_session
