"""The cost model calibrated on each engine's measured speed: the estimator's fit, what a heartbeat carries,
and cache_aware pricing each candidate at its own speed."""

import random

import pytest
from kvmesh.contracts.engine import Speed
from kvmesh.contracts.messages import Heartbeat, InstanceLoad
from kvmesh.routing import CacheAware, Candidate, CostModel, SpeedEstimator
from kvmesh.routing.cost import local_share

from services.router.registry import Registry
from services.router.scheduling import Policies, to_candidates

CONFIGURED = CostModel(prefill_tok_per_s=240.0, prefill_overhead_s=0.03, fetch_gbps=10.0, block_bytes=10**6)


def feed(est: SpeedEstimator, steps: int, overhead: float, tok_per_s: float, sizes: tuple[int, int],
         noise: float = 0.05, seed: int = 0, outlier_every: int = 0, outlier_x: float = 1.0) -> None:
    rng = random.Random(seed)
    for i in range(steps):
        n = rng.randint(*sizes)
        t = (overhead + n / tok_per_s) * rng.uniform(1 - noise, 1 + noise)
        est.observe(n, t * (outlier_x if outlier_every and i % outlier_every == 0 else 1.0))


def close(actual: float, expected: float, rel: float = 0.05) -> bool:
    return actual == pytest.approx(expected, rel=rel)


def test_the_fit_converges_on_a_noisy_linear_series():
    est = SpeedEstimator()
    feed(est, 300, overhead=0.02, tok_per_s=500, sizes=(8, 512))
    fit = est.fit()
    assert close(fit.tok_per_s, 500) and fit.overhead_s == pytest.approx(0.02, abs=0.005)


def test_nothing_is_reported_before_a_step_was_measured_and_the_warmup_step_is_skipped():
    est = SpeedEstimator()
    assert est.report() == Speed()
    est.observe(100, 50.0)  # the first step: lazy init, kernel compilation
    est.observe(0, 0.01)    # no forward ran
    assert est.fit() is None and est.report() == Speed()
    est.observe(100, 0.22)
    assert est.report().prefill_tok_per_s and est.report().prefill_overhead_s is not None


@pytest.mark.parametrize("outlier_x", [30.0, 1 / 30])
def test_sporadic_outliers_are_left_out(outlier_x):
    est = SpeedEstimator()
    feed(est, 300, overhead=0.02, tok_per_s=500, sizes=(8, 512), outlier_every=5, outlier_x=outlier_x)
    fit = est.fit()
    assert close(fit.tok_per_s, 500) and fit.overhead_s == pytest.approx(0.02, abs=0.005)
    assert fit.samples < 128 * 0.85  # a fifth of the window was dropped


def test_a_lasting_slowdown_takes_over():
    est = SpeedEstimator()
    feed(est, 200, overhead=0.02, tok_per_s=500, sizes=(8, 512))
    feed(est, 150, overhead=0.08, tok_per_s=125, sizes=(8, 512), seed=1)  # 4x slower: past the outlier bound
    assert close(est.fit().tok_per_s, 125, rel=0.1)


def test_tiny_steps_refit_the_overhead_and_keep_the_speed():
    est = SpeedEstimator()
    feed(est, 200, overhead=0.02, tok_per_s=500, sizes=(8, 512))
    est.fit()
    feed(est, 200, overhead=0.05, tok_per_s=500, sizes=(1, 1), seed=1)  # one-token steps: the overhead shows
    fit = est.fit()
    assert close(fit.tok_per_s, 500, rel=0.1) and fit.overhead_s == pytest.approx(0.05, abs=0.005)


def test_one_long_step_sets_the_speed_not_the_overhead():
    est = SpeedEstimator(CONFIGURED, warmup_steps=0)
    est.observe(1000, 0.03 + 1000 / 600)
    fit = est.fit()
    assert close(fit.tok_per_s, 600, rel=0.02) and fit.overhead_s == pytest.approx(0.03, abs=0.005)


