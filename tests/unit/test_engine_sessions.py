"""Sessions in the native engine's tiers: what a session-aware strategy keeps and lets go first, TTL pins,
prefetch of a paused session's demoted blocks, cachesvc's word on copies; and the same through ``AsyncEngine``
(``EngineRequest.session``, ``Engine.signal_session``)."""

import asyncio

import pytest
from kvmesh.contracts.engine import EngineRequest, SessionHint
from kvmesh.contracts.layout import KVLayout
from kvmesh.contracts.messages import SessionSignal
from kvmesh.contracts.sampling import SamplingParams
from kvmesh.contracts.sessions import SessionEvent
from kvmesh.engine import block_manager, eviction, tiers
from kvmesh.engine.block_manager import BlockManager
from kvmesh.engine.eviction import make_policy
from kvmesh.engine.kv_cache import DeviceKVPool, HostKVPool
from kvmesh.engine.sequence import RetentionRange, Sequence, Status
from kvmesh.engine.sessions import Mark

BS = 4
LAYOUT = KVLayout("fp", num_layers=1, num_kv_heads=1, head_dim=2, block_size=BS)


class Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        self.t += 0.001
        return self.t


@pytest.fixture
def clock(monkeypatch):
    c = Clock()
    for module in (block_manager, tiers, eviction):
        monkeypatch.setattr(module, "now", c)
    return c


def manager(num_blocks=8, policy="session", host_blocks=0):
    host = HostKVPool(LAYOUT, host_blocks) if host_blocks else None
    return BlockManager(DeviceKVPool(LAYOUT, num_blocks), host, make_policy(policy))


def turn(bm, tokens, session="", end=False, retention=()):
    """A request of ``session`` ("" = none) that computes ``tokens`` and finishes."""
    hint = SessionHint(session, end) if session else None
    seq = Sequence("r", list(tokens), SamplingParams(), 1, retention, session=hint)
    assert bm.allocate_prefix(seq)
    assert bm.ensure_slots(seq, len(tokens))
    seq.num_computed_tokens = len(tokens)
    seq.status = Status.FINISHED
    bm.free(seq)


def cached(bm, tokens):
    return bm.match(1, tokens).num_tokens


def churn(bm, n, first=100, session="t/other"):
    """``n`` one-block turns of another session, each new."""
    for i in range(n):
        turn(bm, [first + i] * BS, session)


A = [1, 1, 1, 1, 2, 2, 2, 2]   # two blocks
B = [3, 3, 3, 3, 4, 4, 4, 4]


def test_a_paused_sessions_blocks_survive_while_another_session_churns_the_cache(clock):
    bm = manager(num_blocks=6, policy="session")
    turn(bm, A, "t/agent")
    bm.session_signal("t/agent", SessionEvent.PAUSE)
    churn(bm, 12)
    assert cached(bm, A) == 8
    lru = manager(num_blocks=6, policy="lru")  # without the signal, the paused session's blocks go
    turn(lru, A, "t/agent")
    churn(lru, 12)
    assert cached(lru, A) == 0


def test_an_ended_sessions_blocks_go_before_a_live_ones(clock):
    bm = manager(num_blocks=4, policy="session")
    turn(bm, A, "t/live")
    turn(bm, B, "t/done", end=True)  # newer, but its client said it was the last turn
    turn(bm, [5] * BS * 2)  # needs two blocks: the ended session's go
    assert cached(bm, A) == 8 and cached(bm, B) == 0


def test_an_explicit_close_lets_a_sessions_blocks_go_first(clock):
    bm = manager(num_blocks=4, policy="session")
    turn(bm, A, "t/live")
    turn(bm, B, "t/closed")
    bm.session_signal("t/closed", SessionEvent.END)
    turn(bm, [5] * BS * 2)
    assert cached(bm, A) == 8 and cached(bm, B) == 0


