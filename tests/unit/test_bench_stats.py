"""Serving metrics: quantiles, SLO goodput, cache ratio."""

import math

import pytest

from app.bench.stats import SLO, RequestRecord, cached_ratio, goodput, percentile, quantiles, summarize


def rec(key="c/0", ttft=0.1, e2e=1.0, tokens=10, itl=(), **kw) -> RequestRecord:
    return RequestRecord(key, ttft_s=ttft, e2e_s=e2e, output_tokens=tokens, itl_s=list(itl), **kw)


def test_percentile_interpolates_between_closest_ranks_like_numpy():
    xs = [15, 20, 35, 40, 50]
    assert percentile(xs, 0) == 15 and percentile(xs, 100) == 50
    assert percentile(xs, 50) == 35
    assert percentile(xs, 40) == pytest.approx(29.0)   # numpy.percentile(xs, 40)
    assert percentile(xs, 90) == pytest.approx(46.0)   # numpy.percentile(xs, 90)
    assert percentile(list(range(1, 101)), 99) == pytest.approx(99.01)


def test_percentile_ignores_input_order_and_handles_one_and_no_values():
    assert percentile([3, 1, 2], 50) == 2
    assert percentile([7.5], 99) == 7.5
    assert math.isnan(percentile([], 50))


def test_percentile_is_numpys_linear_method_and_the_old_mesh_definition():
    import statistics

    import numpy as np

    from app.bench.stats import PERCENTILE_METHOD

    xs = [0.31, 0.02, 0.77, 0.5, 0.18, 0.9, 0.45]
    assert PERCENTILE_METHOD == "linear"
    for q in (1, 25, 50, 90, 99):
        assert percentile(xs, q) == pytest.approx(np.percentile(xs, q, method="linear"))
        assert percentile(xs, q) == pytest.approx(statistics.quantiles(xs, n=100, method="inclusive")[q - 1])


def test_percentile_takes_any_iterable_and_returns_a_plain_float():
    p = percentile((x for x in [4.0, 1.0, 3.0, 2.0]), 50)
    assert p == 2.5 and type(p) is float


def test_quantiles_of_no_values_are_nan_with_count_zero():
    q = quantiles([])
    assert q["count"] == 0 and all(math.isnan(q[k]) for k in ("p50", "p90", "p99", "mean", "max"))


def test_percentile_outside_0_to_100_is_refused():
    with pytest.raises(ValueError, match="percentile"):
        percentile([1, 2], 101)


def test_quantiles_report_p50_p90_p99_mean_max_and_count():
    q = quantiles([1.0, 2.0, 3.0, 4.0])
    assert q["p50"] == 2.5 and q["mean"] == 2.5 and q["max"] == 4.0 and q["count"] == 4
    assert q["p90"] == pytest.approx(3.7) and q["p99"] == pytest.approx(3.97)


def test_tpot_is_the_mean_gap_after_the_first_token():
    assert rec(ttft=0.2, e2e=1.1, tokens=10).tpot_s == pytest.approx(0.1)
    assert rec(tokens=1).tpot_s is None


def test_slo_needs_success_ttft_and_mean_itl_within_bounds():
    slo = SLO(ttft_s=0.5, itl_s=0.1)
    assert slo.met_by(rec(ttft=0.4, e2e=1.3, tokens=10))          # tpot 0.1
    assert not slo.met_by(rec(ttft=0.6, e2e=1.0, tokens=10))      # TTFT too slow
    assert not slo.met_by(rec(ttft=0.4, e2e=2.2, tokens=10))      # tpot 0.2
    assert slo.met_by(rec(ttft=0.4, e2e=0.4, tokens=1))           # one token: TTFT alone
    assert not slo.met_by(rec(error="HTTP 503"))
    assert not slo.met_by(rec(timed_out=True))


def test_goodput_counts_only_requests_within_the_slo_per_second():
    slo = SLO(ttft_s=0.5, itl_s=0.1)
    records = [rec(ttft=0.1, e2e=0.5, tokens=5), rec(ttft=0.9), rec(error="boom"), rec(ttft=0.2, e2e=0.2, tokens=1)]
    assert goodput(records, slo, duration_s=4.0) == pytest.approx(0.5)
    assert goodput(records, slo, duration_s=0) == 0.0


def test_cached_ratio_uses_requests_that_reported_usage():
    records = [rec(prompt_tokens=100, cached_tokens=80), rec(prompt_tokens=100, cached_tokens=0),
               rec(prompt_tokens=None, cached_tokens=None), rec(error="x", prompt_tokens=50, cached_tokens=50)]
    assert cached_ratio(records) == pytest.approx(0.4)
    assert math.isnan(cached_ratio([rec()]))


def test_summary_counts_errors_and_timeouts_apart_and_pools_every_gap():
    records = [rec(itl=(0.1, 0.2), tokens=3), rec(itl=(0.3,), tokens=2), rec(error="HTTP 429: busy"),
               rec(error="no answer", timed_out=True)]
    s = summarize(records, duration_s=2.0, slo=SLO())
    assert (s["requests"], s["ok"], s["errors"], s["timeouts"]) == (4, 2, 1, 1)
    assert s["itl_s"]["count"] == 3 and s["itl_s"]["p50"] == pytest.approx(0.2)
    assert s["output_tokens"] == 5 and s["throughput_tok_s"] == 2.5 and s["throughput_req_s"] == 1.0
