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
