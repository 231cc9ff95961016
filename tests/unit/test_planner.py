"""The planner's decision (``kvmesh.planning``): each case is a fleet, a traffic and targets, and the pool sizes
the planner must answer, with the hysteresis that keeps it from flapping. No processes, no clock."""

from __future__ import annotations

import dataclasses
import math

import pytest
from kvmesh.contracts.ids import Role
from kvmesh.contracts.messages import InstanceLoad as HeartbeatLoad
from kvmesh.planning import (
    InstanceLoad,
    Observation,
    PlannerConfig,
    PlannerState,
    Speed,
    Targets,
    Traffic,
    decode_need,
    forecast,
    plan,
    prefill_need,
)
from kvmesh.planning.capacity import burst_prefill_need, erlang_c, queue_need, streams_per_instance, ttft_miss

# one instance: 1,000 prefill tok/s + 10 ms; a decode step 10 ms + 1 ms per stream; 100k tokens of KV
SPEED = Speed(prefill_tok_per_s=1000.0, prefill_overhead_s=0.01, step_base_s=0.01, step_per_stream_s=0.001,
              kv_tokens=100_000.0)
TARGETS = Targets(ttft_s=2.0, itl_s=0.05)
CONFIG = PlannerConfig(speed=SPEED, down_delay_s=60, cooldown_s=30, startup_s=30, window_s=15)


def pd_fleet(prefill: int, decode: int, **load: float) -> list[InstanceLoad]:
    return ([InstanceLoad(f"p{k}", Role.PREFILL, **load) for k in range(prefill)]
            + [InstanceLoad(f"d{k}", Role.DECODE) for k in range(decode)])


def traffic(rate: float, prompt: float = 500.0, output: float = 100.0, hit: float = 0.0) -> Traffic:
    return Traffic(rate, prompt, output, hit)


def test_erlang_c_is_the_textbook_value() -> None:
    assert erlang_c(1, 0.5) == pytest.approx(0.5)  # M/M/1: the chance to wait is the utilisation
    assert erlang_c(2, 1.0) == pytest.approx(1 / 3)
    assert erlang_c(3, 3.0) == 1.0


def test_prefill_pool_grows_with_the_rate_and_shrinks_with_the_hit_rate() -> None:
    # 500 tokens at 1,000 tok/s = 0.51 s a request: 4 req/s is 2.04 instances of work, so at least 3
    assert prefill_need(traffic(4.0), SPEED, TARGETS, 0.6).instances == 3
    assert prefill_need(traffic(8.0), SPEED, TARGETS, 0.6).instances == 5
    # half the prompt from cache halves the work
    assert prefill_need(traffic(8.0, hit=0.5), SPEED, TARGETS, 0.6).instances == 3


def test_a_backlog_the_model_did_not_expect_adds_prefill_instances() -> None:
    calm = prefill_need(traffic(1.0), SPEED, TARGETS, 0.6).instances
    # 60,000 queued tokens cleared within the 60 s new instances take: 1,000 tok/s more work, one more instance
    # at least; cleared within 10 s, six more
    assert prefill_need(traffic(1.0), SPEED, TARGETS, 0.6, backlog_tokens=60_000).instances >= calm + 1
    assert prefill_need(traffic(1.0), SPEED, TARGETS, 0.6, backlog_tokens=60_000, drain_s=10).instances >= calm + 6


def test_a_fluid_queue_needs_the_instances_that_hold_its_growth_within_the_wait_budget() -> None:
    # 4 instance-s/s of work for 15 s, a wait of 0.5 s allowed: (0 + 4 x 15) / (15 + 0.5) = 3.9 -> 4
    assert queue_need(4.0, backlog_s=0.0, horizon_s=15.0, budget_s=0.5) == 4
    # 30 instance-s queued on top: (30 + 60) / 15.5 = 5.8 -> 6
    assert queue_need(4.0, backlog_s=30.0, horizon_s=15.0, budget_s=0.5) == 6


