"""``kvmesh bench prefill-order``'s workload: the seeded open-loop stream both arms replay, and its arguments."""

from __future__ import annotations

import itertools

import pytest

from app.bench import prefill_order as bench


def test_the_stream_is_seeded_half_turns_half_cold_prompts_in_arrival_order():
    a = bench.schedule(400, 2.0, seed=3, sessions=8)
    assert a == bench.schedule(400, 2.0, seed=3, sessions=8) != bench.schedule(400, 2.0, seed=4, sessions=8)
    assert all(x.at < y.at for x, y in itertools.pairwise(a))
    turns = [x for x in a if x.kind == "turn"]
    assert 0.4 < len(turns) / len(a) < 0.6
    assert {x.session for x in turns} == set(range(8)) and all(len(x.added) == bench.TURN_TOKENS for x in turns)
    colds = [x for x in a if x.kind == "cold"]
    assert all(x.session == -1 and len(x.added) == bench.COLD_TOKENS for x in colds)
    assert len({x.added for x in colds}) == len(colds)  # never seen before: no two alike
    assert 150 < a[-1].at < 250  # 400 arrivals at 2 a second


@pytest.mark.parametrize("argv", [["--requests", "0"], ["--load", "0"], ["--load", "3"], ["--rounds", "0"]])
def test_bad_arguments_stop_with_a_usage_error(argv):
    with pytest.raises(SystemExit) as e:
        bench.main([*argv, "--no-write"])
    assert e.value.code == 2
