"""The router's choice between PD and decode computing the rest itself (kvmesh.routing.cost.disaggregation)."""

from kvmesh.routing.cost import CostModel, disaggregation

COST = CostModel(prefill_tok_per_s=1000.0, prefill_overhead_s=0.03)


def test_a_cold_prompt_is_disaggregated():
    d = disaggregation("auto", 1500, 16, 0, 0, COST, COST)
    assert d.disaggregate and d.reason.startswith("pd:")


def test_decode_holding_the_conversation_computes_the_new_turn_itself():
    d = disaggregation("auto", 1058, 16, 59, 59, COST, COST)
    assert not d.disaggregate and d.reason.startswith("local:") and d.local_s <= d.pd_s


def test_a_busy_decode_pays_for_its_streams_and_hands_off():
    d = disaggregation("auto", 1058, 16, 59, 59, COST, COST, decode_running=8)
    assert d.disaggregate


def test_prefill_holding_much_more_than_decode_wins():
    d = disaggregation("auto", 1600, 16, 99, 50, COST, COST)
    assert d.disaggregate


def test_forced_modes():
    assert disaggregation("always", 1058, 16, 59, 59, COST, COST).disaggregate
    assert not disaggregation("never", 1500, 16, 0, 0, COST, COST).disaggregate


# ---- a request with a TTFT target ------------------------------------------------------------------------------

SLOW = CostModel(prefill_tok_per_s=400.0, prefill_overhead_s=0.03)


def test_a_cold_prompt_goes_to_decode_when_prefills_queue_would_miss_its_ttft_target_and_decode_would_not():
    """Scenario C through PD: prefill is busy with a 1,500-token prompt, decode runs four streams."""
    from kvmesh.routing.cost import TTFTTarget, local_share

    share = local_share(decode_step_s=0.03, itl_s=0.15)  # a step of 127 ms: 0.03 s decode rows, the rest prompt
    d = disaggregation("auto", 1500, 16, 0, 0, SLOW, SLOW, ttft=TTFTTarget(5.9, prefill_queued=1500,
                                                                           local_share=share))
    assert not d.disaggregate and d.reason.startswith("local: only it meets the TTFT target")


def test_a_ttft_target_neither_path_meets_is_refused_and_one_both_meet_keeps_the_usual_choice():
    from kvmesh.routing.cost import TTFTTarget

    hopeless = disaggregation("auto", 1500, 16, 0, 0, SLOW, SLOW,
                              ttft=TTFTTarget(5.0, prefill_queued=1500, decode_queued=1500, local_share=0.7))
    assert hopeless.refuse and "no instance meets the TTFT SLO" in hopeless.reason
    easy = disaggregation("auto", 1500, 16, 0, 0, SLOW, SLOW, ttft=TTFTTarget(60.0, local_share=0.7))
    assert easy.disaggregate and not easy.refuse
    forced = disaggregation("always", 1500, 16, 0, 0, SLOW, SLOW, ttft=TTFTTarget(0.1))
    assert forced.disaggregate and not forced.refuse  # experiments force a path whatever the target


def test_decodes_share_of_a_step_follows_the_itl_target_and_its_decode_rows():
    from kvmesh.routing.cost import local_share

    assert local_share(0.03, 0.15) > local_share(0.06, 0.15) > local_share(0.03, 0.0) == 1 / 3
    assert local_share(0.2, 0.15) == 0.1  # a step already past the target: decode barely prefills
