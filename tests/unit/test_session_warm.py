"""A paused session's KV from the pool before its next request: what the instance remembers of each session's
context (bounded, least recent first), and the host's warm-up of it (on ``RESUME`` for this instance, or when the
engine says the session is due), which fetches the blocks past the local cache and which the request's own
fetch waits for instead of racing it."""

import asyncio
from types import SimpleNamespace

import pytest
from kvmesh.contracts.engine import SessionHint
from kvmesh.contracts.layout import KVLayout
from kvmesh.contracts.messages import SessionSignal
from kvmesh.contracts.sessions import SessionEvent
from kvmesh.instance.host import EngineHost, RolePlugin
from kvmesh.instance.session_contexts import SessionContexts
from kvmesh.settings import EngineSettings, InstanceSettings

BS = 16
NAMESPACES: dict[tuple[str, str], int] = {}  # a tenant salt and an adapter -> the seed of their block keys


def test_contexts_keep_the_latest_of_each_session_within_their_token_budget():
    c = SessionContexts(100)
    c.remember("a", "salt", "", list(range(40)))
    c.remember("b", "", "lora1", list(range(50)))
    assert c.tokens == 90 and len(c) == 2
    c.remember("a", "salt", "", list(range(45)))  # a's next turn replaces its context
    assert c.tokens == 95 and list(c.get("a").tokens) == list(range(45))
    c.get("b")  # used: a is now the least recent
    c.remember("c", "", "", list(range(30)))  # 125 > 100: the least recent (a) goes
    assert c.get("a") is None and c.tokens == 80
    assert c.get("b").lora == "lora1" and c.get("c").cache_salt == ""
    c.remember("d", "", "", list(range(101)))  # longer than the whole budget: not kept, nothing evicted for it
    assert c.get("d") is None and c.tokens == 80
    c.forget("b")
    c.forget("nobody")
    assert c.tokens == 30 and len(c) == 1


def test_a_zero_budget_keeps_nothing():
    c = SessionContexts(0)
    c.remember("a", "", "", [1, 2, 3])
    assert len(c) == 0 and c.tokens == 0
    with pytest.raises(ValueError, match="session_context_tokens"):
        SessionContexts(-1)


class Engine:
    """The seam's calls the warm-up makes: how much is cached, and the blocks the pool gave."""

    adopt_unit = 1

    def __init__(self, local: int) -> None:
        self.local = local
        self.adopted: list[tuple[str, int, int]] = []
        self.signals: list[SessionSignal] = []

    def namespace(self, cache_salt: str = "", lora: str = "") -> int:
        return NAMESPACES.setdefault((cache_salt, lora), len(NAMESPACES) + 1)

    async def match_prefix(self, namespace, tokens, max_tokens: int) -> int:
        return min(self.local, max_tokens // BS)

    async def adopt(self, namespace, tokens, first_block: int, data, num_blocks: int) -> bool:
        self.adopted.append((namespace, first_block, num_blocks))
        return True

    def signal_session(self, signal: SessionSignal) -> None:
        self.signals.append(signal)


class Pool:
    def __init__(self, delay: float = 0.0) -> None:
        self.asked: list[int] = []
        self.delay = delay

    async def fetch(self, keys, metadata=()):
        self.asked.append(len(keys))
        await asyncio.sleep(self.delay)
        return SimpleNamespace(num_blocks=len(keys), data=memoryview(b""))


def host(local: int = 2, delay: float = 0.0, budget: int = 1 << 20) -> EngineHost:
    h = EngineHost(InstanceSettings(id="both-0", session_context_tokens=budget), EngineSettings(),
                   [RolePlugin("test", attach=None)])
    h.engine, h.pool = Engine(local), Pool(delay)
    h.layout = KVLayout("m", 2, 1, 4, BS)
    return h


def signal(event: SessionEvent, instance: str = "") -> SessionSignal:
    return SessionSignal("t/agent", event, 0.0, instance)


def test_a_resume_for_this_instance_fetches_the_sessions_context_past_the_local_cache():
    async def body() -> None:
        h = host(local=2)
        h.remember_session(SessionHint("t/agent"), "t", "ad", list(range(5 * BS)))  # 5 full blocks, all wanted
        await h._on_session(signal(SessionEvent.RESUME, "both-1"), {})  # another instance's: not ours
        assert h.pool.asked == [] and h.engine.signals == []
        await h._on_session(signal(SessionEvent.RESUME, "both-0"), {})
        await h.session_warmed("t/agent")
        assert h.engine.signals[0].event is SessionEvent.RESUME  # the engine's own host-tier warm-up too
        assert h.pool.asked == [3] and h.engine.adopted == [(h.engine.namespace("t", "ad"), 2, 3)]
        assert h.metrics.session_warm_blocks.labels("resume")._value.get() == 3

    asyncio.run(body())


def test_the_engines_due_call_warms_and_an_end_forgets_the_context():
    async def body() -> None:
        h = host(local=0)
        h.remember_session(SessionHint("t/agent"), "", "", list(range(2 * BS + 3)))
        h.warm_session("t/agent", "due")
        await h.session_warmed("t/agent")
        assert h.pool.asked == [2] and h.metrics.session_warm_blocks.labels("due")._value.get() == 2
        await h._on_session(signal(SessionEvent.END), {})
        h.warm_session("t/agent", "due")
        await h.session_warmed("t/agent")
        assert h.pool.asked == [2] and len(h.session_contexts) == 0
        h.remember_session(SessionHint("t/agent", end=True), "", "", list(range(2 * BS)))  # its last request
        assert len(h.session_contexts) == 0
        h.remember_session(SessionHint("t/agent"), "", "", list(range(2 * BS)))
        await h._on_session(signal(SessionEvent.PAUSE, "both-0"), {})  # paused after a request here: kept
        assert len(h.session_contexts) == 1
        await h._on_session(signal(SessionEvent.PAUSE, "both-1"), {})  # its last request ran elsewhere: stale
        assert len(h.session_contexts) == 0

    asyncio.run(body())


def test_a_request_arriving_mid_warm_waits_for_it_and_one_warm_runs_at_a_time():
    async def body() -> None:
        h = host(local=0, delay=0.2)
        h.remember_session(SessionHint("t/agent"), "", "", list(range(4 * BS)))
        h.warm_session("t/agent", "resume")
        h.warm_session("t/agent", "due")  # in flight already: not fetched twice
        assert not h.pool.asked or h.pool.asked == [4]
        await h.session_warmed("t/agent")
        assert h.engine.adopted == [(h.engine.namespace(), 0, 4)] and h.pool.asked == [4]
        assert "t/agent" not in h._session_warms
        await h.session_warmed("t/agent")  # none in flight: returns at once

    asyncio.run(body())


def test_without_a_pool_nothing_is_remembered():
    h = host()
    h.pool = None
    h.remember_session(SessionHint("t/agent"), "", "", list(range(4 * BS)))
    assert len(h.session_contexts) == 0