def test_a_burst_whose_queue_fits_the_wait_budget_adds_no_prefill_instance() -> None:
    h = CONFIG.headroom
    calm = prefill_need(traffic(4.0), SPEED, TARGETS, h, miss=0.01).instances
    # one window at twice the sustained rate: 4 instances serve 8 req/s x 0.51 s for 15 s with 0.1 s of queue each
    assert burst_prefill_need(traffic(4.0), 8.0, SPEED, TARGETS, h, miss=0.01).instances == calm
    # the steady state at the burst's rate would have asked for more
    assert prefill_need(traffic(8.0), SPEED, TARGETS, h, miss=0.01).instances > calm


def test_a_rise_that_lasts_the_start_up_time_sizes_prefill_for_its_rate() -> None:
    config = dataclasses.replace(CONFIG, startup_s=60)  # four windows make a rate sustained

    def prefill(history: list[float], now: float) -> int:
        out = plan(Observation(0.0, pd_fleet(1, 1), traffic(now), TARGETS, rates=history), config, PlannerState())
        return out.target(Role.PREFILL) or 0

    calm, burst, sustained = prefill([4.0] * 4, 4.0), prefill([4.0] * 4, 8.0), prefill([8.0] * 4, 8.0)
    assert calm < burst < sustained  # the burst lifts the four windows' level a quarter of the way
    assert sustained == prefill_need(traffic(8.0), SPEED, TARGETS, config.headroom, miss=config.ttft_miss).instances


def test_the_backlog_the_instances_report_adds_prefill_by_the_queue_it_leaves() -> None:
    h = CONFIG.headroom
    # 90,000 tokens queued = 90 instance-s: with 4 req/s x 0.51 s for 15 s, (90 + 30.6) / (15 + 0.39) -> 8
    need = burst_prefill_need(traffic(4.0), 4.0, SPEED, TARGETS, h, backlog_tokens=90_000, miss=0.01)
    assert need.instances == 8 and "backlog 90.0 instance-s" in need.reason


def test_a_prompt_too_long_for_the_target_is_sized_to_keep_up_and_says_so() -> None:
    need = prefill_need(traffic(1.0, prompt=5000.0), SPEED, TARGETS, 0.6)
    assert not need.feasible and "exceeds" in need.reason and need.instances == math.ceil(5.01 / 0.9)


def test_decode_batch_is_bounded_by_the_itl_target_and_by_kv() -> None:
    # step 10 ms + 1 ms a stream within 0.85 x 50 ms: 32 streams
    assert streams_per_instance(traffic(1.0), SPEED, TARGETS) == 32
    # 10,000-token contexts: only 10 fit 100k tokens of KV
    assert streams_per_instance(traffic(1.0, prompt=9900.0), SPEED, TARGETS) == 10


def test_decode_pool_holds_the_streams_littles_law_keeps_alive() -> None:
    # 10 req/s x 100 tokens x 42 ms a step = 42 streams alive; 32 an instance: 2
    assert decode_need(traffic(10.0), SPEED, TARGETS).instances == 2
    # more running now than the model expects (long outputs in flight): sized for those
    assert decode_need(traffic(10.0), SPEED, TARGETS, running=100).instances == 4


def test_an_itl_target_no_batch_meets_is_infeasible() -> None:
    need = decode_need(traffic(1.0), SPEED, Targets(ttft_s=2.0, itl_s=0.01))
    assert not need.feasible and "does not fit" in need.reason


def test_forecast_extends_a_rising_trend_and_never_predicts_a_fall() -> None:
    assert forecast([1.0, 2.0, 3.0, 4.0, 5.0, 6.0], ahead=1) == pytest.approx(7.0)
    assert forecast([3.0, 2.0, 1.0], ahead=2) == 1.5  # the level: the mean of the last two windows
    assert forecast([2.0], ahead=5) == 2.0


