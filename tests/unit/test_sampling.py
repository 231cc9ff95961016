import pytest
import torch
from kvmesh.contracts.sampling import SamplingParams
from kvmesh.engine.sampling import argmax_rows, filter_logits, make_generator, sample


def test_greedy_takes_the_argmax():
    logits = torch.tensor([[0.1, 3.0, 0.2], [5.0, 0.0, 1.0]])
    assert sample(logits, [SamplingParams()] * 2, [None, None]) == [1, 0]


def test_a_seed_reproduces_the_same_samples():
    logits = torch.randn(1, 50)
    p = SamplingParams(temperature=1.0, seed=1234)
    draws = [[sample(logits, [p], [make_generator(p, pos)])[0] for pos in range(20)] for _ in range(2)]
    assert draws[0] == draws[1] and len(set(draws[0])) > 1


def test_top_k_keeps_only_the_k_best():
    logits = torch.tensor([1.0, 5.0, 3.0, 4.0])
    kept = filter_logits(logits, SamplingParams(temperature=1.0, top_k=2)).isfinite()
    assert kept.tolist() == [False, True, False, True]


def test_top_p_keeps_the_smallest_set_reaching_p():
    logits = torch.log(torch.tensor([0.5, 0.3, 0.15, 0.05]))
    kept = filter_logits(logits, SamplingParams(temperature=1.0, top_p=0.7)).isfinite()
    assert kept.tolist() == [True, True, False, False]


def test_top_k_one_is_greedy():
    assert SamplingParams(temperature=0.8, top_k=1).greedy


@pytest.mark.parametrize("bad", [{"max_tokens": 0}, {"temperature": -1}, {"top_p": 0}, {"top_k": -2}])
def test_invalid_parameters_are_refused(bad):
    with pytest.raises(ValueError):
        SamplingParams(**bad)


# ---- numerically safe for every legal value ------------------------------------------------------------------

LOGITS = torch.tensor([[0.5, 3.0, -1.0, 2.9, 0.0, 1.0]])
BEST = 1


@pytest.mark.parametrize("temperature", [0.0, 1.401298464324817e-45, 1e-30, 1e-6])
def test_a_temperature_below_the_floor_is_greedy(temperature):
    p = SamplingParams(temperature=temperature, seed=3)
    assert p.greedy and make_generator(p, 0) is None
    assert sample(LOGITS, [p], [None]) == [BEST]


@pytest.mark.parametrize("temperature", [1e-5, 1e4, 1e30, 3.4e38, 1e308, float("inf")])
def test_any_temperature_samples_a_real_token_and_huge_ones_are_near_uniform(temperature):
    p = SamplingParams(temperature=temperature, seed=11)
    draws = [sample(LOGITS, [p], [make_generator(p, pos)])[0] for pos in range(300)]
    assert all(isinstance(t, int) and 0 <= t < LOGITS.shape[1] for t in draws)
    if temperature >= 1e4:
        assert len(set(draws)) == LOGITS.shape[1]


def test_logits_too_large_to_scale_still_sample():
    logits = torch.tensor([[3e38, -3e38, 1e38, 0.0]])
    p = SamplingParams(temperature=1e-5, seed=1)
    assert sample(logits, [p], [make_generator(p, 0)]) == [0]


@pytest.mark.parametrize("top_p", [1.401298464324817e-45, 1e-300, 1e-9])
@pytest.mark.parametrize("temperature", [1.0, 1e30])
def test_a_top_p_too_small_for_anything_to_survive_keeps_the_argmax(top_p, temperature):
    p = SamplingParams(temperature=temperature, top_p=top_p, seed=5)
    assert filter_logits(LOGITS[0], p).isfinite().tolist() == [i == BEST for i in range(LOGITS.shape[1])]
    assert {sample(LOGITS, [p], [make_generator(p, pos)])[0] for pos in range(50)} == {BEST}


@pytest.mark.parametrize("temperature", [1e30, float("inf")])
def test_top_k_one_with_a_huge_temperature_is_the_argmax(temperature):
    p = SamplingParams(temperature=temperature, top_k=1, seed=5)
    assert p.greedy and sample(LOGITS, [p], [make_generator(p, 0)]) == [BEST]


