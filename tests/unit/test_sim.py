"""The trace simulator and trace synthesis."""

import json
from pathlib import Path

import pytest

from app.bench.trace import TraceRequest, load_trace, synthesize_prompt
from app.sim import BlockCache, simulate

TRACE = Path(__file__).resolve().parents[3] / "shared" / "data" / "traces" / "conversation_trace.jsonl"


def shared_prefix_trace(n: int = 200) -> list[TraceRequest]:
    """Every request shares block 0; each conversation (10 of them) shares its own growing history."""
    out = []
    for i in range(n):
        conv, turn = i % 10, i // 10
        ids = (0, *(1000 * (conv + 1) + k for k in range(turn + 1)))
        out.append(TraceRequest(i * 0.5, 512 * len(ids), 50, ids))
    return out


def test_equal_hash_ids_synthesize_equal_tokens():
    a = synthesize_prompt((0, 7, 9), 1536, 0.1, (100, 1000))
    b = synthesize_prompt((0, 7, 4), 1536, 0.1, (100, 1000))
    assert len(a) == 153 and a[:102] == b[:102] and a[102:] != b[102:]


def test_lru_cache_keeps_the_most_recent_blocks():
    c = BlockCache(3)
    c.touch((1, 2, 3), 0)
    c.touch((4,), 0)
    assert c.prefix((1,)) == 0 and c.prefix((2, 3, 4)) == 3


def test_cache_aware_with_the_pool_hits_more_than_round_robin():
    trace = shared_prefix_trace()
    rr = simulate(trace, 4, "round_robin", capacity_blocks=20)
    ca = simulate(trace, 4, "cache_aware", capacity_blocks=20)
    assert ca["hit_rate"] > rr["hit_rate"] and ca["ttft_mean_s"] < rr["ttft_mean_s"]


def test_unknown_policy_is_refused():
    with pytest.raises(ValueError, match="cache_aware"):
        simulate(shared_prefix_trace(10), 2, "best", 10)


@pytest.mark.skipif(not TRACE.exists(), reason="the shared conversation trace is not beside the repo")
def test_conversation_trace_cross_checks():
    trace = load_trace(TRACE)
    assert len(trace) == 12031
    one_lru = simulate(trace, 1, "round_robin", capacity_blocks=6000)
    infinite = simulate(trace, 1, "round_robin", capacity_blocks=10**9)
    assert round(one_lru["hit_rate"] * 100, 1) == 13.9
    assert round(infinite["hit_rate"] * 100, 1) == 36.6


def test_sim_cli_prints_json(tmp_path, capsys):
    from app.sim import main

    path = tmp_path / "t.jsonl"
    path.write_text("\n".join(json.dumps({"timestamp": r.arrival_s * 1000, "input_length": r.input_length,
                                          "output_length": 5, "hash_ids": list(r.hash_ids)})
                              for r in shared_prefix_trace(30)))
    assert main(["--trace", str(path), "--instances", "2", "--policy", "least_loaded", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert {"hit_rate", "ttft_mean_s", "ttft_p90_s", "slo_attainment"} <= set(out)


def test_sim_cli_runs_every_eviction_it_lists(tmp_path, capsys):
    from kvmesh.engine.eviction import POLICIES

    from app.sim import main

    path = tmp_path / "t.jsonl"
    path.write_text("\n".join(json.dumps({"timestamp": r.arrival_s * 1000, "input_length": r.input_length,
                                          "output_length": 5, "hash_ids": list(r.hash_ids)})
                              for r in shared_prefix_trace(40)))
    for name in POLICIES:
        assert main(["--trace", str(path), "--instances", "1", "--policy", "round_robin", "--capacity-blocks",
                     "8", "--pool-blocks", "0", "--eviction", name, "--json"]) == 0
        assert 0 <= json.loads(capsys.readouterr().out)["hit_rate"] <= 1


@pytest.mark.parametrize("policy", ["round_robin", "cache_aware"])
def test_the_simulated_fleets_miss_causes_add_up_and_the_optimum_bounds_the_hit(policy):
    r = simulate(shared_prefix_trace(), 4, policy, capacity_blocks=5, hits=True)["hits"]
    assert r["causes_add_up"] and sum(r["missed_by_cause"].values()) == r["missed_tokens"]
    assert r["missed_tokens"] == r["prompt_tokens"] - r["delivered_hit_tokens"]
    assert r["delivered_hit_tokens"] <= r["optimum_belady_hit_tokens"] <= r["optimum_infinite_hit_tokens"]
    assert {"never_computed", "evicted"} <= set(r["missed_by_cause"])
    if policy == "round_robin":
        assert r["missed_by_cause"]["routed_elsewhere"] > 0