def test_forecast_does_not_extrapolate_a_rise_past_what_the_windows_show() -> None:
    # the line says 5 two windows on; the windows rose by 1.5 to a level of 2.5: at most 4
    assert forecast([1.0, 2.0, 3.0], ahead=2) == pytest.approx(4.0)
    # a ramp that has ended: the line through it would still climb (to 8.3); the level and its rise cap it
    assert forecast([4.0, 5.0, 6.0, 6.0, 6.0, 6.0], ahead=5) == pytest.approx(6.0 + 2.0)


def test_plan_scales_a_pd_fleet_out_at_once_and_says_why() -> None:
    obs = Observation(0.0, pd_fleet(1, 1), traffic(8.0), TARGETS)
    out = plan(obs, CONFIG, PlannerState())
    prefill = next(p for p in out.pools if p.role is Role.PREFILL)
    # the mean TTFT would do with 5 (below); the queue's tail needs 6 for <= 1% pushed past the target
    assert prefill.action == "out" and prefill.target == 6 and "TTFT" in prefill.reason
    assert "pushed past 2.00s by the queue" in prefill.reason
    assert out.target(Role.DECODE) == 2
    mean_only = plan(obs, dataclasses.replace(CONFIG, ttft_miss=0.0), PlannerState())
    assert mean_only.target(Role.PREFILL) == 5


def test_a_rising_rate_is_planned_for_the_start_up_time_ahead() -> None:
    flat = plan(Observation(0.0, pd_fleet(1, 1), traffic(4.0), TARGETS, rates=[4.0, 4.0, 4.0]), CONFIG,
                PlannerState())
    rising = plan(Observation(0.0, pd_fleet(1, 1), traffic(4.0), TARGETS, rates=[1.0, 2.0, 3.0]), CONFIG,
                  PlannerState())
    assert rising.target(Role.PREFILL) > flat.target(Role.PREFILL)  # type: ignore[operator]
    assert "forecast" in rising.describe()


def test_scale_in_waits_for_the_delay_then_drops_to_the_peak_need_of_the_wait() -> None:
    fleet, state = pd_fleet(6, 2), PlannerState()
    steps = [(0.0, 1.0), (30.0, 2.0), (59.0, 1.0), (61.0, 1.0)]
    targets = []
    for now, rate in steps:
        out = plan(Observation(now, fleet, traffic(rate), TARGETS), CONFIG, state)
        state = out.state
        targets.append(out.target(Role.PREFILL))
    assert targets[:3] == [6, 6, 6]  # fewer would do, but not for 60 s yet
    tighter = CONFIG.down_headroom / CONFIG.headroom
    assert targets[3] == prefill_need(traffic(2.0), SPEED, TARGETS, CONFIG.down_headroom, miss=CONFIG.ttft_miss,
                                      tail_s=TARGETS.ttft_s * tighter).instances < 6


def test_a_dip_shorter_than_the_delay_does_not_scale_in() -> None:
    fleet, state = pd_fleet(4, 1), PlannerState()
    for now, rate in [(0.0, 0.1), (40.0, 4.0), (70.0, 0.1), (100.0, 0.1)]:
        out = plan(Observation(now, fleet, traffic(rate), TARGETS), CONFIG, state)
        state = out.state
        assert out.target(Role.PREFILL) == 4, out.describe()


def test_no_scale_in_within_the_cooldown_after_a_scale_out() -> None:
    config = PlannerConfig(speed=SPEED, down_delay_s=0, cooldown_s=30)
    state = plan(Observation(0.0, pd_fleet(1, 1), traffic(8.0), TARGETS), config, PlannerState()).state
    held = plan(Observation(10.0, pd_fleet(6, 1), traffic(0.5), TARGETS), config, state)
    assert held.target(Role.PREFILL) == 6 and "more" in held.describe()
    later = plan(Observation(31.0, pd_fleet(6, 1), traffic(0.5), TARGETS), config, held.state)
    assert later.target(Role.PREFILL) < 6 and "scale in" in later.describe()


