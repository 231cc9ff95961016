"""Routing policies. Each picks one candidate for a request and says why (its scores).

``cache_aware`` is Mooncake's rule: estimated TTFT = queue time + prefill time of the tokens not cached locally +
fetch time of the blocks that another tier (the pool) holds beyond the local prefix; the minimum wins. A hot-spot
guard (SGLang's) balances first when the load spread is both absolutely and relatively too large.

Each term is priced with the candidate's own cost model (its measured prefill speed and KV block size) when it
has one, else the policy's configured one, so a slow instance pays for its queue and its misses at its own
speed; the reason of a choice names the speed each candidate was priced at.
"""

from __future__ import annotations

import itertools
import random
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np

from kvmesh.contracts.names import RoutingPolicy
from kvmesh.routing.cost import CostModel

VECTOR_FROM = 32    # candidates from which the cache-aware estimates are computed as arrays
SPEEDS_LISTED = 8   # a choice's reason names at most this many candidates' prefill speeds


@dataclass
class Candidate:
    id: str
    queued_tokens: int = 0       # prompt tokens waiting or being prefilled there
    running: int = 0             # sequences running there
    local_blocks: int = 0        # leading prompt blocks cached on this instance (any of its tiers)
    free_blocks: int = 0         # KV headroom (decode choice)
    cost: CostModel | None = None  # this instance's calibrated cost model (None: the policy's configured one)
    lora_missing: bool = False   # it lacks the request's LoRA adapter: it would load it before prefilling
    share: float = 1.0           # of each step, what prompts get beside the streams it decodes (cost.local_share)
    pool: bool = True            # it can load blocks from the pool (False: its engine's KV cannot be converted)
    step_left_s: float = 0.0     # what is left of the decode step it is in: a prompt sent now starts after it

    @property
    def load(self) -> int:
        return self.queued_tokens


@dataclass
class Decision:
    chosen: Candidate | None     # None: rejected by admission control
    scores: dict[str, float] = field(default_factory=dict)  # candidate id → estimated TTFT s (or load)
    reason: str = ""


class Policy(Protocol):
    """``ttft_s``: the request's own TTFT target (0 = none: a policy with admission control applies its
    configured one)."""

    name: RoutingPolicy

    def choose(self, candidates: list[Candidate], prompt_tokens: int, block_size: int,
               pool_blocks: int = 0, ttft_s: float = 0.0) -> Decision: ...


class RoundRobin:
    name = RoutingPolicy.ROUND_ROBIN

    def __init__(self) -> None:
        self._next = itertools.count()

    def choose(self, candidates: list[Candidate], prompt_tokens: int, block_size: int,
               pool_blocks: int = 0, ttft_s: float = 0.0) -> Decision:
        ordered = sorted(candidates, key=lambda c: c.id)
        return Decision(ordered[next(self._next) % len(ordered)], reason="round robin")


class RandomChoice:
    name = RoutingPolicy.RANDOM

    def __init__(self, seed: int = 0) -> None:
        self._rng = random.Random(seed)

    def choose(self, candidates: list[Candidate], prompt_tokens: int, block_size: int,
               pool_blocks: int = 0, ttft_s: float = 0.0) -> Decision:
        return Decision(self._rng.choice(sorted(candidates, key=lambda c: c.id)), reason="random")


class LeastLoaded:
    name = RoutingPolicy.LEAST_LOADED

    def choose(self, candidates: list[Candidate], prompt_tokens: int, block_size: int,
               pool_blocks: int = 0, ttft_s: float = 0.0) -> Decision:
        best = min(candidates, key=lambda c: (c.queued_tokens, c.running, c.id))
        return Decision(best, {c.id: float(c.queued_tokens) for c in candidates}, "least queued tokens")


