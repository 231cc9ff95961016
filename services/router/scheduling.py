"""The router's side of scheduling: live instances become ``kvmesh.routing`` candidates, the configured (or
per-request) policy picks the prefill instance, and decode goes to the least loaded instance with KV headroom
(the pushed KV makes decode's own cache irrelevant to the choice). Each candidate carries the cost model its
instance measured and reports in its heartbeat (``CostModel.from_load``); one that reports none is priced with
the configured one."""

from __future__ import annotations

from kvmesh.contracts.ids import choices
from kvmesh.contracts.names import RoutingPolicy
from kvmesh.routing import POLICIES, CacheAware, Candidate, CostModel, Decision, Policy, make_policy
from kvmesh.routing.cost import local_share

from services.router.registry import Instance


def to_candidates(instances: list[Instance], matched: dict[str, int],
                  cost: CostModel | None = None, lora_missing: frozenset[str] | set[str] = frozenset(),
                  itl_s: float = 0.0) -> list[Candidate]:
    """``cost``: the configured model, which an instance's measured speed and block size override.
    ``lora_missing``: instances that lack the request's LoRA adapter (they would load it first). ``itl_s``: the
    request's ITL target: an instance that decodes streams and sizes its steps by their targets (it reports
    its decode step, ``decode_step_s``: the native engine) computes a prompt only in what each step has left
    beside them (``local_share``), so its prefill is priced that much slower."""
    cost = cost or CostModel()

    def share(i: Instance) -> float:
        step, running = i.beat.load.get("decode_step_s", 0.0), i.beat.load.get("running", 0)
        return local_share(step, itl_s) if itl_s and step and running else 1.0

    return [Candidate(i.id, queued_tokens=int(i.waiting_tokens), running=int(i.queue_depth),
                      local_blocks=matched.get(i.id, 0),
                      free_blocks=int(i.beat.load.get("free_blocks", 0)),
                      cost=CostModel.from_load(i.beat.load, cost), lora_missing=i.id in lora_missing,
                      share=share(i), pool=not i.beat.kv_unconvertible)
            for i in instances]


def choose_decode(instances: list[Instance], rank: int = 0) -> Instance:
    """The least loaded instance, then the one with the most free KV blocks; among equals, the first in id order
    rotated by ``rank`` (this router's place among its replicas: replicas that decide at the same moment, before
    each hears of the other's choice, break the tie towards different instances instead of herding)."""
    ids = sorted(i.id for i in instances)
    place = {iid: (n - rank) % len(ids) for n, iid in enumerate(ids)}
    return min(instances, key=lambda i: (i.queue_depth, -i.beat.load.get("free_blocks", 0), place[i.id]))


def _unknown(policy: str) -> ValueError:
    return ValueError(f"unknown routing policy {policy!r}; choose one of {sorted(choices(RoutingPolicy))}")


class Policies:
    """One instance of each policy (round robin keeps state), built from the router's settings."""

    def __init__(self, default: RoutingPolicy | str, cost: CostModel, slo_ttft_s: float) -> None:
        if default not in POLICIES:
            raise _unknown(default)
        self.default = RoutingPolicy(default)
        self.cost = cost
        self._policies: dict[RoutingPolicy, Policy] = {name: make_policy(name, cost, slo_ttft_s=slo_ttft_s)
                                                        for name in POLICIES}

    def get(self, name: str | None) -> Policy:
        """The named policy (a request's override) or the default; ValueError names the known ones."""
        if not name:
            return self._policies[self.default]
        if name not in self._policies:
            raise _unknown(name)
        return self._policies[name]

    def choose(self, name: str | None, instances: list[Instance], matched: dict[str, int], prompt_tokens: int,
               block_size: int, pool_blocks: int, lora_missing: frozenset[str] | set[str] = frozenset(),
               ttft_s: float = 0.0, itl_s: float = 0.0) -> tuple[Instance | None, Decision]:
        """``lora_missing``: instances lacking the request's adapter. The cache-aware policy prices loading it
        there (``CostModel.lora_load_s``); the others choose among the instances that hold it, if any do.
        ``ttft_s``: the request's TTFT target, which the cache-aware policy admits by (0: the configured one);
        ``itl_s``: its ITL target, under which an instance decoding streams prefills slower (``to_candidates``)."""
        policy = self.get(name)
        if lora_missing and not isinstance(policy, CacheAware) and len(lora_missing) < len(instances):
            instances = [i for i in instances if i.id not in lora_missing]
        candidates = to_candidates(instances, matched, self.cost, lora_missing, itl_s)
        decision = policy.choose(candidates, prompt_tokens, block_size, pool_blocks, ttft_s)
        chosen = next((i for i in instances if decision.chosen and i.id == decision.chosen.id), None)
        return chosen, decision
