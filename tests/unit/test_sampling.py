import re

import pytest
import torch
from kvmesh.contracts.sampling import SamplingParams
from kvmesh.engine.sampling import (
    History,
    RowFault,
    Tally,
    adjust_rows,
    argmax_rows,
    filter_logits,
    make_generator,
    sample,
)


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


# ---- logit adjustments: bias, min_tokens, penalties, min_p -------------------------------------------------

def hist(output=(), prompt=(), ends=(9,), vocab=10):
    return History(Tally(vocab, tuple(prompt) + tuple(output), tuple(output)), tuple(ends))


def test_penalties_follow_vllms_formulas():
    logits = torch.tensor([[2.0, -1.0, 0.5, 3.0, 0.0, 1.0, 1.0, 1.0, 1.0, 1.0]])
    p = SamplingParams(presence_penalty=0.5, frequency_penalty=0.25, repetition_penalty=2.0)
    h = hist(output=[3, 3, 1], prompt=[0])
    out = adjust_rows(logits, [p], [h])[0]
    # repetition on prompt and output tokens (positive / r, negative * r), then frequency x count + presence
    assert out[0].item() == pytest.approx(1.0)
    assert out[1].item() == pytest.approx(-2.0 - 0.25 - 0.5)
    assert out[3].item() == pytest.approx(1.5 - 0.5 - 0.5)
    assert out[2].item() == pytest.approx(0.5) and out[4].item() == 0.0  # never seen: unchanged
    assert torch.equal(logits[0], torch.tensor([2.0, -1.0, 0.5, 3.0, 0.0, 1.0, 1.0, 1.0, 1.0, 1.0]))  # a copy


def test_logit_bias_and_min_tokens_move_a_greedy_choice():
    logits = torch.tensor([[0.0, 5.0, 1.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 9.0]])
    biased = SamplingParams(logit_bias=((2, 10.0), (50_000, 3.0)))  # an id past the vocabulary is left out
    assert sample(logits, [biased], [None], histories=[hist()]) == [2]
    early = SamplingParams(min_tokens=2)
    assert sample(logits, [early], [None], histories=[hist(output=[1])]) == [1]  # EOS (9) banned before 2
    assert sample(logits, [early], [None], histories=[hist(output=[1, 1])]) == [9]
    assert sample(logits, [SamplingParams(min_tokens=1, ignore_eos=True)], [None], histories=[hist(ends=())]) == [9]


def test_rows_without_adjustments_are_untouched_and_batches_equal_rows_alone():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(4, 64, generator=g)
    params = [SamplingParams(), SamplingParams(presence_penalty=2.0), SamplingParams(logit_bias=((5, -100.0),)),
              SamplingParams(repetition_penalty=1.5, frequency_penalty=-1.0)]
    histories = [None, hist(output=[int(logits[1].argmax())], vocab=64), hist(vocab=64),
                 hist(output=[7, 7, 8], prompt=[1, 2], vocab=64)]
    out = adjust_rows(logits, params, histories)
    assert torch.equal(out[0], logits[0])
    for i in range(1, 4):
        assert torch.equal(out[i], adjust_rows(logits[i:i + 1], [params[i]], [histories[i]])[0])
    assert sample(logits, params, [None] * 4, histories=histories)[1] != int(logits[1].argmax())


def test_min_p_drops_tokens_less_likely_than_its_share_of_the_best():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.12, 0.08]]))
    kept = filter_logits(logits[0], SamplingParams(temperature=1.0, min_p=0.25)) > float("-inf")
    assert kept.tolist() == [True, True, False, False]  # 0.12 < 0.25 x 0.5
    everything = filter_logits(logits[0], SamplingParams(temperature=1.0, min_p=0.0)) > float("-inf")
    assert everything.all() and (filter_logits(logits[0], SamplingParams(temperature=1.0, min_p=1.0))
                                 > float("-inf")).tolist() == [True, False, False, False]


def test_a_min_tokens_ban_that_leaves_nothing_fails_that_row_only():
    logits = torch.tensor([[0.0, 2.0], [1.0, 0.0]])
    p = SamplingParams(min_tokens=3)  # EOS (0) and a stop token (1): the whole vocabulary
    out = sample(logits, [p, SamplingParams()], [None, None], histories=[hist(ends=[0, 1], vocab=2), None])
    assert isinstance(out[0], RowFault) and out[0].client_fault and "min_tokens" in out[0].message
    assert out[1] == 0


@pytest.mark.parametrize("field,value,words", [
    ("presence_penalty", 2.5, "presence_penalty must be in [-2, 2]"),
    ("frequency_penalty", float("nan"), "frequency_penalty must be in [-2, 2]"),
    ("repetition_penalty", 0.0, "repetition_penalty must be in (0, 10]"),
    ("min_p", 1.5, "min_p must be in [0, 1]"),
    ("min_tokens", 65, "min_tokens must be in [0, max_tokens = 64]"),
    ("logit_bias", ((3, 101.0),), "bias must be in [-100, 100]"),
])
def test_bad_adjustments_are_refused(field, value, words):
    with pytest.raises(ValueError, match=re.escape(words)):
        SamplingParams(**{field: value})


def test_adjustments_cross_the_wire_and_say_what_they_need():
    from kvmesh.contracts.sampling import sampling_from_proto, sampling_to_proto

    p = SamplingParams(presence_penalty=0.5, frequency_penalty=-0.25, repetition_penalty=1.25, min_p=0.125,
                       min_tokens=3, logit_bias=((2, -100.0), (7, 2.5)))
    assert sampling_from_proto(sampling_to_proto(p)) == p and p.features == ("logits",)
    assert SamplingParams().features == () and SamplingParams(min_p=0.1).features == ("logits",)
    assert sampling_from_proto(sampling_to_proto(SamplingParams())).repetition_penalty == 1.0


def test_a_tally_kept_token_by_token_equals_one_built_from_the_tokens():
    kept = Tally(10, [1, 2], [])
    for t in (3, 3, 12, 1):  # 12: past the vocabulary, counted as generated only
        kept.add(t)
    built = Tally(10, [1, 2, 3, 3, 12, 1], [3, 3, 12, 1])
    assert torch.equal(kept.seen, built.seen) and torch.equal(kept.counts, built.counts)
    assert kept.generated == built.generated == 4 and kept.counts[3] == 2
