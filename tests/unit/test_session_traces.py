"""The session-structured trace shapes (``app.bench.session_traces``): each has the structure its docstring
states, a seed fixes it, and the trace format carries a sub-agent's parent."""

import json
import math
from collections import defaultdict
from itertools import pairwise

import pytest

from app.bench.session_traces import (
    SHAPES,
    chat,
    coding,
    every_end_known,
    fanout,
    live_working_set,
    main,
    tenants,
    unsaid_ends,
)
from app.bench.sessions import measure
from app.bench.trace import TRACE_BLOCK_TOKENS, TraceRequest, dump_trace, load_trace, with_every_end, with_sessions

SMALL = {"coding": 20, "fanout": 12, "chat": 150, "tenants": 60}


def by_session(trace: list[TraceRequest]) -> dict[str, list[TraceRequest]]:
    out: dict[str, list[TraceRequest]] = defaultdict(list)
    for r in trace:
        out[r.session_id].append(r)
    return out


@pytest.mark.parametrize("shape", sorted(SHAPES))
def test_a_seed_fixes_the_trace_and_another_seed_changes_it(shape):
    make = SHAPES[shape]
    assert make(SMALL[shape], seed=5) == make(SMALL[shape], seed=5)
    assert make(SMALL[shape], seed=5) != make(SMALL[shape], seed=6)


@pytest.mark.parametrize("shape", sorted(SHAPES))
def test_every_request_is_a_well_formed_trace_line_of_a_session_in_arrival_order(shape):
    trace = SHAPES[shape](SMALL[shape])
    assert [r.arrival_s for r in trace] == sorted(r.arrival_s for r in trace)
    for r in trace:
        assert r.session_id and r.hash_ids[0] == 0
        assert len(r.hash_ids) == math.ceil(r.input_length / TRACE_BLOCK_TOKENS)
        assert len(set(r.hash_ids)) == len(r.hash_ids)


@pytest.mark.parametrize("shape", ["coding", "fanout", "tenants"])
def test_every_step_but_the_last_pauses_and_the_last_ends_the_session(shape):
    for requests in by_session(SHAPES[shape](SMALL[shape])).values():
        assert [r.pause for r in requests] == [True] * (len(requests) - 1) + [False]
        assert [r.session_end for r in requests] == [False] * (len(requests) - 1) + [True]


def test_a_sessions_context_grows_from_its_previous_request_less_the_partial_tail():
    for requests in by_session(coding(10)).values():
        for prev, nxt in pairwise(requests):
            assert nxt.hash_ids[:len(prev.hash_ids) - 1] == prev.hash_ids[:-1]
            assert len(nxt.hash_ids) >= len(prev.hash_ids)


def test_coding_agents_share_a_large_preamble_per_app_and_some_tools_take_minutes():
    sessions = by_session(coding(60))
    firsts = [rs[0].hash_ids for rs in sessions.values()]
    preambles = {ids[:25] for ids in firsts}
    assert len(preambles) <= 4 and all(sum(ids[:25] == p for ids in firsts) > 1 for p in preambles)
    gaps = [b.arrival_s - a.arrival_s for rs in sessions.values() for a, b in pairwise(rs)]
    assert sum(g > 60 for g in gaps) > 0 and sum(g < 30 for g in gaps) > len(gaps) / 2
    assert sum(len(rs) for rs in sessions.values()) / len(sessions) > 8  # many steps


def test_fanout_sub_agents_name_their_parent_and_start_from_its_context():
    trace = fanout(15)
    sessions = by_session(trace)
    subs = {sid: rs for sid, rs in sessions.items() if rs[0].parent_session_id}
    assert subs and len(subs) > len(sessions) - len(subs)
    for rs in subs.values():
        parent = rs[0].parent_session_id
        assert parent in sessions and not sessions[parent][0].parent_session_id
        assert all(r.parent_session_id == parent for r in rs)
        forked = max((r for r in sessions[parent] if r.arrival_s <= rs[0].arrival_s), key=lambda r: r.arrival_s)
        assert rs[0].hash_ids[:len(forked.hash_ids) - 1] == forked.hash_ids[:-1] and forked.pause
        resumed = min(r.arrival_s for r in sessions[parent] if r.arrival_s > rs[0].arrival_s)
        assert resumed > rs[-1].arrival_s  # the planner is back once its sub-agents are done
    assert not any(r.parent_session_id for sid, rs in sessions.items() if sid not in subs for r in rs)


