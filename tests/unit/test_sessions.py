"""Sessions as a cache sees them (``kvmesh.engine.sessions``), the session-aware eviction strategies, and the
simulator's sessions: rebuilt from prefix chains, signalled by a share of the clients."""

import json
import math
from dataclasses import dataclass

import pytest
from kvmesh.contracts.sessions import SessionEvent
from kvmesh.engine.eviction import SessionAware, SessionDuel, make_policy
from kvmesh.engine.eviction_queue import EvictionQueue
from kvmesh.engine.sessions import SHARED, Mark, SessionTable, owner_after

from app.bench.trace import TraceRequest, rebuild_sessions, signals_share, with_sessions
from app.sim import BlockCache, main, simulate


@dataclass(eq=False)
class Blk:
    key: int
    last_access: float
    session_owner: str = ""
    hit_count: int = 0
    priority: int = 0
    priority_until: float = 0.0
    replicated: bool = False


def ranked(policy, blocks, now):
    q = EvictionQueue(policy)
    for b in blocks:
        q.push(b, now)
    return [q.pop(now).key for _ in blocks]


def test_an_ended_sessions_blocks_go_before_a_live_ones_even_when_more_recent():
    p = SessionAware()
    live, ended = Blk(1, 1.0, "t/a"), Blk(2, 5.0, "t/b")
    p.sessions.request("t/a", [1], 1.0)
    p.sessions.request("t/b", [2], 5.0, end=True)
    assert ranked(p, [live, ended], 6.0) == [2, 1]


def test_an_explicit_close_releases_what_the_session_held():
    t = SessionTable()
    t.request("t/a", [1, 2], 0.0)
    assert t.mark(1, "t/a", 1.0) is Mark.LIVE
    assert t.end("t/a") == {1, 2} and t.mark(1, "t/a", 1.0) is Mark.RELEASED and "t/a" not in t


def test_a_shared_prefix_stays_held_while_any_live_session_holds_it():
    t = SessionTable()
    t.request("t/a", [0, 1], 0.0)
    t.request("t/b", [0, 2], 1.0)
    t.end("t/a")
    assert t.mark(0, SHARED, 2.0) is Mark.LIVE and t.mark(1, "t/a", 2.0) is Mark.RELEASED
    t.end("t/b")
    assert t.mark(0, SHARED, 3.0) is Mark.UNKNOWN  # several sessions used it: the next one may want it


def test_a_new_turn_lets_go_of_the_blocks_it_moved_past():
    t = SessionTable()
    t.request("t/a", [0, 1, 2], 0.0)
    assert t.request("t/a", [0, 1, 3, 4], 1.0) == {2, 3, 4}
    assert t.mark(2, "t/a", 1.0) is Mark.RELEASED and t.mark(3, "t/a", 1.0) is Mark.LIVE


def test_owner_after_tells_one_sessions_blocks_from_shared_ones():
    assert owner_after("", "t/a") == "t/a" and owner_after("t/a", "t/a") == "t/a"
    assert owner_after("t/a", "t/b") == SHARED and owner_after("t/a", "") == SHARED
    assert owner_after("", "") == "" and owner_after(SHARED, "t/a") == SHARED


def test_a_paused_sessions_blocks_outrank_live_ones_until_it_is_overdue():
    p = SessionAware(sessions=SessionTable(default_pause_s=10.0))
    paused, live = Blk(1, 1.0, "t/a"), Blk(2, 5.0, "t/b")
    p.sessions.request("t/a", [1], 1.0)
    p.sessions.request("t/b", [2], 5.0)
    p.sessions.pause("t/a", 1.0)
    q = EvictionQueue(p)
    for b in (paused, live):
        q.push(b, 5.0)
    assert q.pop(6.0) is live  # the paused one is expected back within 10 s: kept
    q.push(live, 6.0)
    assert q.pop(22.0) is paused  # overdue (past twice its expected pause): ranked by its age again


