"""Latency targets: the SLO value and its p99 accounting, and the step budget by SLO (``engine/slo.py``) on its own,
against simulated step costs: the streams' ITL targets cap a step, prompts go earliest deadline first, and a
prompt near its deadline grows the budget as far as the streams can lend."""

import math

import pytest
from kvmesh.contracts.names import PrefillOrder
from kvmesh.contracts.sampling import SamplingParams
from kvmesh.contracts.slo import SLO, late_gaps_allowed, slo_from_proto, slo_to_proto
from kvmesh.engine.sequence import Sequence, Status
from kvmesh.engine.slo import (
    HEADROOM,
    MIN_CHUNK,
    RESERVE_GAPS,
    URGENT,
    StepCost,
    finish_alone,
    plan_step,
    tokens_ahead,
)

from .helpers import req

COST = StepCost(decode_s=0.03, token_s=1 / 370)  # four streams decoding, ~370 prompt tokens a second


def stream(itl: float = 0.15, max_tokens: int = 256, late: int = 0) -> Sequence:
    s = Sequence("s", [1, 2, 3], SamplingParams(max_tokens=max_tokens, ignore_eos=True))
    s.output_token_ids, s.num_computed_tokens = [7], 3  # decoding: one token to compute
    s.itl_target, s.late_gaps = itl, late
    return s


def prompt(rid: str, tokens: int, deadline: float | None) -> Sequence:
    p = Sequence(rid, list(range(tokens)), SamplingParams(max_tokens=32))
    p.ttft_deadline = deadline
    return p


def test_the_p99_lets_one_gap_in_a_hundred_run_late():
    assert [late_gaps_allowed(n) for n in (0, 1, 99, 100, 199, 200, 255)] == [0, 0, 0, 1, 1, 2, 2]


def test_a_target_out_of_range_is_refused_naming_it():
    for bad in (-1.0, math.nan, math.inf, 4000.0, True):
        with pytest.raises(ValueError, match="slo itl_s must be a number of seconds"):
            SLO(itl_s=bad)
    assert SLO(ttft_s=6).or_else(SLO(2, 0.1)) == SLO(6, 0.1)
    assert slo_from_proto(slo_to_proto(SLO(6, 0.15))) == SLO(6, 0.15) and not SLO()


def test_streams_with_an_itl_target_cap_the_step_within_it():
    plan = plan_step(0.0, [stream(0.15), stream(0.3)], [prompt("p", 1500, None)], COST, 1024, best_effort=None)
    assert COST.step_s(plan.tokens) <= HEADROOM * 0.15 < COST.step_s(plan.tokens + 1)
    assert not plan.burst


def test_streams_without_a_target_keep_the_best_effort_cap():
    no_target = stream(0.0)
    assert plan_step(0.0, [no_target], [prompt("p", 1500, None)], COST, 1024, best_effort=40).tokens == 40
    # with both kinds running, the tighter cap holds
    assert plan_step(0.0, [no_target, stream(0.15)], [], COST, 1024, best_effort=5).tokens == 5


def test_a_cap_below_one_decode_step_still_moves_prompts():
    assert plan_step(0.0, [stream(0.01)], [prompt("p", 100, None)], COST, 1024, None).tokens == MIN_CHUNK


def test_no_stream_decoding_leaves_the_whole_budget():
    assert plan_step(0.0, [], [prompt("p", 1500, 1.0)], COST, 1024, None).tokens is None


def test_prompts_go_earliest_feasible_deadline_first_and_a_hopeless_one_keeps_its_turn():
    early, late, none, hopeless = (prompt("early", 100, 5.0), prompt("late", 100, 9.0), prompt("none", 100, None),
                                   prompt("hopeless", 1500, 1.0))
    plan_step(0.0, [stream()], [none, hopeless, late, early], COST, 1024, None)
    order = sorted([none, hopeless, late, early], key=lambda p: p.slo_rank)
    assert [p.request_id for p in order] == ["early", "late", "none", "hopeless"]
    assert early.slo_rank[0] == URGENT and hopeless.slo_rank[0] != URGENT