def test_a_shared_prefix_stays_while_a_live_session_holds_it(clock):
    bm = manager(num_blocks=4, policy="session")
    system = [9] * BS
    turn(bm, system + [1] * BS, "t/a")
    turn(bm, system + [2] * BS, "t/b", end=True)
    prefix, b_own = bm.match(1, system + [2] * BS).nodes

    def mark(node):
        return bm.sessions.mark(node.chain, node.session_owner, clock())

    assert (mark(prefix), mark(b_own)) == (Mark.LIVE, Mark.RELEASED)
    turn(bm, [7] * BS * 2)  # b's own block goes first
    assert cached(bm, system + [1] * BS) == 8 and cached(bm, system + [2] * BS) == 4
    bm.session_signal("t/a", SessionEvent.END)
    assert mark(prefix) is Mark.UNKNOWN  # two sessions used it: ranked as without sessions, not released


def test_tenants_cannot_end_each_others_sessions(clock):
    bm = manager(num_blocks=4, policy="session")
    turn(bm, A, "tenant-a/chat")
    turn(bm, B, "tenant-b/other", end=True)
    bm.session_signal("tenant-b/chat", SessionEvent.END)  # the same id under another tenant: another session
    assert "tenant-a/chat" in bm.sessions
    turn(bm, [5] * BS * 2)
    assert cached(bm, A) == 8 and cached(bm, B) == 0  # had a's session ended too, a (older) would go first


def test_a_ttl_pin_holds_until_it_expires(clock):
    bm = manager(num_blocks=6, policy="session")
    pin = (RetentionRange(0, 8, priority=50, duration_s=5.0),)
    turn(bm, A, "t/pinned", end=True, retention=pin)  # ended, but pinned for 5 s
    churn(bm, 8)
    assert cached(bm, A) == 8
    clock.t += 6.0
    churn(bm, 8, first=200)
    assert cached(bm, A) == 0


def test_a_paused_sessions_demoted_blocks_are_warmed_back_and_counted_when_used(clock):
    bm = manager(num_blocks=4, policy="session", host_blocks=8)
    turn(bm, A, "t/agent")
    bm.session_signal("t/agent", SessionEvent.PAUSE)
    for i in range(4):  # busy turns hold every device block: the paused blocks are demoted to the host
        seq = Sequence(f"busy{i}", [50 + i] * BS * 4, SamplingParams(), 1)
        assert bm.allocate_prefix(seq) and bm.ensure_slots(seq, BS * 4)
        seq.num_computed_tokens = BS * 4
        bm.free(seq)
    nodes = bm.match(1, A).nodes
    assert len(nodes) == 2 and all(n.block_id is None and n.host_slot is not None for n in nodes)
    assert bm.prefetch("t/agent") == 2
    assert all(n.block_id is not None and n.prefetched for n in nodes)
    turn(bm, A + [3] * BS, "t/agent")
    assert bm.stats["prefetch_loaded"] == 2 and bm.stats["prefetch_used"] == 2
    assert bm.stats["prefetch_wasted"] == 0 and bm.prefetch("t/nobody") == 0


def test_a_demoted_sessions_blocks_make_room_then_are_kept_once_warmed_back(clock):
    """A demoted session's blocks rank as if no session held them, so live work pushes them to the host; warmed
    back for its return they rank as a paused session's and count as just used, so other work evicts its own
    blocks first (before, warmed blocks ranked by their old recency: loaded, then the first to go)."""
    bm = manager(num_blocks=4, policy="session", host_blocks=8)
    turn(bm, A, "t/agent")
    bm.session_signal("t/agent", SessionEvent.DEMOTE, expected_s=5.0)
    for i in range(2):  # live sessions' work outranks a demoted one's blocks: they go to the host
        turn(bm, [100 + i] * BS * 2, f"t/live{i}")
    assert all(n.block_id is None for n in bm.match(1, A).nodes)
    assert bm.prefetch("t/agent") == 2  # about to return: warmed back, and kept from now on
    turn(bm, [200] * BS * 2, "t/live2")  # more live work: two blocks must go, and they are not the agent's
    assert all(n.block_id is not None for n in bm.match(1, A).nodes)
    turn(bm, A + [3] * BS, "t/agent")
    assert bm.stats["prefetch_used"] == 2 and bm.stats["prefetch_wasted"] == 0


