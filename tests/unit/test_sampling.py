import pytest
import torch
from kvmesh.contracts.sampling import SamplingParams
from kvmesh.engine.sampling import filter_logits, make_generator, sample


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
