"""A continued stream's earlier output in vLLM's presence and frequency penalties (``kvmesh.vllm.penalties``): the
processor's adjustment, followed by vLLM 0.32's own penalty code (``apply_penalties``: repetition on prompt and
output, then frequency and presence on its output), gives exactly the stream's rule, in which the earlier tokens
are output; and a request that does not need it gets no processor."""

from __future__ import annotations

import random

import pytest
import torch

pytest.importorskip("vllm", reason="needs vLLM: make vllm")

from kvmesh.vllm.penalties import EARLIER, Earlier, EarlierOutputs
from vllm import SamplingParams
from vllm.model_executor.layers.utils import apply_penalties

VOCAB = 50


def counts(tokens: list[int]) -> torch.Tensor:
    return torch.bincount(torch.tensor(tokens, dtype=torch.long), minlength=VOCAB).float() if tokens else \
        torch.zeros(VOCAB)


def vllm_penalties(logits: torch.Tensor, prompt: list[int], own: list[int], p: float, f: float, r: float):
    """vLLM's penalty step on one row: the prompt and its own output padded with ``VOCAB``, as its sampler pads."""
    pad = lambda ids, n: torch.tensor([ids + [VOCAB] * (n - len(ids))], dtype=torch.long)
    return apply_penalties(logits.unsqueeze(0).clone(), pad(prompt, len(prompt)), pad(own, max(1, len(own))),
                           torch.tensor([p]), torch.tensor([f]), torch.tensor([r]))[0]


def stream_rule(logits: torch.Tensor, prompt: list[int], output: list[int], p: float, f: float, r: float):
    """The stream's penalties as if one engine had generated all of ``output``."""
    seen = (counts(prompt) + counts(output)) > 0
    x = torch.where(seen, torch.where(logits > 0, logits / r, logits * r), logits)
    return x - f * counts(output) - p * (counts(output) > 0).float()


@pytest.mark.parametrize("seed", range(40))
def test_the_adjustment_then_vllms_penalties_give_the_streams_rule(seed):
    rng = random.Random(seed)
    original = [rng.randrange(VOCAB) for _ in range(rng.randrange(1, 12))]
    earlier = [rng.randrange(VOCAB) for _ in range(rng.randrange(1, 15))]
    own = [rng.randrange(VOCAB) for _ in range(rng.randrange(0, 15))]
    p, f = rng.choice([0.0, 0.5, -1.2, 2.0]), rng.choice([0.0, 0.8, -0.4, 1.5])
    r = rng.choice([1.0, 1.3, 0.7])
    logits = torch.randn(VOCAB, generator=torch.Generator().manual_seed(seed)) * 4
    logits[rng.randrange(VOCAB)] = float("-inf")  # a token min_tokens holds off stays off
    adjust = Earlier(earlier, p, f, r)
    for n in range(len(own) + 1):  # step by step, as vLLM's running output grows
        got = vllm_penalties(adjust(own[:n], logits.clone()), original + earlier, own[:n], p, f, r)
        want = stream_rule(logits, original, earlier + own[:n], p, f, r)
        assert torch.allclose(got, want, atol=1e-5, rtol=1e-5, equal_nan=True), (n, got - want)


def test_without_the_adjustment_vllm_would_not_count_the_earlier_tokens():
    logits, earlier = torch.zeros(VOCAB), [3, 3, 7]
    plain = vllm_penalties(logits, [1] + earlier, [], 0.5, 1.0, 1.0)
    assert plain[3] == 0 and stream_rule(logits, [1], earlier, 0.5, 1.0, 1.0)[3] == -2.5


def test_a_request_without_earlier_tokens_or_penalties_gets_no_processor():
    proc = EarlierOutputs.__new__(EarlierOutputs)  # new_req_logits_processor reads only the params
    assert proc.new_req_logits_processor(SamplingParams(frequency_penalty=1.0)) is None
    assert proc.new_req_logits_processor(SamplingParams(extra_args={EARLIER: [1, 2]})) is None  # no penalty
    assert proc.new_req_logits_processor(SamplingParams(repetition_penalty=1.2, extra_args={EARLIER: [1]})) is None
    assert isinstance(proc.new_req_logits_processor(
        SamplingParams(presence_penalty=0.5, extra_args={EARLIER: [1, 2]})), Earlier)
    assert not proc.is_argmax_invariant()