def test_kv_pressure_grows_a_decode_pool_the_model_thinks_is_enough() -> None:
    fleet = pd_fleet(1, 0) + [InstanceLoad(f"d{k}", Role.DECODE, kv_used=0.95) for k in range(2)]
    out = plan(Observation(0.0, fleet, traffic(0.5), TARGETS), CONFIG, PlannerState())
    assert out.target(Role.DECODE) == 3 and "KV 95% used" in out.describe()


def test_pool_bounds_clamp_the_target() -> None:
    config = PlannerConfig(speed=SPEED, max_instances={Role.PREFILL: 3, Role.DECODE: 8},
                           min_instances={Role.PREFILL: 1, Role.DECODE: 4})
    out = plan(Observation(0.0, pd_fleet(1, 1), traffic(20.0), TARGETS), config, PlannerState())
    assert decode_need(traffic(20.0), SPEED, TARGETS).instances == 3
    assert out.target(Role.PREFILL) == 3 and out.target(Role.DECODE) == 4


def test_a_both_pool_is_sized_for_prefill_and_decode_sharing_each_instance() -> None:
    fleet = [InstanceLoad("b0", Role.BOTH)]
    out = plan(Observation(0.0, fleet, traffic(4.0), TARGETS), CONFIG, PlannerState())
    pd = plan(Observation(0.0, pd_fleet(1, 1), traffic(4.0), TARGETS), CONFIG, PlannerState())
    both, prefill, decode = out.target(Role.BOTH), pd.target(Role.PREFILL), pd.target(Role.DECODE)
    assert both is not None and prefill is not None and decode is not None
    assert prefill <= both <= prefill + decode


def test_starting_instances_count_so_a_second_plan_does_not_add_more() -> None:
    first = plan(Observation(0.0, pd_fleet(1, 1), traffic(8.0), TARGETS), CONFIG, PlannerState())
    second = plan(Observation(5.0, pd_fleet(1, 1), traffic(8.0), TARGETS), CONFIG, first.state,
                  current={Role.PREFILL: 6, Role.DECODE: 2})
    assert [p.action for p in second.pools] == ["hold", "hold"]


def test_measured_speed_replaces_the_configured_one() -> None:
    fleet = [InstanceLoad("p0", Role.PREFILL, prefill_tok_per_s=4000.0, prefill_overhead_s=0.02),
             InstanceLoad("d0", Role.DECODE, running=9, decode_step_s=2 * SPEED.step_s(10))]
    measured = SPEED.measured(fleet)
    assert measured.prefill_tok_per_s == 4000.0 and measured.prefill_overhead_s == 0.02
    assert measured.step_s(10) == pytest.approx(2 * SPEED.step_s(10))


def test_a_heartbeat_load_is_read_once_into_a_typed_record() -> None:
    beat = {"running": 3, "waiting": 1, "free_blocks": 25, "total_blocks": 100, "waiting_tokens": 640,
            "prefill_tok_per_s": 900.0, "decode_step_s": float("nan"), "bogus": "x"}
    load = InstanceLoad.from_beat("i1", "decode", HeartbeatLoad.from_dict(beat), block_size=16)
    assert load.role is Role.DECODE and load.kv_used == 0.75 and load.kv_tokens == 1600
    assert load.waiting_tokens == 640 and load.prefill_tok_per_s == 900.0 and load.decode_step_s == 0.0


def test_traffic_of_a_window() -> None:
    t = Traffic.of(10.0, [100, 300], [10, 30], hit_tokens=100)
    assert t.rate == 0.2 and t.prompt_tokens == 200 and t.output_tokens == 20 and t.hit_rate == 0.25
    assert t.prompt_quantiles == (75.0, 225.0)  # the computed lengths (a quarter cached), in order
    many = Traffic.of(10.0, list(range(1, 1001)), [1] * 1000)
    assert len(many.prompt_quantiles) == 50 and many.prompt_quantiles[0] == 11 and many.prompt_quantiles[-1] == 991
    assert Traffic.of(10.0, [], []).rate == 0.0