def test_a_prompt_near_its_deadline_gets_a_burst_when_every_stream_can_lend_a_late_gap():
    streams = [stream(0.15, max_tokens=256) for _ in range(4)]  # 255 gaps: 2 may run late within the p99
    p = prompt("p", 1500, 5.0)
    plan = plan_step(0.0, streams, [p], COST, 1024, None)
    assert plan.burst and plan.tokens == 1024  # the late gap is spent anyway: the whole budget
    # after the burst the rest fits under the cap before the deadline
    cap = plan_step(0.0, streams, [prompt("x", 1, None)], COST, 1024, None).tokens
    rest = 1500 - plan.tokens
    assert COST.step_s(plan.tokens) + math.ceil(rest / cap) * COST.step_s(cap) <= 5.0


def test_no_burst_when_a_stream_has_no_late_gap_to_lend_beyond_its_reserve():
    for late in (2, 2 - RESERVE_GAPS):  # none left, or only the one kept for what no plan sees
        streams = [stream(0.15, max_tokens=256), stream(0.15, max_tokens=256, late=late)]
        plan = plan_step(0.0, streams, [prompt("p", 1500, 5.0)], COST, 1024, None)
        assert not plan.burst and COST.step_s(plan.tokens) <= 0.15


def simulate(arrivals: list[float], max_tokens: int, decode_s: float, token_s: float, context: float = 3072,
             horizon: float = 40.0) -> tuple[list[float], list[int]]:
    """Four streams with ITL target 150 ms decoding while 1,500-token prompts with TTFT target 6 s arrive; each
    step carries what ``plan_step`` allows, given to the prompts in rank order, and takes ``decode_s`` plus
    ``token_s * (1 + p / context)`` for each prompt token at position p. The planner sees the cost of a prompt
    token at position 0 as the step before measured it, as the engine does. The prompts' TTFTs and the streams'
    late gaps."""
    streams = [stream(0.15, max_tokens=max_tokens) for _ in range(4)]
    prompts = [prompt(f"p{i}", 1500, t + 6.0) for i, t in enumerate(arrivals)]
    done: dict[str, float] = {}
    now, measured = 0.0, token_s
    while len(done) < len(prompts) and now < horizon:
        waiting = [p for p, t in zip(prompts, arrivals) if t <= now and p.request_id not in done]
        plan = plan_step(now, streams, waiting, StepCost(decode_s, measured, context), 1024, None)
        budget, took, computed = plan.tokens if plan.tokens is not None else 1024, decode_s, 0.0
        for p in sorted(waiting, key=lambda p: p.slo_rank):
            n = min(budget, p.num_uncomputed)
            c = p.num_computed_tokens
            took += n * token_s * (1 + (2 * c + n - 1) / (2 * context))
            p.num_computed_tokens += n
            p.status = Status.RUNNING
            budget, computed = budget - n, computed + n * (1 + (2 * c + n - 1) / (2 * context))
            if p.num_uncomputed == 0:
                done[p.request_id] = now
        measured = (took - decode_s) / computed if computed else measured
        now += took
        for p in waiting:
            if p.request_id in done and done[p.request_id] == now - took:
                done[p.request_id] = now
        for s in streams:
            s.late_gaps += took > s.itl_target
    return [done.get(p.request_id, math.inf) - t for p, t in zip(prompts, arrivals)], [s.late_gaps for s in streams]