def test_chat_has_short_system_prompts_think_time_pauses_and_abandoned_conversations():
    sessions = by_session(chat(400))
    assert len({rs[0].hash_ids[:2] for rs in sessions.values()}) == 3  # three system prompts, block 0 first
    closed = [rs for rs in sessions.values() if rs[-1].session_end]
    abandoned = [rs for rs in sessions.values() if not rs[-1].session_end]
    assert closed and len(abandoned) > len(closed)
    assert all(rs[-1].pause for rs in abandoned) and not any(rs[-1].pause for rs in closed)
    assert all(r.pause and not r.session_end for rs in sessions.values() for r in rs[:-1])
    gaps = [b.arrival_s - a.arrival_s for rs in sessions.values() for a, b in pairwise(rs)]
    assert 10 < sorted(gaps)[len(gaps) // 2] < 120


def test_tenants_have_their_own_preambles_skewed_popularity_and_mixed_session_lengths():
    sessions = by_session(tenants(200))
    count: dict[int, int] = defaultdict(int)
    for rs in sessions.values():
        count[rs[0].hash_ids[1]] += 1  # a tenant's preamble starts after block 0
    assert 4 <= len(count) <= 8 and max(count.values()) > 3 * min(count.values())
    lengths = [len(rs) for rs in sessions.values()]
    assert lengths.count(1) > 10 and max(lengths) > 10


def test_the_live_working_set_counts_the_distinct_blocks_of_the_sessions_in_progress():
    trace = [TraceRequest(0, 1, 1, (0, 1, 2), "a"), TraceRequest(1, 1, 1, (0, 3), "b"),
             TraceRequest(2, 1, 1, (0, 1, 4), "a", session_end=True), TraceRequest(3, 1, 1, (0, 5, 6, 7), "c"),
             TraceRequest(4, 1, 1, (0, 3, 8), "b", session_end=True)]
    # a (0,1,2) + b (3): 4; a moves to (0,1,4): 4; a is over, c (0,5,6,7) runs while b (3) is under way: 5;
    # c was a single request: b (0,3,8) alone, 3
    assert live_working_set(trace) == 5
    assert live_working_set(trace[:3]) == 4  # b's one request there is its last: it holds nothing after it


def test_a_sub_agents_parent_survives_dump_and_load_and_older_traces_still_load(tmp_path):
    trace = fanout(3)
    path = tmp_path / "f.jsonl"
    dump_trace(trace, path)
    def fields(t):
        return [(r.hash_ids, r.session_id, r.session_end, r.pause, r.parent_session_id) for r in t]

    assert fields(load_trace(path)) == fields(trace) and any(r.parent_session_id for r in trace)
    path.write_text(json.dumps({"timestamp": 0, "input_length": 9, "output_length": 1, "hash_ids": [1]}) + "\n")
    assert load_trace(path)[0].parent_session_id == ""
    path.write_text(json.dumps({"timestamp": 0, "input_length": 9, "output_length": 1, "hash_ids": [1],
                                "parent_session_id": 3}) + "\n")
    with pytest.raises(ValueError, match="parent_session_id must be a string"):
        load_trace(path)


def test_every_end_known_closes_the_abandoned_conversations_and_changes_nothing_else():
    trace = chat(200)
    told = with_every_end(trace)
    sessions, ends = by_session(trace), by_session(told)
    abandoned = sum(not rs[-1].session_end for rs in sessions.values())
    assert unsaid_ends(trace) == abandoned > 0 and unsaid_ends(told) == 0
    for key, rs in ends.items():
        assert rs[-1].session_end and not rs[-1].pause
        assert rs[:-1] == sessions[key][:-1]
        assert (rs[-1].arrival_s, rs[-1].hash_ids) == (sessions[key][-1].arrival_s, sessions[key][-1].hash_ids)
    assert unsaid_ends(coding(10)) == 0  # every task ends itself


def test_knowing_which_conversations_were_abandoned_is_worth_hits():
    trace = chat(300)
    cap = max(1, live_working_set(trace) // 2)
    hits = measure(trace, cap)
    line = every_end_known(trace, cap, hits, unsaid_ends(trace))
    told = float(line.split("session_duel ")[1].split("%")[0])
    assert told > hits["session_duel"]["1"] * 100  # the ends no client says are what the signals lack


def test_an_anonymous_client_sends_no_parent_either():
    trace = fanout(5)
    assert not any(r.parent_session_id for r in with_sessions(trace, 0.0))


def test_the_cli_writes_a_shape(tmp_path, capsys):
    out = tmp_path / "c.jsonl"
    assert main(["write", "--shape", "chat", "--out", str(out), "--sessions", "20", "--seed", "9"]) == 0
    assert load_trace(out)[0].session_id and "written to" in capsys.readouterr().out
    assert len(load_trace(out)) == len(chat(20, seed=9))