def test_an_overdue_pause_says_nothing_more_but_a_live_holder_still_does():
    t = SessionTable(default_pause_s=10.0)
    t.request("t/a", [0, 1], 0.0)
    t.request("t/b", [0, 2], 0.0)
    t.pause("t/a", 0.0)
    assert t.mark(1, "t/a", 5.0) is Mark.PAUSED and t.mark_drops_at(1, 5.0) == 20.0
    assert t.mark(1, "t/a", 21.0) is Mark.UNKNOWN  # twice its expected pause gone by: slow, or gone
    assert t.mark(0, SHARED, 21.0) is Mark.LIVE  # b, which is not paused, still holds the shared block


def test_a_session_learns_its_own_pause_length():
    t = SessionTable(default_pause_s=100.0)
    t.request("t/a", [1], 0.0)
    t.pause("t/a", 0.0)
    assert t.expected_return("t/a") == 100.0
    t.request("t/a", [1, 2], 4.0)
    t.pause("t/a", 10.0)
    assert t.expected_return("t/a") == 14.0 and t.expected_return("t/nobody") is None


def test_a_ttl_pin_outranks_everything_until_it_expires():
    p = SessionAware()
    pinned, fresh = Blk(1, 0.0, priority=50, priority_until=10.0), Blk(2, 5.0)
    p.sessions.request("t/a", [2], 5.0)
    q = EvictionQueue(p)
    for b in (pinned, fresh):
        q.push(b, 5.0)
    assert q.pop(6.0) is fresh
    q.push(fresh, 6.0)
    assert q.pop(11.0) is pinned  # the pin expired: the oldest block goes


def test_a_block_with_another_copy_in_the_cluster_goes_before_a_last_copy():
    p = SessionAware()
    sole, copied = Blk(1, 0.0), Blk(2, 5.0, replicated=True)
    assert ranked(p, [sole, copied], 6.0) == [2, 1]


def test_without_signals_the_order_is_the_base_strategys():
    blocks = [Blk(k, float(t)) for k, t in ((1, 3), (2, 1), (3, 2))]
    assert ranked(SessionAware(), blocks, 9.0) == ranked(make_policy("lru"), blocks, 9.0) == [2, 3, 1]
    assert isinstance(SessionDuel().base, type(make_policy("duel")))


def test_idle_sessions_expire_as_if_they_had_ended():
    t = SessionTable(idle_s=60.0)
    t.request("t/a", [1], 0.0)
    assert t.expire(30.0) == set() and t.expire(61.0) == {1} and len(t) == 0


# ---- the simulator -------------------------------------------------------------------------------------------

def chat(n_sessions: int = 12, turns: int = 4) -> list[TraceRequest]:
    """Conversations that grow by two blocks a turn (the last one partial), interleaved."""
    out = []
    for turn in range(turns):
        for s in range(n_sessions):
            ids = (0, *(1000 * (s + 1) + k for k in range(2 * turn + 2)))
            out.append(TraceRequest(len(out), 512 * len(ids) - 100, 20, ids))
    return out


def test_sessions_are_rebuilt_from_the_prefix_chains():
    trace = rebuild_sessions(chat(3, 3))
    assert len({r.session_id for r in trace}) == 3
    assert [r.session_end for r in trace] == [False] * 6 + [True] * 3
    assert all(r.session_id == trace[n % 3].session_id for n, r in enumerate(trace))


def test_a_share_of_sessions_signals_and_the_others_are_anonymous_or_named():
    trace = chat(40, 2)
    half = with_sessions(trace, 0.5)
    signalled = {r.session_id for r in half if r.session_id}
    assert 0 < len(signalled) < 40 and all(signals_share(s, 0.5) for s in signalled)
    assert {r.session_id for r in with_sessions(trace, 0.25) if r.session_id} <= signalled
    named = with_sessions(trace, 0.5, "named")
    assert len({r.session_id for r in named}) == 40 and sum(r.session_end for r in named) == len(signalled)
    assert not any(r.session_id for r in with_sessions(trace, 0.0))
    with pytest.raises(ValueError, match=r"in \[0, 1\]"):
        with_sessions(trace, 1.5)