def test_blocks_with_another_copy_in_the_cluster_go_before_last_copies(clock):
    bm = manager(num_blocks=4, policy="session")
    turn(bm, A)
    turn(bm, B)
    keys = [n.chain for n in bm.match(1, B).nodes]
    bm.cluster_copies(keys, [])  # the newer blocks have another copy elsewhere
    turn(bm, [5] * BS * 2)
    assert cached(bm, A) == 8 and cached(bm, B) == 0


def test_without_a_session_aware_strategy_signals_change_nothing(clock):
    bm = manager(num_blocks=5, policy="lru")
    turn(bm, A, "t/a")
    bm.session_signal("t/a", SessionEvent.END)
    bm.cluster_copies([n.chain for n in bm.match(1, A).nodes], [])
    assert bm.sessions is None and cached(bm, A) == 8


# ---- through the seam ------------------------------------------------------------------------------------------

def test_the_engine_takes_a_requests_session_and_its_signals(tiny_config):
    from kvmesh.engine.async_engine import AsyncEngine
    from kvmesh.engine.llm_engine import LLMEngine
    from kvmesh.settings import EngineSettings

    async def body() -> None:
        cfg = EngineSettings(num_blocks=32, block_size=4, eviction="session")
        engine = AsyncEngine(LLMEngine(cfg, model_config=tiny_config), asyncio.get_running_loop())
        try:
            params = SamplingParams(max_tokens=2, temperature=0.0)
            prompt = tuple(range(1, 30))
            async for _ in engine.generate(EngineRequest("r1", prompt, params, session=SessionHint("t/s"))):
                pass
            table = engine.engine.blocks.sessions
            assert "t/s" in table and engine.stats().sessions == 1
            engine.signal_session(SessionSignal("t/s", SessionEvent.PAUSE, 0.0))
            await engine.call(lambda e: None)  # commands run in order: the signal was applied
            assert table.get("t/s").paused
            engine.signal_session(SessionSignal("t/s", SessionEvent.END, 0.0))
            await engine.call(lambda e: None)
            assert "t/s" not in table and engine.stats().sessions == 0
        finally:
            await engine.close()

    asyncio.run(body())


AGENT = tuple(range(1, 22))  # 5 full blocks of 4 tokens


async def serve(engine, rid: str, prompt: tuple[int, ...], session: str = "") -> None:
    """One greedy 1-token request through the engine's seam, to its end."""
    params = SamplingParams(max_tokens=1, temperature=0.0)
    async for _ in engine.generate(EngineRequest(rid, prompt, params, session=SessionHint(session) if session
                                                 else None)):
        pass


async def crowd_out(engine) -> None:
    """Other work fills a 16-block device: what a session left there is demoted to the host."""
    for i in range(2):
        await serve(engine, f"o{i}", tuple(range(100 + 60 * i, 160 + 60 * i)))