class CacheAware:
    name = RoutingPolicy.CACHE_AWARE

    def __init__(self, cost: CostModel | None = None, use_pool: bool = True, slo_ttft_s: float = 0.0,
                 imbalance_abs_tokens: int = 4096, imbalance_rel: float = 4.0) -> None:
        self.cost = cost or CostModel()
        self.use_pool = use_pool
        self.slo_ttft_s = slo_ttft_s          # 0 = no admission control
        self.imbalance_abs_tokens = imbalance_abs_tokens
        self.imbalance_rel = imbalance_rel

    def estimate(self, c: Candidate, prompt_tokens: int, block_size: int, pool_blocks: int) -> float:
        cost = c.cost or self.cost
        local = min(c.local_blocks * block_size, prompt_tokens - 1)
        fetched = max(0, pool_blocks - c.local_blocks) if self.use_pool and c.pool else 0
        hit = min(prompt_tokens - 1, local + fetched * block_size)
        return ((cost.prefill_s(c.queued_tokens) + cost.prefill_s(prompt_tokens - hit)) / c.share
                + cost.fetch_s(fetched) + (cost.lora_load_s if c.lora_missing else 0.0) + c.step_left_s)

    def estimates(self, candidates: Sequence[Candidate], prompt_tokens: int, block_size: int,
                  pool_blocks: int) -> list[float]:
        """:meth:`estimate` of every candidate, in order. A large fleet's as arrays (the same operations in the
        same order: the same floats), a few whole-array steps instead of a Python call per instance."""
        if len(candidates) < VECTOR_FROM:
            return [self.estimate(c, prompt_tokens, block_size, pool_blocks) for c in candidates]
        n = len(candidates)
        costs = [c.cost or self.cost for c in candidates]

        def of(values: Iterable[float | int], dtype: type = np.float64) -> np.ndarray:
            return np.fromiter(values, dtype, n)

        speed, overhead = of(k.prefill_tok_per_s for k in costs), of(k.prefill_overhead_s for k in costs)
        local_blocks = of((c.local_blocks for c in candidates), np.int64)
        local = np.minimum(local_blocks * block_size, prompt_tokens - 1)
        if self.use_pool:
            fetched = np.where(of((c.pool for c in candidates), np.bool_), np.maximum(0, pool_blocks - local_blocks), 0)
        else:
            fetched = np.zeros(n, np.int64)
        hit = np.minimum(prompt_tokens - 1, local + fetched * block_size)

        def prefill_s(tokens: np.ndarray) -> np.ndarray:
            return np.where(tokens > 0, overhead + np.maximum(0, tokens) / speed, 0.0)

        queued = of((c.queued_tokens for c in candidates), np.int64)
        fetch_s = fetched * of((k.block_bytes for k in costs), np.int64) / (of(k.fetch_gbps for k in costs) * 1e9)
        lora_s = np.where(of((c.lora_missing for c in candidates), np.bool_), of(k.lora_load_s for k in costs), 0.0)
        est = ((prefill_s(queued) + prefill_s(prompt_tokens - hit)) / of(c.share for c in candidates) + fetch_s + lora_s
               + of(c.step_left_s for c in candidates))
        out: list[float] = est.tolist()
        return out

    def choose(self, candidates: list[Candidate], prompt_tokens: int, block_size: int,
               pool_blocks: int = 0, ttft_s: float = 0.0) -> Decision:
        """Admission control: the request's own TTFT target, else the configured ``slo_ttft_s``; none of the
        candidates' estimates within it → no choice (the request is refused, RESOURCE_EXHAUSTED / 429)."""
        estimates = self.estimates(candidates, prompt_tokens, block_size, pool_blocks)
        scores = dict(zip((c.id for c in candidates), estimates))
        loads = [c.queued_tokens for c in candidates]
        target = ttft_s or self.slo_ttft_s
        if max(loads) - min(loads) > self.imbalance_abs_tokens and max(loads) > self.imbalance_rel * max(1, min(loads)):
            best = _least(candidates, loads, estimates)
            return self._admit(best, candidates, scores, "load imbalance: balancing first", target)
        best = _least(candidates, estimates, loads)
        return self._admit(best, candidates, scores, "lowest estimated TTFT", target)

    def _admit(self, best: Candidate, candidates: list[Candidate], scores: dict[str, float],
               reason: str, target: float) -> Decision:
        if target and scores[best.id] > target:  # clients read this one: no instance names
            return Decision(None, scores, f"no instance meets the TTFT SLO of {target:g}s "
                                          f"(best estimate {scores[best.id]:.2f}s)")
        return Decision(best, scores, f"{reason}; {self.speeds(candidates, best, scores)}")

    def speeds(self, candidates: list[Candidate], chosen: Candidate | None = None,
               scores: Mapping[str, float] | None = None) -> str:
        """The prefill speed each candidate was priced at: measured on the instance, or the configured one. Of a
        fleet larger than ``SPEEDS_LISTED``: the chosen one and those with the lowest estimates."""
        listed = candidates
        if len(candidates) > SPEEDS_LISTED and scores is not None:
            others = [c for c in candidates if c is not chosen]
            best = lowest([scores[c.id] for c in others], SPEEDS_LISTED - (chosen is not None))
            listed = ([chosen] if chosen is not None else []) + [others[k] for k in best]
        parts = []
        for c in sorted(listed, key=lambda c: c.id):
            cost = c.cost or self.cost
            parts.append(f"{c.id}={cost.prefill_tok_per_s:.0f}{'' if cost.calibrated else ' (configured)'}")
        more = f" ({len(listed)} of {len(candidates)}: the chosen, the lowest estimates)" \
            if len(listed) < len(candidates) else ""
        return "prefill tok/s: " + ", ".join(parts) + more


def lowest(values: Sequence[float], k: int) -> list[int]:
    """The positions of the ``k`` least of ``values``, least first (among equals at the cut: any)."""
    if len(values) <= k:
        return sorted(range(len(values)), key=lambda i: (values[i], i))
    part = np.argpartition(np.asarray(values, np.float64), k - 1)[:k].tolist()
    return sorted(part, key=lambda i: (values[i], i))


def _least(candidates: list[Candidate], first: Sequence[float], then: Sequence[float]) -> Candidate:
    """The candidate least by (``first``, ``then``, id), each given in the candidates' order."""
    low = min(first)
    tied = [k for k, v in enumerate(first) if v == low]
    if len(tied) == 1:
        return candidates[tied[0]]
    return candidates[min(tied, key=lambda k: (then[k], candidates[k].id))]


POLICIES: dict[RoutingPolicy, type[Policy]] = {p.name: p for p in (RoundRobin, RandomChoice, LeastLoaded,
                                                                   CacheAware)}


def make_policy(name: RoutingPolicy | str, cost: CostModel | None = None, use_pool: bool = True,
                slo_ttft_s: float = 0.0) -> Policy:
    """A fresh policy; the others are :class:`CacheAware`'s (the other policies take none)."""
    try:
        key = RoutingPolicy(name)
    except ValueError:
        known = sorted(p.value for p in POLICIES)
        raise ValueError(f"unknown routing policy {name!r}; choose one of {known}") from None
    if key is RoutingPolicy.CACHE_AWARE:
        return CacheAware(cost, use_pool, slo_ttft_s)
    return POLICIES[key]()