def test_ended_sessions_signalled_beat_lru_in_the_simulator():
    # 30 conversations of 4 turns, then 10 one-off requests: the blocks the sessions moved past (each turn's
    # partial tail) and those of the ended ones go first, so the conversations keep more of their history
    ends = with_sessions([*chat(30, 4), *(TraceRequest(200 + n, 1000, 5, (5000 + n, 5001 + n)) for n in range(10))])
    lru = simulate(ends, 1, "round_robin", 40, 0, eviction="lru")["hit_rate"]
    session = simulate(ends, 1, "round_robin", 40, 0, eviction="session")["hit_rate"]
    assert session > lru


def test_the_sim_cache_keeps_a_paused_sessions_blocks():
    c = BlockCache(4, "session")
    c.touch((1, 2), 0, session="t/a")
    c.pause("t/a")
    c.touch((3, 4), 0, session="t/b")
    c.touch((5,), 0, session="t/c")
    assert c.prefix((1, 2)) == 2  # b's older block went instead


def test_sim_cli_takes_the_session_end_share_and_refuses_a_bad_one(tmp_path, capsys):
    path = tmp_path / "t.jsonl"
    path.write_text("\n".join(json.dumps({"timestamp": r.arrival_s, "input_length": r.input_length,
                                          "output_length": 5, "hash_ids": list(r.hash_ids)}) for r in chat()))
    argv = ["--trace", str(path), "--instances", "1", "--policy", "round_robin", "--capacity-blocks", "20",
            "--pool-blocks", "0", "--eviction", "session", "--json"]
    assert main([*argv, "--session-end-share", "0.5"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert 0 < out["sessions"] < 12 and out["sessions_ended"] == out["sessions"]
    assert main([*argv, "--session-end-share", "2"]) == 2
    assert "[0, 1]" in capsys.readouterr().err


def test_trace_session_fields_are_read_and_checked(tmp_path):
    from app.bench.trace import load_trace

    path = tmp_path / "t.jsonl"
    path.write_text(json.dumps({"timestamp": 0, "input_length": 9, "output_length": 1, "hash_ids": [1],
                                "session_id": "x", "session_end": True, "pause": False}) + "\n")
    (r,) = load_trace(path)
    assert (r.session_id, r.session_end, r.pause) == ("x", True, False)
    path.write_text(json.dumps({"timestamp": 0, "input_length": 9, "output_length": 1, "hash_ids": [1],
                                "session_id": 7}) + "\n")
    with pytest.raises(ValueError, match="session_id must be a string"):
        load_trace(path)


def test_expected_pause_is_infinite_in_the_simulator_until_one_is_seen():
    c = BlockCache(4, "session")
    assert c.sessions.default_pause_s == math.inf


def test_a_pause_heard_before_the_write_back_is_kept_and_a_write_back_does_not_end_it():
    t = SessionTable(default_pause_s=10.0)
    assert t.pause("t/a", 0.0) == set() and "t/a" not in t  # an engine that never saw the session: ignored
    t.pause("t/a", 0.0, create=True)  # the pool: the write-back of the paused turn comes after the signal
    t.request("t/a", [1, 2], 0.5, resume=False)
    assert t.get("t/a").paused and t.mark(1, "t/a", 1.0) is Mark.PAUSED
    t.pause("t/a", 30.0)  # paused again later: held afresh from then
    assert t.mark(1, "t/a", 40.0) is Mark.PAUSED and t.mark(1, "t/a", 51.0) is Mark.UNKNOWN


def test_every_eviction_the_sim_lists_runs_with_a_session_end_share(tmp_path, capsys):
    from kvmesh.engine.eviction import POLICIES

    path = tmp_path / "t.jsonl"
    path.write_text("\n".join(json.dumps({"timestamp": r.arrival_s, "input_length": r.input_length,
                                          "output_length": 5, "hash_ids": list(r.hash_ids)}) for r in chat()))
    for name in POLICIES:
        for share in ("1", "0.5", "0"):
            assert main(["--trace", str(path), "--instances", "1", "--policy", "round_robin", "--capacity-blocks",
                         "20", "--pool-blocks", "0", "--eviction", name, "--session-end-share", share,
                         "--json"]) == 0
            assert 0 <= json.loads(capsys.readouterr().out)["hit_rate"] <= 1


def test_an_announced_pause_sets_the_expected_return_until_the_session_is_back():
    t = SessionTable(default_pause_s=100.0)
    t.request("t/a", [1], 0.0)
    t.signal("t/a", SessionEvent.PAUSE, 0.0, expected_s=7.0)
    assert t.expected_return("t/a") == 7.0
    assert t.mark(1, "t/a", 13.0) == Mark.PAUSED and t.mark(1, "t/a", 15.0) == Mark.UNKNOWN  # overdue past 2 x 7
    t.request("t/a", [1, 2], 5.0)  # back: its cadence learns the 5 s it really took
    t.pause("t/a", 10.0)
    assert t.expected_return("t/a") == 15.0


def test_a_demoted_pause_keeps_the_cadence_but_not_the_blocks_rank():
    t = SessionTable(default_pause_s=10.0)
    t.request("t/a", [1, 2], 0.0)
    t.request("t/b", [2, 3], 0.0)
    t.signal("t/b", SessionEvent.PAUSE, 0.0)
    t.signal("t/a", SessionEvent.DEMOTE, 0.0, expected_s=4.0)
    assert t.expected_return("t/a") == 4.0
    assert t.mark(1, "t/a", 1.0) == Mark.UNKNOWN  # as if no session held it: it may move down the tiers
    assert t.mark(2, SHARED, 1.0) == Mark.PAUSED  # b's pause still keeps the block they share
    assert t.retain("t/a") == {1, 2} and t.mark(1, "t/a", 1.5) == Mark.PAUSED  # about to return: kept
    assert t.retain("t/a") == set()
    t.request("t/a", [1, 2], 3.0)  # back: b's pause is untouched
    assert t.mark(2, SHARED, 3.5) == Mark.PAUSED and t.mark(1, "t/a", 3.5) == Mark.LIVE
    t.signal("t/a", SessionEvent.DEMOTE, 4.0)
    t.request("t/a", [1, 2, 5], 5.0)  # back again without a warm-up: every count is undone
    assert t.mark(5, "t/a", 5.0) == Mark.LIVE and not t._demoted and t.mark(1, "t/a", 5.0) == Mark.LIVE


def test_a_release_lets_go_of_what_the_session_holds_but_keeps_it():
    t = SessionTable()
    t.request("t/a", [1, 2], 0.0)
    t.signal("t/a", SessionEvent.PAUSE, 0.0)
    assert t.signal("t/a", SessionEvent.RELEASE, 1.0) == {1, 2}
    assert t.mark(1, "t/a", 1.0) == Mark.RELEASED and "t/a" in t
    assert t.expected_return("t/a") is None
    assert t.signal("t/a", SessionEvent.RESUME, 1.0) == set() and t.signal("t/a", SessionEvent.ROUTED, 1.0) == set()


def test_a_paused_sessions_request_waiting_to_run_keeps_its_blocks_as_paused():
    t = SessionTable(default_pause_s=2.0)
    t.request("t/a", [1, 2], 0.0)
    t.signal("t/a", SessionEvent.DEMOTE, 0.0)
    assert t.mark(1, "t/a", 1.0) == Mark.UNKNOWN
    assert t.back("t/a", 10.0) == {1, 2}  # overdue long ago, and demoted: kept again while its request waits
    assert t.mark(1, "t/a", 10.5) == Mark.PAUSED and t.mark(1, "t/a", 14.5) == Mark.UNKNOWN
    t.request("t/a", [1, 2, 3], 11.0)
    assert t.get("t/a").pause_gaps == [11.0] and t.back("t/a", 12.0) == set()  # not paused: nothing to keep


def test_the_sim_hears_a_requests_pause_before_making_room_for_it():
    # b is back in 100; a's request ends in a tool call and a is back in 10: as a paused session's, a's blocks
    # stay and b's goes (heard after making room, a's would have gone first, as a live session's)
    c = BlockCache(3, "session")
    c.sessions.default_pause_s = 10.0  # the clock counts block accesses
    c.touch((10,), 0, session="b")
    c.pause("b", expected_s=100.0)
    c.touch((1, 2, 3), 0, session="a", pause=True)
    assert c.prefix((1, 2, 3)) == 3 and c.prefix((10,)) == 0


def test_simulate_tells_each_cache_of_the_requests_pause():
    # a pauses; a request without a session needs room: a's prefix stays (LRU breaks it) and a's return hits it
    trace = [TraceRequest(0, 1000, 5, (1, 2), "a", pause=True), TraceRequest(1, 1500, 5, (3, 4, 5)),
             TraceRequest(2, 1500, 5, (1, 2, 6), "a", session_end=True)]
    hits = {name: simulate(trace, 1, "round_robin", 4, 0, eviction=name)["hit_rate"] for name in ("lru", "session")}
    assert hits == {"lru": 0.0, "session": 2 / 8}


# ---- among paused sessions: the one expected back last goes first ----------------------------------------------

def test_among_paused_sessions_the_block_needed_last_goes_first_even_when_more_recent():
    # a waits on quick tools (its pauses: 2 s), b on slow ones (30 s); paused together, b is back last, so its
    # block goes first although a's was used longer ago (LRU would take a's)
    p = SessionAware(sessions=SessionTable(default_pause_s=10.0))
    t = p.sessions
    for key, block, gap in (("t/a", 1, 2.0), ("t/b", 2, 30.0)):
        t.request(key, [block], 0.0)
        t.pause(key, 0.0)
        t.request(key, [block], gap)
    t.pause("t/a", 31.0)
    t.pause("t/b", 31.0)
    assert t.expected_back("t/a") == 33.0 and t.expected_back("t/b") == 61.0
    assert ranked(p, [Blk(1, 2.0, "t/a"), Blk(2, 30.0, "t/b")], 32.0) == [2, 1]


def test_a_block_several_sessions_used_outlasts_every_paused_sessions_own_blocks():
    # whichever of a and b is back first reads block 0, and so may the next session to start with it
    p = SessionAware(sessions=SessionTable(default_pause_s=10.0))
    t = p.sessions
    t.request("t/a", [0, 1], 0.0)
    t.request("t/b", [0, 2], 0.0)
    t.pause("t/a", 0.0, expected_s=5.0)
    t.pause("t/b", 1.0, expected_s=50.0)
    blocks = [Blk(0, 0.0, SHARED), Blk(1, 1.0, "t/a"), Blk(2, 1.0, "t/b")]
    assert ranked(p, blocks, 2.0) == [2, 1, 0]  # b is back last, then a; the block both read goes last
    blocks[0].session_owner = "t/a"  # evicted and brought back by a: one session used this copy, both hold it
    assert ranked(p, blocks, 2.0) == [2, 1, 0]


def test_a_paused_session_is_expected_back_after_its_pause_or_as_soon_as_its_request_arrived():
    t = SessionTable(default_pause_s=10.0)
    t.request("t/a", [1], 0.0)
    assert t.expected_back("t/a") == math.inf  # not paused
    t.pause("t/a", 2.0)
    assert t.expected_back("t/a") == 12.0
    t.back("t/a", 5.0)  # its next request waits to run: needed now
    assert t.expected_back("t/a") == 5.0
    t.request("t/a", [1, 2], 6.0)
    assert t.expected_back("t/a") == math.inf and t.expected_back("t/nobody") == math.inf


def test_the_sim_cache_keeps_the_paused_session_expected_back_first():
    c = BlockCache(3, "session")
    c.sessions.default_pause_s = 10.0  # the clock counts block accesses
    c.touch((1, 2), 0, session="a")
    c.pause("a", expected_s=50.0)  # back at 52
    c.touch((3,), 0, session="b")
    c.pause("b", expected_s=20.0)  # back at 23
    c.touch((5,), 0, session="c", pause=True)  # back at 14; a, back last, loses its chain's tail
    assert (c.prefix((1, 2)), c.prefix((3,)), c.prefix((5,))) == (1, 1, 1)