def test_a_measured_ttft_past_the_goal_grows_prefill_whatever_the_model_says() -> None:
    calm = traffic(0.5, prompt=50.0)  # the model: one instance, a TTFT of some 60 ms
    slipping = plan(Observation(0.0, pd_fleet(1, 1), calm, TARGETS, ttft_s=1.5), CONFIG, PlannerState())
    assert slipping.target(Role.PREFILL) == 2 and "measured TTFT 1.50s" in slipping.describe()
    assert slipping.target(Role.DECODE) == 1  # TTFT is not decode's to fix
    fine = plan(Observation(0.0, pd_fleet(1, 1), calm, TARGETS, ttft_s=0.5), CONFIG, PlannerState())
    assert fine.target(Role.PREFILL) == 1


def test_the_measured_ttft_grows_a_pool_at_most_twofold_a_plan() -> None:
    out = plan(Observation(0.0, pd_fleet(2, 1), traffic(0.5, prompt=50.0), TARGETS, ttft_s=60.0), CONFIG,
               PlannerState())
    assert out.target(Role.PREFILL) == 4


def test_the_ttft_tail_of_heavy_tailed_prompts_needs_more_prefill_than_their_mean() -> None:
    # the same mean prompt (500 tokens) and rate: all alike, or most short and a few long ones
    even = Traffic(4.0, 500.0, 100.0, prompt_sq_tokens=500.0**2, prompt_quantiles=(500.0,) * 10)
    tail = (100.0,) * 8 + (1200.0, 2800.0)
    heavy = Traffic(4.0, 500.0, 100.0, prompt_sq_tokens=sum(x * x for x in tail) / 10, prompt_quantiles=tail)
    assert ttft_miss(4, heavy, SPEED, TARGETS.ttft_s) > ttft_miss(4, even, SPEED, TARGETS.ttft_s)
    mean_only = prefill_need(heavy, SPEED, TARGETS, 0.6).instances
    assert prefill_need(heavy, SPEED, TARGETS, 0.6, miss=0.01).instances > mean_only
    assert prefill_need(even, SPEED, TARGETS, 0.6, miss=0.01).instances < \
        prefill_need(heavy, SPEED, TARGETS, 0.6, miss=0.01).instances


def test_a_prompt_whose_prefill_alone_misses_is_not_counted_against_the_pool() -> None:
    # a tenth of the prompts take 3 s alone against a 2 s target: no pool size helps them, and they do not ask
    # for one (the pool stays finite and small)
    sizes = (200.0,) * 9 + (3000.0,)
    t = Traffic(1.0, 480.0, 100.0, prompt_sq_tokens=sum(x * x for x in sizes) / 10, prompt_quantiles=sizes)
    assert ttft_miss(50, t, SPEED, TARGETS.ttft_s) == pytest.approx(0.0, abs=1e-9)
    need = prefill_need(t, SPEED, TARGETS, 0.6, miss=0.01)
    assert need.feasible and need.instances <= 4


def test_an_overloaded_pool_misses_every_prompt_that_could_have_made_it() -> None:
    assert ttft_miss(1, traffic(4.0), SPEED, TARGETS.ttft_s) == pytest.approx(0.98)  # 49 of 50 exponential


def test_a_decode_pool_scales_in_when_one_fewer_holds_the_streams_at_the_same_itl_share() -> None:
    # 15 req/s x 100 tokens: 63 streams at the 32-stream batch (42 ms of 0.85 x 50 ms): 2 instances; the band is
    # one instance fewer meeting that share for the delay, not a tighter ITL share (23 streams: 3 instances)
    assert decode_need(traffic(15.0), SPEED, TARGETS).instances == 2
    assert decode_need(traffic(15.0), SPEED, TARGETS, 0.85 * CONFIG.down_headroom / CONFIG.headroom).instances == 3
    fleet, state = pd_fleet(8, 3), PlannerState()
    targets = []
    for now in (0.0, 30.0, 61.0):
        out = plan(Observation(now, fleet, traffic(15.0), TARGETS), CONFIG, state)
        state = out.state
        targets.append(out.target(Role.DECODE))
    assert targets == [3, 3, 2]