def test_streams_lend_late_gaps_so_the_first_of_three_long_prompts_makes_its_deadline():
    """Scenario C of the serving bench on a model of this machine (30 ms decode steps, 400 prompt tokens a
    second at position 0, attention growing with the position): three 1,500-token prompts 1 s apart; one core
    cannot prefill two of them in 7 s, so the best is the first one in time and every stream within its p99."""
    ttfts, late = simulate([0.0, 1.0, 2.0], 256, 0.03, 1 / 400)
    assert ttfts[0] <= 6.0 < min(ttfts[1:])
    assert all(0 < n <= late_gaps_allowed(255) for n in late)  # they lent, within their p99
    # streams that may not run late at all hold the cap, and then the first prompt misses too
    strict, late = simulate([0.0, 1.0, 2.0], 2, 0.03, 1 / 400)
    assert strict[0] > 6.0 and late == [0, 0, 0, 0]


def test_a_prompts_later_tokens_count_for_more_work_than_its_first():
    cost = StepCost(0.03, 1 / 400, context=3072)
    assert cost.work(0, 1500) == pytest.approx(1500 * (1 + 1499 / 6144))
    assert cost.work(1000, 1500) > cost.work(0, 500) > 500
    assert StepCost(0.03, 1 / 400).work(700, 2200) == 1500


def test_a_step_carries_fewer_tokens_the_further_into_its_prompt_they_sit():
    cost = StepCost(0.03, 1 / 400, context=3072)
    for at in (0, 700, 1400):
        n = cost.tokens_within(0.13, at)
        assert cost.step_s(n, at) <= 0.13 < cost.step_s(n + 1, at)
    assert cost.tokens_within(0.13, 0) > cost.tokens_within(0.13, 1400) > 0
    assert cost.tokens_within(0.02, 0) == 0  # not even the decode rows fit
    # the cap follows the prompt the scheduler computes first: one far into its prompt gets fewer tokens
    fresh, deep = prompt("fresh", 1500, None), prompt("deep", 1500, None)
    deep.num_computed_tokens = 1200
    deep.status = Status.RUNNING
    alone = plan_step(0.0, [stream()], [fresh], cost, 1024, None).tokens
    assert plan_step(0.0, [stream()], [fresh, deep], cost, 1024, None).tokens < alone


def engine(tiny_config, **settings):
    from kvmesh.engine.llm_engine import LLMEngine
    from kvmesh.settings import EngineSettings

    return LLMEngine(EngineSettings(num_blocks=64, block_size=4, **settings), model_config=tiny_config)


def finish(e, rid: str, prompt: list[int], params: SamplingParams, **kw) -> Sequence:
    seq = e.add_request(req(rid, prompt, params, **kw))
    while e.has_unfinished():
        e.step()
    return seq


def test_a_requests_ttft_counts_from_its_arrival_at_the_mesh_and_defaults_fill_what_it_leaves_unset(tiny_config):
    e = engine(tiny_config, slo_ttft_s=9.0, slo_itl_s=0.5)
    own = e.add_request(req("own", [1, 2, 3], SamplingParams(max_tokens=2), slo=SLO(ttft_s=6.0), waited_s=1.5))
    assert own.ttft_deadline == pytest.approx(own.arrival + 4.5) and own.itl_target == 0.5
    assert own.mesh_arrival == pytest.approx(own.arrival - 1.5)
    plain = e.add_request(req("plain", [1, 2, 3], SamplingParams(max_tokens=2)))
    assert plain.ttft_deadline == pytest.approx(plain.arrival + 9.0)
    assert engine(tiny_config).add_request(req("x", [1, 2], SamplingParams())).ttft_deadline is None


def test_a_migrated_request_keeps_its_itl_target_but_no_ttft_deadline(tiny_config):
    """Its first token went out from the instance it left: a TTFT target long past must not rank it last."""
    e = engine(tiny_config)
    moved = e.add_request(req("moved", [1, 2, 3, 7, 8], SamplingParams(max_tokens=6), generated=2,
                              slo=SLO(ttft_s=1.0, itl_s=0.5), waited_s=100.0))
    assert moved.ttft_deadline is None and moved.itl_target == 0.5


