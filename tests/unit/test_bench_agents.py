"""``kvmesh bench agents``' bookkeeping: the arms' order and an arm's runs pooled (the stack runs are the bench)."""

from app.bench.agents import Run, Sent, _ratio, abba, interval, optimum, pooled, ratio, row, workload
from app.bench.stats import RequestRecord


def test_the_arms_run_one_after_the_other_a_b_b_a_and_back():
    assert abba(["none", "full"], 1) == ["none", "full", "full", "none"]
    order = abba(["none", "full"], 2)
    assert order.count("none") == order.count("full") == 4
    # a load that drifts linearly through the runs weighs on both arms alike: their mean positions are equal
    assert sum(i for i, m in enumerate(order) if m == "none") == sum(i for i, m in enumerate(order) if m == "full")
    # three arms (the hints scenario's defaults arm): A B C C B A, each arm's mean position the same
    three = abba(["none", "lru", "full"], 2)
    assert three[:6] == ["none", "lru", "full", "full", "lru", "none"]
    assert len({sum(i for i, m in enumerate(three) if m == arm) for arm in ("none", "lru", "full")}) == 1


def _run(mode, ttfts, cached, prompt=64, prefetch=1):
    r = Run(mode, block_bytes=2**20, wall_s=10.0, prefetch={"loaded": prefetch}, placements={"moved": 1})
    ctx = tuple(range(100, 100 + prompt))
    r.sent.append(Sent(ctx, RequestRecord("a/0", ttft_s=9.0, prompt_tokens=prompt, cached_tokens=0), False))
    for i, (t, c) in enumerate(zip(ttfts, cached, strict=True)):
        r.sent.append(Sent(ctx, RequestRecord(f"a/{i + 1}", ttft_s=t, prompt_tokens=prompt, cached_tokens=c), True))
    return r


def test_an_arms_runs_are_pooled_and_each_runs_optimum_is_its_own():
    a, b = _run("x", [1.0, 2.0], [32, 32]), _run("x", [3.0], [64], prefetch=2)
    p = pooled([a, b])
    assert [s.record.key for s in p.sent] == ["a/0", "a/1", "a/2", "a/0", "a/1"]
    assert p.prefetch == {"loaded": 3} and p.placements == {"moved": 2} and p.wall_s == 20.0
    assert [x.ttft_s for x in p.resumed] == [1.0, 2.0, 3.0]
    out = row([a, b])
    assert out["runs"] == 2 and out["resumed steps"] == 3 and out["wall s"] == "10"
    assert out["cached share"] == f"{128 / 192:.1%}"
    # the optimum's unbounded cache serves every resumed step but its last token (the prompt repeats)
    assert optimum(a, 1024)[1:] == (2 * 63, 128)
    assert out["optimum (device / unbounded)"] == f"{189 / 192:.1%} / {189 / 192:.1%}"
    # each run's stream is its own: a prompt only an earlier run sent is no hit for the optimum either
    fresh = Run("x", block_bytes=2**20)
    fresh.sent.append(Sent(a.sent[0].prompt, RequestRecord("a/1", ttft_s=1.0, prompt_tokens=64, cached_tokens=0),
                           True))
    assert row([a, fresh])["optimum (device / unbounded)"] == f"{126 / 192:.1%} / {126 / 192:.1%}"


def test_the_workload_is_the_same_for_a_seed():
    assert workload(4, 3, seed=1) == workload(4, 3, seed=1)
    assert workload(4, 3, seed=1) != workload(4, 3, seed=2)


def test_the_ratio_of_the_arms_comes_with_an_interval_over_their_runs():
    # the second arm is twice as slow in every run: the interval is that ratio alone
    slow = [[_run("a", [1.0, 1.0, 1.0], [0, 0, 0]) for _ in range(3)],
            [_run("b", [2.0, 2.0, 2.0], [0, 0, 0]) for _ in range(3)]]
    assert ratio(slow, 50) == 2.0 and interval(slow, 50) == (2.0, 2.0)
    # runs that disagree widen it around the pooled ratio; one run an arm gives none
    mixed = [[_run("a", [1.0, 1.0], [0, 0]), _run("a", [3.0, 3.0], [0, 0])],
             [_run("b", [1.0, 1.0], [0, 0]), _run("b", [2.0, 2.0], [0, 0])]]
    lo, hi = interval(mixed, 50)
    assert lo < ratio(mixed, 50) < hi and lo <= 1 / 3 + 1e-9 and hi >= 2.0 - 1e-9
    assert interval([slow[0][:1], slow[1][:1]], 50) is None
    assert _ratio([slow[0][:1], slow[1][:1]], 50) == "2.00x"
    assert _ratio(slow, 50) == "2.00x (95% interval over runs 2.00-2.00x)"