def test_top_k_beyond_the_vocabulary_is_off():
    p = SamplingParams(temperature=1.0, top_k=10**9)
    assert filter_logits(LOGITS[0], p).isfinite().all()


@pytest.mark.parametrize("seed", [0, 2**63 - 1, 2**63, 2**64 - 1, 10**40])
def test_any_seed_works_and_reproduces(seed):
    p = SamplingParams(temperature=1.0, seed=seed)
    logits = torch.randn(1, 50, generator=torch.Generator().manual_seed(0))
    draws = [[sample(logits, [p], [make_generator(p, pos)])[0] for pos in range(10)] for _ in range(2)]
    assert draws[0] == draws[1]


def test_nan_temperature_is_refused():
    with pytest.raises(ValueError, match="temperature"):
        SamplingParams(temperature=float("nan"))


# ---- one row never fails another ---------------------------------------------------------------------------------

MIXED = [SamplingParams(), SamplingParams(temperature=0.7, seed=1), SamplingParams(temperature=1.3, top_k=5, seed=2),
         SamplingParams(temperature=0.9, top_p=0.8, seed=3), SamplingParams(temperature=1.0, top_k=3, top_p=0.5),
         SamplingParams(temperature=1e-45), SamplingParams(temperature=2.0, top_p=1e-30, seed=4)]


def test_batched_filtering_equals_filtering_each_row_alone():
    from kvmesh.engine.sampling import filter_rows

    sampled = [p for p in MIXED if not p.greedy]  # greedy rows are an argmax, never filtered
    logits = torch.randn(len(sampled), 64, generator=torch.Generator().manual_seed(1))
    together = filter_rows(logits, sampled)
    for row, p in enumerate(sampled):
        assert torch.equal(together[row], filter_logits(logits[row], p))


def test_a_seeded_rows_sample_does_not_depend_on_its_batch_neighbours():
    logits = torch.randn(len(MIXED), 64, generator=torch.Generator().manual_seed(2))
    for pos in range(20):
        gens = [make_generator(p, pos) for p in MIXED]
        together = sample(logits, MIXED, gens)
        for row, p in enumerate(MIXED):
            if p.seed is not None or p.greedy:
                assert together[row] == sample(logits[[row]], [p], [make_generator(p, pos)])[0]


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
def test_non_finite_logits_fail_that_row_only(bad):
    from kvmesh.engine.sampling import RowFault

    logits = torch.randn(len(MIXED), 64, generator=torch.Generator().manual_seed(3))
    poisoned = logits.clone()
    poisoned[2, 7] = bad
    gens = [make_generator(p, 0) for p in MIXED]
    got = sample(poisoned, MIXED, gens)
    assert isinstance(got[2], RowFault) and not got[2].client_fault and "not finite" in got[2].message
    clean = sample(logits, MIXED, [make_generator(p, 0) for p in MIXED])
    for row, p in enumerate(MIXED):
        if row != 2 and (p.seed is not None or p.greedy):
            assert got[row] == clean[row]


def test_a_value_that_slipped_past_validation_is_the_requests_fault():
    from kvmesh.engine.sampling import RowFault

    sneaky = SamplingParams(temperature=1.0)
    object.__setattr__(sneaky, "temperature", float("nan"))  # as if built without __post_init__'s checks
    got = sample(torch.randn(2, 8), [SamplingParams(), sneaky], [None, None])
    assert isinstance(got[0], int)
    assert isinstance(got[1], RowFault) and got[1].client_fault and "temperature" in got[1].message


def test_argmax_rows_is_torchs_argmax_first_index_on_ties_included():
    logits = torch.randn(5, 300, generator=torch.Generator().manual_seed(3))
    logits[1, 7] = logits[1, 200] = logits[1].max() + 1  # a tie: the first index wins, as in torch
    logits[2] = float("-inf")
    logits[2, 299] = 0.0  # a grammar mask leaving one token
    assert argmax_rows(logits) == logits.argmax(dim=-1).tolist()
    assert argmax_rows(logits)[1] == 7
    assert argmax_rows(logits[:, ::2]) == logits[:, ::2].argmax(dim=-1).tolist()  # a strided view