def test_finished_requests_with_a_target_are_counted_by_whether_they_met_it(tiny_config):
    e = engine(tiny_config)
    params = SamplingParams(max_tokens=4, ignore_eos=True)
    finish(e, "met", [1, 2, 3], params, slo=SLO(ttft_s=60.0, itl_s=60.0))
    finish(e, "late-tokens", [1, 2, 3], params, slo=SLO(ttft_s=60.0, itl_s=1e-9))  # every gap runs late
    finish(e, "late-start", [4, 5, 6], params, slo=SLO(ttft_s=60.0), waited_s=61.0)  # arrived 61 s ago
    finish(e, "no-target", [1, 2, 3], params)
    assert e.slo_outcomes == {"met": 1, "missed": 2, "missed_ttft": 1, "missed_itl": 1}


def test_the_engine_reports_its_goodput_in_its_metrics(tiny_config):
    import asyncio

    from kvmesh.contracts.engine import EngineRequest
    from kvmesh.engine.async_engine import AsyncEngine
    from kvmesh.telemetry.metrics import EngineCollector

    async def run():
        a = AsyncEngine(engine(tiny_config), asyncio.get_running_loop())
        try:
            request = EngineRequest("r", (1, 2, 3), SamplingParams(max_tokens=3, ignore_eos=True), slo=SLO(60, 60))
            async for _ in a.generate(request):
                pass
            return {s.labels["outcome"]: s.value for m in EngineCollector(a).collect() for s in m.samples
                    if s.name == "kvmesh_worker_slo_requests_total"}
        finally:
            await a.close()

    assert asyncio.run(asyncio.wait_for(run(), 30))["met"] == 1


def test_a_burst_comes_at_once_when_the_cap_shrinking_along_the_prompt_would_make_it_miss():
    """At the cap of its first position a 1,500-token prompt would make a 6 s deadline; its later tokens cost
    more (attention), so the same step length carries fewer of them and it would miss: the streams lend now,
    while they still can, not once the deadline is near."""
    def plan(context: float):
        streams = [stream(0.15, max_tokens=256) for _ in range(4)]
        return plan_step(0.0, streams, [prompt("p", 1500, 6.0)], StepCost(0.03, 1 / 400, context), 1024, None)

    assert not plan(0).burst  # every token the same: the cap makes it
    assert plan(3072).burst and plan(3072).tokens == 1024


def test_a_tracked_request_meets_its_ttft_by_its_deadline_and_its_itl_by_the_p99_of_its_gaps():
    from kvmesh.contracts.slo import NO_TARGET_HORIZON_S, SloTrack

    track = SloTrack(SLO(ttft_s=1.0, itl_s=0.1), arrival=100.0)
    assert track.due == 101.0
    for t in (100.9, 101.0, 101.05, 101.3):  # first token in time; one late gap of three (p99 of 3: the largest)
        track.token(t)
    assert track.met() == (True, False)
    late = SloTrack(SLO(ttft_s=1.0), arrival=100.0)
    late.token(101.5)
    assert late.met() == (False, True)
    continued = SloTrack(SLO(ttft_s=1.0), arrival=100.0, continued=True)  # its first token was another's
    continued.token(500.0)
    assert continued.met() == (True, True) and continued.due == 100.0 + NO_TARGET_HORIZON_S


def test_least_work_puts_a_mostly_cached_prompt_before_a_long_cold_one_that_came_first():
    cold, warm = prompt("cold", 1500, None), prompt("warm", 1500, None)
    cold.arrival = warm.arrival = 10.0
    warm.cached_estimate = 1480  # waiting, its cached prefix found: 20 tokens of work past it
    plan_step(10.0, [stream()], [cold, warm], COST, 1024, None, PrefillOrder.LEAST_WORK)
    assert [p.request_id for p in sorted([cold, warm], key=lambda p: p.slo_rank)] == ["warm", "cold"]
    plan_step(10.0, [stream()], [cold, warm], COST, 1024, None, PrefillOrder.ARRIVAL)
    assert [p.request_id for p in sorted([cold, warm], key=lambda p: p.slo_rank)] == ["cold", "warm"]


