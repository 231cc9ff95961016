"""Per-request sampling: greedy rows in one argmax, sampled rows with temperature, top-k, top-p and a seed."""

from __future__ import annotations

import torch

from kvmesh.contracts.sampling import SamplingParams


def make_generator(params: SamplingParams, position: int) -> torch.Generator | None:
    """A private generator for a seeded request's ``position``-th output token: its samples depend neither on
    its batch neighbours nor on which instance (prefill or decode) draws that token."""
    if params.greedy or params.seed is None:
        return None
    return torch.Generator().manual_seed((params.seed * 1_000_003 + position) % 2**63)


def filter_logits(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Temperature, then top-k, then top-p (nucleus) on one row of logits."""
    logits = logits / params.temperature
    if params.top_k > 0 and params.top_k < logits.shape[-1]:
        kth = torch.topk(logits, params.top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if params.top_p < 1.0:
        sorted_logits, order = torch.sort(logits, descending=True)
        cum = sorted_logits.softmax(-1).cumsum(-1)
        drop = cum - sorted_logits.softmax(-1) >= params.top_p  # keep the smallest set reaching top_p
        logits = logits.masked_fill(torch.zeros_like(drop).scatter(0, order, drop), float("-inf"))
    return logits


def sample(logits: torch.Tensor, params: list[SamplingParams],
           generators: list[torch.Generator | None]) -> list[int]:
    """One token per row of ``logits`` ``[B, vocab]``."""
    out = logits.argmax(dim=-1).tolist()
    for row, (p, g) in enumerate(zip(params, generators)):
        if p.greedy:
            continue
        probs = filter_logits(logits[row], p).softmax(-1)
        out[row] = int(torch.multinomial(probs, 1, generator=g).item())
    return out
