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
from dataclasses import dataclass, field
from typing import Protocol

from kvmesh.contracts.names import RoutingPolicy
from kvmesh.routing.cost import CostModel


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
                + cost.fetch_s(fetched) + (cost.lora_load_s if c.lora_missing else 0.0))

    def choose(self, candidates: list[Candidate], prompt_tokens: int, block_size: int,
               pool_blocks: int = 0, ttft_s: float = 0.0) -> Decision:
        """Admission control: the request's own TTFT target, else the configured ``slo_ttft_s``; none of the
        candidates' estimates within it → no choice (the request is refused, RESOURCE_EXHAUSTED / 429)."""
        scores = {c.id: self.estimate(c, prompt_tokens, block_size, pool_blocks) for c in candidates}
        loads = [c.queued_tokens for c in candidates]
        target = ttft_s or self.slo_ttft_s
        if max(loads) - min(loads) > self.imbalance_abs_tokens and max(loads) > self.imbalance_rel * max(1, min(loads)):
            best = min(candidates, key=lambda c: (c.queued_tokens, scores[c.id], c.id))
            return self._admit(best, candidates, scores, "load imbalance: balancing first", target)
        best = min(candidates, key=lambda c: (scores[c.id], c.queued_tokens, c.id))
        return self._admit(best, candidates, scores, "lowest estimated TTFT", target)

    def _admit(self, best: Candidate, candidates: list[Candidate], scores: dict[str, float],
               reason: str, target: float) -> Decision:
        if target and scores[best.id] > target:  # clients read this one: no instance names
            return Decision(None, scores, f"no instance meets the TTFT SLO of {target:g}s "
                                          f"(best estimate {scores[best.id]:.2f}s)")
        return Decision(best, scores, f"{reason}; {self.speeds(candidates)}")

    def speeds(self, candidates: list[Candidate]) -> str:
        """The prefill speed each candidate was priced at: measured on the instance, or the configured one."""
        parts = []
        for c in sorted(candidates, key=lambda c: c.id):
            cost = c.cost or self.cost
            parts.append(f"{c.id}={cost.prefill_tok_per_s:.0f}{'' if cost.calibrated else ' (configured)'}")
        return "prefill tok/s: " + ", ".join(parts)


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