def test_least_work_ages_a_long_prompt_so_it_is_not_starved():
    long, short = prompt("long", 1500, None), prompt("short", 100, None)
    long.arrival, short.arrival = 0.0, 20.0
    # the long one (~4 s of work) would have finished alone before the short one arrived: it is not passed
    plan_step(20.0, [], [short, long], COST, 1024, None, PrefillOrder.LEAST_WORK)
    assert finish_alone(long, COST, 1024) < 20.0 < finish_alone(short, COST, 1024)
    assert min([short, long], key=lambda p: p.slo_rank) is long
    # fresh, the short one goes first
    long.arrival = 20.0
    plan_step(20.0, [], [short, long], COST, 1024, None, PrefillOrder.LEAST_WORK)
    assert min([short, long], key=lambda p: p.slo_rank) is short


def test_least_work_counts_a_prompts_wait_before_the_engine_took_it():
    """Two prompts of the same work: the one that reached the engine later but the mesh earlier (it waited at the
    router, or for its hand-off) goes first; without that wait, the one the engine took first does."""
    first, relayed = prompt("first", 600, None), prompt("relayed", 600, None)
    first.arrival, relayed.arrival = 10.0, 11.0
    relayed.waited = 3.0  # at the mesh since 8.0
    assert relayed.mesh_arrival == 8.0 and first.mesh_arrival == 10.0
    plan_step(11.0, [], [first, relayed], COST, 1024, None, PrefillOrder.LEAST_WORK)
    assert min([first, relayed], key=lambda p: p.slo_rank) is relayed
    relayed.waited = 0.0
    plan_step(11.0, [], [first, relayed], COST, 1024, None, PrefillOrder.LEAST_WORK)
    assert min([first, relayed], key=lambda p: p.slo_rank) is first


def test_least_work_tells_the_queue_a_new_prompt_would_wait_for_by_how_much_compute_it_brings():
    cold, turn, due = prompt("cold", 1500, None), prompt("turn", 1500, None), prompt("due", 300, 30.0)
    for p in (cold, turn, due):
        p.arrival = 10.0
    turn.cached_estimate = 1450  # 50 tokens past its cached prefix
    plan_step(10.0, [], [cold, turn, due], COST, 1024, None, PrefillOrder.LEAST_WORK)
    # the deadline is ahead of any new prompt; the turn's key is ~0.2 s away, the cold prompt's ~4-5 s
    assert tokens_ahead(10.0, [cold, turn, due], (0.01, 1.0, 16.0), 256) == (300, 350, 1850)
    # once the cold prompt computes, the chunk of the step it is in is ahead of any new prompt
    cold.status, cold.num_computed_tokens = Status.RUNNING, 256
    plan_step(10.0, [], [cold, turn, due], COST, 1024, None, PrefillOrder.LEAST_WORK)
    assert tokens_ahead(10.0, [cold, turn, due], (0.01, 1.0, 16.0), 256) == (556, 606, 1594)
    # a prompt not ranked yet (it arrived since the last step) counts as ahead of any
    late = prompt("late", 100, None)
    assert tokens_ahead(10.0, [late], (0.01,), 256) == (100,)


def test_least_work_prices_a_running_prompt_past_what_it_computed_and_deadlines_still_lead():
    running, fresh, due = prompt("running", 1500, None), prompt("fresh", 200, None), prompt("due", 400, 30.0)
    running.status, running.num_computed_tokens = Status.RUNNING, 1450  # 50 tokens left
    running.cached_estimate = 0  # a running prompt's estimate is not read: what it computed is
    for p in (running, fresh, due):
        p.arrival = 0.0
    plan_step(0.0, [stream()], [fresh, due, running], COST, 1024, None, PrefillOrder.LEAST_WORK)
    assert [p.request_id for p in sorted([fresh, due, running], key=lambda p: p.slo_rank)] == \
        ["due", "running", "fresh"]
