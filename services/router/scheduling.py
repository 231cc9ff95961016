"""The router's side of scheduling: its records of live instances as the planner sees them (``view``: the one
place a heartbeat's load is read), and the configured and per-request routing policies. The decisions themselves
are ``kvmesh.routing.plan``'s; the helpers here answer in the registry's ``Instance`` records for the router's
other callers (choosing another prefill after one failed) and for tests."""

from __future__ import annotations

from kvmesh.contracts.ids import choices
from kvmesh.contracts.names import RoutingPolicy
from kvmesh.routing import POLICIES, Candidate, CostModel, Decision, Policy, make_policy
from kvmesh.routing.plan import POOL, FleetView, InstanceView, RouteAsk, candidates, choose
from kvmesh.routing.plan import choose_decode as choose_decode_view

from services.router.registry import Instance


def view(i: Instance, cost: CostModel, has_lora: bool = True) -> InstanceView:
    """``i`` as the planner sees it; ``cost``: the configured model, which what ``i`` measured overrides."""
    beat, c = i.beat, i.view_of
    # a view depends on the heartbeat (replaced, never changed in place), the routers' in-flight counts, the
    # configured model and the adapter: the same four, the same view
    if (c is not None and c[0] is beat and c[1] == i.inflight and c[2] == i.inflight_tokens
            and c[3] == i.peer_inflight and c[4] == i.peer_tokens and c[5] is cost and c[6] == has_lora):
        return c[7]
    made = InstanceView(i.id, str(beat.role), i.queue_depth, i.waiting_tokens, i.routed, i.running, i.free_blocks,
                        i.decode_step_s, i.cost_model(cost), beat.kv_layout, beat.kv_accepts, beat.kv_unconvertible,
                        has_lora, i.ahead_tokens)
    i.view_of = (beat, i.inflight, i.inflight_tokens, i.peer_inflight, i.peer_tokens, cost, has_lora, made)
    return made


def to_candidates(instances: list[Instance], matched: dict[str, int],
                  cost: CostModel | None = None, lora_missing: frozenset[str] | set[str] = frozenset(),
                  itl_s: float = 0.0) -> list[Candidate]:
    """The instances as the policies see them (``plan.candidates``)."""
    cost = cost or CostModel()
    return candidates([view(i, cost) for i in instances], matched, cost, lora_missing, itl_s)


def choose_decode(instances: list[Instance], rank: int = 0) -> Instance:
    """``plan.choose_decode`` among registry records."""
    chosen = choose_decode_view([view(i, CostModel()) for i in instances], rank)
    return next(i for i in instances if i.id == chosen.id)


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
        return self._policies[RoutingPolicy(name)]

    def choose(self, name: str | None, instances: list[Instance], matched: dict[str, int], prompt_tokens: int,
               block_size: int, pool_blocks: int, lora_missing: frozenset[str] | set[str] = frozenset(),
               ttft_s: float = 0.0, itl_s: float = 0.0) -> tuple[Instance | None, Decision]:
        """The named policy's choice among registry records (``plan.choose``). ``lora_missing``: instances
        lacking the request's adapter; ``ttft_s``: the request's TTFT target (0: the configured one); ``itl_s``:
        its ITL target."""
        views = [view(i, self.cost, i.id not in lora_missing) for i in instances]
        fleet = FleetView(tuple(views), {**matched, POOL: pool_blocks}, block_size, self.cost)
        ask = RouteAsk(prompt_tokens, name or self.default, explain=False)
        chosen, decision, _ = choose(self.get(name), "prefill", views, fleet, ask, ttft_s, itl_s)
        return next((i for i in instances if chosen and i.id == chosen.id), None), decision