def test_from_load_overrides_what_the_instance_measured_and_keeps_the_rest():
    measured = CostModel.from_load(InstanceLoad.from_dict({"prefill_tok_per_s": 900.0, "prefill_overhead_s": 0.0,
                                    "kv_block_bytes": 4096, "running": 0}), CONFIGURED)
    assert measured == CostModel(900.0, 0.0, CONFIGURED.fetch_gbps, 4096, calibrated=True)
    assert CostModel.from_load(InstanceLoad(waiting=1), CONFIGURED) is None  # an old engine
    block_only = CostModel.from_load(InstanceLoad.from_dict({"kv_block_bytes": 4096}), CONFIGURED)
    assert block_only == CostModel(240.0, 0.03, CONFIGURED.fetch_gbps, 4096, calibrated=False)


@pytest.mark.parametrize("bad", [0, -5.0, float("nan"), float("inf"), "fast", None, True])
def test_from_load_ignores_a_speed_that_is_not_a_positive_number(bad):
    assert CostModel.from_load(InstanceLoad.from_dict({"prefill_tok_per_s": bad}), CONFIGURED) is None


def measured(tok_per_s: float) -> CostModel | None:
    return CostModel.from_load(InstanceLoad.from_dict({"prefill_tok_per_s": tok_per_s}), CONFIGURED)


def test_cache_aware_prefers_the_fast_instance_when_hits_are_equal():
    slow = Candidate("slow", local_blocks=10, cost=measured(200.0))
    fast = Candidate("fast", local_blocks=10, cost=measured(800.0))
    d = CacheAware(CONFIGURED).choose([slow, fast], prompt_tokens=1000, block_size=16)
    assert d.chosen.id == "fast" and d.scores["slow"] > d.scores["fast"]
    assert "fast=800" in d.reason and "slow=200" in d.reason


def test_cache_aware_takes_the_longer_prefix_when_the_speed_gap_does_not_outweigh_it():
    a = Candidate("a", local_blocks=50, cost=measured(400.0))
    b = Candidate("b", local_blocks=0, cost=measured(500.0))
    d = CacheAware(CONFIGURED).choose([a, b], prompt_tokens=1000, block_size=16)
    assert d.chosen.id == "a"  # 200 tokens at 400 tok/s beat 1000 at 500 tok/s


def test_the_queue_is_priced_at_the_instance_s_own_speed():
    slow = Candidate("slow", queued_tokens=1000, cost=measured(100.0))
    fast = Candidate("fast", queued_tokens=1000, cost=measured(1000.0))
    d = CacheAware(CONFIGURED).choose([slow, fast], prompt_tokens=100, block_size=16)
    assert d.scores["slow"] == pytest.approx(0.03 + 10.0 + 0.03 + 1.0)
    assert d.scores["fast"] == pytest.approx(0.03 + 1.0 + 0.03 + 0.1)


def test_the_reason_marks_a_candidate_priced_at_the_configured_speed():
    d = CacheAware(CONFIGURED).choose([Candidate("old")], prompt_tokens=100, block_size=16)
    assert d.reason.endswith("prefill tok/s: old=240 (configured)")


def beat(iid: str, **load: float) -> Heartbeat:
    return Heartbeat(instance_id=iid, role="prefill", grpc_address="127.0.0.1:1", transfer_address="", ts=0.0,
                     load=InstanceLoad.from_dict({"free_blocks": 100, **load}), model="fp", block_size=16)


def test_the_router_prices_each_instance_from_its_heartbeat_and_an_old_one_at_the_configured_speed():
    reg = Registry(timeout_s=5, block_size=16, fingerprint="fp")
    reg.observe(beat("measured", prefill_tok_per_s=2000.0, prefill_overhead_s=0.01, kv_block_bytes=2048))
    reg.observe(beat("old"))
    cands = {c.id: c for c in to_candidates(reg.alive(), {}, CONFIGURED)}
    assert cands["measured"].cost == CostModel(2000.0, 0.01, CONFIGURED.fetch_gbps, 2048, calibrated=True)
    assert cands["old"].cost is None
    chosen, decision = Policies("cache_aware", CONFIGURED, 0.0).choose(None, reg.alive(), {}, 500, 16, 0)
    assert chosen.id == "measured" and "old=240 (configured)" in decision.reason