def test_a_pause_warms_the_sessions_demoted_blocks_back_before_it_is_expected(tiny_config):
    """Through the seam: the pause signal sets a timer (the session's expected pause less the lead), which loads
    the blocks other work demoted to the host tier back onto the device."""
    from kvmesh.engine.async_engine import AsyncEngine
    from kvmesh.engine.llm_engine import LLMEngine
    from kvmesh.settings import EngineSettings

    async def body() -> None:
        cfg = EngineSettings(num_blocks=16, block_size=4, eviction="session", host_cache_mb=1,
                             session_pause_s=0.5, session_prefetch_lead_s=0.1)
        engine = AsyncEngine(LLMEngine(cfg, model_config=tiny_config), asyncio.get_running_loop())
        try:
            agent = AGENT
            await serve(engine, "a", agent, "t/agent")
            await crowd_out(engine)
            on_host = await engine.call(lambda e: sum(n.block_id is None for n in e.blocks.match(
                engine.namespace(), agent).nodes))
            assert on_host > 0
            engine.signal_session(SessionSignal("t/agent", SessionEvent.PAUSE, 0.0))  # its response: a tool call
            for _ in range(200):  # the timer fires 0.4 s on (the expected pause less the lead)
                if engine.stats().prefetch_loaded:
                    break
                await asyncio.sleep(0.05)
            assert engine.stats().prefetch_loaded > 0
            on_device = await engine.call(lambda e: sum(n.block_id is not None for n in e.blocks.match(
                engine.namespace(), agent).nodes))
            assert on_device == 5
        finally:
            await engine.close()

    asyncio.run(body())


def test_a_resume_warms_the_sessions_demoted_blocks_back_at_once(tiny_config):
    """Through the seam: the session's next request reached a router (``RESUME``): its blocks on the host tier
    are loaded back onto the device now, long before its announced pause would have (a 1-hour pause)."""
    from kvmesh.engine.async_engine import AsyncEngine
    from kvmesh.engine.llm_engine import LLMEngine
    from kvmesh.settings import EngineSettings

    async def body() -> None:
        cfg = EngineSettings(num_blocks=16, block_size=4, eviction="session", host_cache_mb=1)
        engine = AsyncEngine(LLMEngine(cfg, model_config=tiny_config), asyncio.get_running_loop())
        try:
            agent = AGENT
            await serve(engine, "a", agent, "t/agent")
            engine.signal_session(SessionSignal("t/agent", SessionEvent.DEMOTE, 0.0, expected_s=3600.0))
            await crowd_out(engine)  # the demoted session's blocks go to the host

            def where(e) -> list[bool]:
                return [n.block_id is not None for n in e.blocks.match(engine.namespace(), agent).nodes]

            assert not all(await engine.call(where))
            assert engine.stats().prefetch_loaded == 0  # the timer is an hour away
            engine.signal_session(SessionSignal("t/agent", SessionEvent.RESUME, 0.0, "both-0"))
            await engine.call(lambda e: None)  # commands run in order: the resume was applied
            assert engine.stats().prefetch_loaded > 0 and all(await engine.call(where))
        finally:
            await engine.close()

    asyncio.run(body())


def test_a_pause_tells_the_host_when_the_session_is_due_without_a_host_tier(tiny_config):
    """Through the seam: with a sink set (the host, to fetch from the pool), a pause gets its timer even without a
    host tier, and the sink hears the session once it is due; a session back before then is not announced."""
    from kvmesh.engine.async_engine import AsyncEngine
    from kvmesh.engine.llm_engine import LLMEngine
    from kvmesh.settings import EngineSettings

    async def body() -> None:
        cfg = EngineSettings(num_blocks=16, block_size=4, eviction="session", session_prefetch_lead_s=0.1)
        engine = AsyncEngine(LLMEngine(cfg, model_config=tiny_config), asyncio.get_running_loop())
        due: list[str] = []
        engine.on_session_due(due.append)
        try:
            await serve(engine, "a", AGENT, "t/agent")
            await serve(engine, "b", AGENT[:9], "t/other")
            engine.signal_session(SessionSignal("t/agent", SessionEvent.PAUSE, 0.0, expected_s=0.3))
            engine.signal_session(SessionSignal("t/other", SessionEvent.PAUSE, 0.0, expected_s=0.3))
            await serve(engine, "b2", AGENT[:13], "t/other")  # back before it was due: its timer finds it so
            for _ in range(100):
                if due:
                    break
                await asyncio.sleep(0.05)
            await asyncio.sleep(0.2)
            assert due == ["t/agent"]
        finally:
            await engine.close()

    asyncio.run(body())
