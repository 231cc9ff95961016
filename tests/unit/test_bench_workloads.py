"""Benchmark workloads: deterministic from the seed, shaped as documented."""

import json

import pytest

from app.bench import workloads as wl


def test_the_same_seed_gives_the_same_workload_and_another_seed_another():
    assert wl.multi_turn(4, 3, seed=1) == wl.multi_turn(4, 3, seed=1)
    assert wl.low_reuse(4, seed=1) == wl.low_reuse(4, seed=1)
    assert wl.low_reuse(4, seed=1) != wl.low_reuse(4, seed=2)


def test_multi_turn_conversations_have_their_turns_and_distinct_openers():
    w = wl.multi_turn(conversations=5, turns=3, max_tokens=7)
    convs = w.phases[0].conversations
    assert len(convs) == 5 and w.num_requests == 15
    assert all(len(c.turns) == 3 and all(t.max_tokens == 7 for t in c.turns) for c in convs)
    assert len({c.turns[0].user for c in convs}) == 5


def test_shared_system_prompt_is_one_prompt_for_every_request():
    convs = wl.shared_system(requests=6, system_words=50).phases[0].conversations
    assert len({c.system for c in convs}) == 1 and len({c.turns[0].user for c in convs}) == 6


def test_low_reuse_prompts_differ_from_the_start():
    systems = [c.system for c in wl.low_reuse(8).phases[0].conversations]
    assert len({s[:16] for s in systems}) == 8


def test_rag_asks_several_questions_per_document():
    convs = wl.rag(docs=2, questions=3, doc_words=40).phases[0].conversations
    assert len(convs) == 6 and len({c.system for c in convs}) == 2


def test_hot_switch_returns_to_the_first_set_with_new_questions():
    x, y, x2 = wl.hot_switch(set_size=2, questions=2, doc_words=40).phases
    assert [p.name for p in (x, y, x2)] == ["X", "Y", "X again"]

    def docs(phase):
        return {c.system for c in phase.conversations}

    assert docs(x) == docs(x2) and not docs(x) & docs(y)
    assert {c.turns[0].user for c in x.conversations} != {c.turns[0].user for c in x2.conversations}


def test_trace_replay_scales_lengths_and_time_and_equal_hash_ids_share_tokens(tmp_path):
    path = tmp_path / "t.jsonl"
    lines = [{"timestamp": 1000, "input_length": 1024, "output_length": 500, "hash_ids": [0, 1]},
             {"timestamp": 3000, "input_length": 1024, "output_length": 50, "hash_ids": [0, 2]},
             {"timestamp": 5000, "input_length": 600, "output_length": 10, "hash_ids": [0, 1]}]
    path.write_text("\n".join(json.dumps(x) for x in lines))
    convs = wl.trace(path, token_scale=0.1, time_scale=0.5, max_requests=3, max_tokens=16).phases[0].conversations
    a, b, c = (cv.turns[0] for cv in convs)
    assert [cv.arrival_s for cv in convs] == [0.0, 1.0, 2.0]
    assert len(a.prompt_ids) == 102
    assert a.prompt_ids[:51] == b.prompt_ids[:51] and a.prompt_ids[51:] != b.prompt_ids[51:]
    assert c.prompt_ids == a.prompt_ids[:60]
    assert (a.max_tokens, b.max_tokens, c.max_tokens) == (16, 5, 1) and a.ignore_eos


def test_poisson_arrivals_are_seeded_increasing_and_near_the_rate():
    base = wl.low_reuse(400, words=5)
    w = wl.with_poisson_arrivals(base, rate=4.0, seed=3)
    times = [c.arrival_s for c in w.phases[0].conversations]
    assert times == sorted(times) and times[0] == 0.0
    assert w == wl.with_poisson_arrivals(base, rate=4.0, seed=3)
    assert times[-1] / (len(times) - 1) == pytest.approx(0.25, rel=0.15)
    with pytest.raises(ValueError, match="rate"):
        wl.with_poisson_arrivals(base, rate=0)