def test_an_instance_decoding_streams_under_an_itl_target_is_priced_at_its_prompts_share_of_the_steps():
    """Role both: a prompt there gets what each step leaves beside the streams' rows within the ITL target
    (``local_share`` of the decode step it reports), so its estimated TTFT, which admission holds to the TTFT
    target, is that much longer; an idle instance, or a request without an ITL target, is priced as before."""
    reg = Registry(timeout_s=5, block_size=16, fingerprint="fp")
    reg.observe(beat("busy", running=4, decode_step_s=0.03, prefill_tok_per_s=400.0, prefill_overhead_s=0.0))
    reg.observe(beat("idle", decode_step_s=0.03, prefill_tok_per_s=400.0, prefill_overhead_s=0.0))
    share = local_share(0.03, 0.15)
    cands = {c.id: c for c in to_candidates(reg.alive(), {}, CONFIGURED, itl_s=0.15)}
    assert cands["busy"].share == pytest.approx(share) and share < 1 and cands["idle"].share == 1.0
    assert all(c.share == 1.0 for c in to_candidates(reg.alive(), {}, CONFIGURED))
    reg.observe(beat("vllm", running=4, prefill_tok_per_s=400.0))  # no decode step reported: no ITL cap there
    assert {c.id: c.share for c in to_candidates(reg.alive(), {}, CONFIGURED, itl_s=0.15)}["vllm"] == 1.0
    scores = CacheAware(CONFIGURED).choose(list(cands.values()), prompt_tokens=1500, block_size=16).scores
    # (and, running streams, after the rest of the decode step it is in: half a step on average)
    assert scores["busy"] == pytest.approx(1500 / 400 / share + 0.03 / 2)
    assert scores["idle"] == pytest.approx(1500 / 400)
    # admission by the TTFT target uses the same estimate: 3.75 s fits 4.5 s idle, not beside the streams
    only_busy = [c for c in to_candidates(reg.alive(), {}, CONFIGURED, itl_s=0.15) if c.id == "busy"]
    assert CacheAware(CONFIGURED).choose(only_busy, 1500, 16, ttft_s=4.5).chosen is None
    assert CacheAware(CONFIGURED).choose([cands["idle"]], 1500, 16, ttft_s=4.5).chosen is not None


def test_a_prompt_waits_for_the_rest_of_the_decode_step_an_instance_is_in():
    """Two instances alike but for the streams one decodes (a 60 ms step): a new prompt starts there only after
    the step in progress (30 ms on average), so it goes to the idle one; unless the busy one holds enough of the
    prompt to save more than that."""
    reg = Registry(timeout_s=5, block_size=16, fingerprint="fp")
    reg.observe(beat("a-busy", running=3, decode_step_s=0.06, prefill_tok_per_s=1000.0, prefill_overhead_s=0.0))
    reg.observe(beat("b-idle", decode_step_s=0.06, prefill_tok_per_s=1000.0, prefill_overhead_s=0.0))
    cands = to_candidates(reg.alive(), {}, CONFIGURED)
    assert {c.id: c.step_left_s for c in cands} == {"a-busy": 0.03, "b-idle": 0.0}
    assert CacheAware(CONFIGURED).choose(cands, prompt_tokens=200, block_size=16).chosen.id == "b-idle"
    held = to_candidates(reg.alive(), {"a-busy": 4}, CONFIGURED)  # 64 tokens held: 64 ms of prefill saved
    assert CacheAware(CONFIGURED).choose(held, prompt_tokens=200, block_size=16).chosen.id == "a-busy"
