"""Route planning: where one request runs, decided from a snapshot of the fleet, with nothing done.

``plan(ask, fleet, policy)`` returns a typed plan: ``Local`` (one instance computes the prompt and decodes),
``PD`` (a prefill instance computes it and pushes its KV to a decode instance), ``Refuse`` (no path meets the
request's TTFT target), or None (no instance is up). The router's dispatcher (``services/router/core.py``) runs
the plan and owns everything that happens after: the calls, retries, migration, spans. Like Dynamo's KV router,
this module only decides; it does not send you there.

The rules, in order:

- **Prefill and decode instances are up**: the policy picks the prefill instance; decode is the session's
  instance when the session has one that is not overloaded, else the least loaded decode that holds the request's
  adapter and can take the prefill's KV (``can_hand_off``: equal layouts, or the cast the decode names). No such
  decode: ``Local`` on a decode, which computes the prompt itself. Otherwise the cost model weighs the hop
  (``disaggregation``): ``PD``, ``Local`` (decode holds about as much as prefill), or ``Refuse``.
- **Only role-both instances**: the session's instance, else the policy's choice among them. Sticky until
  saturated: when the policy prices each instance's TTFT (``cache_aware``: its queue, and what it holds of the
  prompt, the session's KV at home included), the session leaves its instance for one the policy expects to
  serve it ``session_move_margin_s`` sooner; under any policy, when its instance has ``session_overload`` more
  requests.
- **Only decode instances**: the session's instance, else the least loaded decode.

Pure but for the policy object, which may keep state of its own (round robin's turn).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from kvmesh.contracts.engine import AHEAD_EDGES_S, SessionHint
from kvmesh.contracts.layout import KVLayout, converter
from kvmesh.routing.cost import CostModel, TTFTTarget, disaggregation, local_share
from kvmesh.routing.policies import CacheAware, Candidate, Decision, Policy, lowest

POOL = "pool"  # the matched-blocks key of the cache service's own tiers
LISTED = 16    # a span names at most this many candidates of a role (the chosen one among them)


@dataclass(frozen=True)
class InstanceView:
    """What a plan knows of one live instance (a snapshot of the router's record of it)."""

    id: str
    role: str
    queue_depth: float = 0.0     # requests running or queued there (reported, or what routers sent: the larger)
    waiting_tokens: float = 0.0  # prompt tokens it will compute before a new one
    routed: int = 0              # requests the routers know they sent there
    running: float = 0.0         # sequences it reports running
    free_blocks: int = 0
    decode_step_s: float = 0.0   # its measured decode step (0: not reported)
    cost: CostModel | None = None  # its measured cost model (None: the configured one prices it)
    kv_layout: KVLayout | None = None
    kv_accepts: tuple[str, ...] = ()
    kv_unconvertible: str = ""
    has_lora: bool = True        # it holds the request's adapter (or the request names none)
    # least work first: of ``waiting_tokens``, those a new prompt with each edge of ``AHEAD_EDGES_S`` seconds of
    # compute would wait for (it passes the others); empty: arrival order, all of them
    ahead: tuple[int, ...] = ()

    def tokens_ahead(self, compute_s: float) -> float:
        """The queued prompt tokens a new prompt with ``compute_s`` seconds of compute to its first token waits for
        here: all of them in arrival order; with least work first, those of the first edge at or past it."""
        if self.ahead:
            for edge, tokens in zip(AHEAD_EDGES_S, self.ahead, strict=True):
                if compute_s <= edge:
                    return min(self.waiting_tokens, tokens)
        return self.waiting_tokens


@dataclass(frozen=True)
class FleetView:
    """The live instances a request may go to (those it must avoid left out) and what the index says of them."""

    instances: tuple[InstanceView, ...]
    matched: Mapping[str, int]   # leading prompt blocks held, per instance id (``POOL``: the pool's)
    block_size: int
    cost: CostModel              # the configured cost model
    replica_rank: int = 0        # this router's place among its replicas (breaks decode ties apart)
    bus_up: bool = True          # NATS reachable: a push can be announced
    session_home: str | None = None  # the instance the request's session last ran on
    session_overload: int = 2    # queued or running more than the least loaded by this much: the session moves
    session_move_margin_s: float = 0.25  # cache_aware: another instance this much sooner (estimated): it moves

    def of_role(self, role: str) -> list[InstanceView]:
        return [i for i in self.instances if i.role == role]


@dataclass(frozen=True)
class RouteAsk:
    """What a plan needs of the request."""

    prompt_tokens: int
    policy_name: str             # the policy's name, for the spans
    ttft_s: float = 0.0          # what is left of its TTFT target (0: none)
    itl_s: float = 0.0           # its ITL target (0: none)
    disaggregate: str = "auto"
    session: SessionHint | None = None
    explain: bool = True         # the per-candidate span attributes (a span that records); the choice is the same


@dataclass(frozen=True)
class Local:
    """``instance`` computes the prompt and decodes it."""

    instance: str
    reason: str = ""
    attributes: Mapping[str, Any] = field(default_factory=dict)
    session_at: str | None = None   # where the request's session is recorded to have run
    session_moved: bool = False     # it left its session's overloaded instance


@dataclass(frozen=True)
class PD:
    """``prefill`` computes the prompt and pushes its KV to ``decode``; ``expected_prefill_s``: the estimate of
    prefill + push, past which decode's wait for the KV is measured."""

    prefill: str
    decode: str
    reason: str
    expected_prefill_s: float
    attributes: Mapping[str, Any] = field(default_factory=dict)
    session_at: str | None = None
    session_moved: bool = False


@dataclass(frozen=True)
class Refuse:
    """No path meets the request's TTFT target (admission control)."""

    reason: str
    attributes: Mapping[str, Any] = field(default_factory=dict)
    session_at: str | None = None
    session_moved: bool = False


Plan = Local | PD | Refuse


def plan(ask: RouteAsk, fleet: FleetView, policy: Policy) -> Plan | None:
    """Where the request runs (None: no instance is up); see the module docstring for the rules."""
    prefills, decodes = fleet.of_role("prefill"), fleet.of_role("decode")
    if prefills and decodes:
        return _pd_or_local(ask, fleet, policy, prefills, decodes)
    both = fleet.of_role("both")
    if both:
        attrs: dict[str, Any] = {"kvmesh.route.path": "local", "kvmesh.route.reason": "local: role both"}
        home, why, moved = place_session(fleet.session_home, _with_lora(both), fleet.session_overload)
        picked: tuple[InstanceView | None, Decision, dict[str, Any]] | None = None
        if home is not None and isinstance(policy, CacheAware):  # priced: the one choice serves both questions
            picked = choose(policy, "both", both, fleet, ask, ask.ttft_s, ask.itl_s)
            home, why, moved = _sooner_elsewhere(home, why, picked[0], picked[1], fleet.session_move_margin_s)
        if why:
            attrs["kvmesh.route.session"] = why
        if home is None:
            chosen, decision, choice = picked or choose(policy, "both", both, fleet, ask, ask.ttft_s, ask.itl_s)
            attrs.update(choice)
            if chosen is None:
                return Refuse(decision.reason, attrs, None, moved)
            home = chosen
        return Local(home.id, "", attrs, home.id, moved)
    if decodes:  # every prefill instance is gone: decode computes the prompt itself rather than refuse
        reason = "local: no prefill instance is up"
        candidates = _with_lora(decodes)
        home, _, moved = place_session(fleet.session_home, candidates, fleet.session_overload)
        decode = home or choose_decode(candidates, fleet.replica_rank)
        return Local(decode.id, reason, {"kvmesh.route.path": "local", "kvmesh.route.reason": reason}, decode.id,
                     moved)
    return None


def _pd_or_local(ask: RouteAsk, fleet: FleetView, policy: Policy, prefills: list[InstanceView],
                 decodes: list[InstanceView]) -> Plan:
    # a request's own TTFT target is held by the path choice below (prefill's queue, or decode beside its
    # streams), not by the prefill instance alone
    prefill, decision, attrs = choose(policy, "prefill", prefills, fleet, ask,
                                      0.0 if ask.ttft_s and ask.disaggregate == "auto" else ask.ttft_s)
    if prefill is None:
        return Refuse(decision.reason, attrs)
    # a push is only ever sent where its bytes mean the same
    holders = [i for i in decodes if i.has_lora]
    paired = [i for i in holders or decodes if can_hand_off(prefill, i)]
    home, why, moved = place_session(fleet.session_home, paired or holders or decodes, fleet.session_overload)
    decode = home or choose_decode(paired or holders or decodes, fleet.replica_rank)
    if not paired:
        reason = f"local: no decode takes {prefill.id}'s KV layout"
        return Local(decode.id, reason, {**attrs, "kvmesh.route.path": "local", "kvmesh.route.reason": reason},
                     decode.id, moved)
    if ask.explain:
        attrs.update(route_attributes("decode", _listed(decodes, decode, {}), {}, decode, len(decodes)))
    else:
        attrs["kvmesh.route.decode.choice"] = decode.id
    if why:
        attrs["kvmesh.route.session"] = why
    d = _path(ask, fleet, prefill, decode)
    attrs.update({"kvmesh.route.path": "pd" if d.disaggregate else "local", "kvmesh.route.reason": d.reason,
                  "kvmesh.route.pd_ms": round(d.pd_s * 1e3, 1), "kvmesh.route.local_ms": round(d.local_s * 1e3, 1)})
    if d.refuse:
        return Refuse(d.reason, attrs, decode.id, moved)
    if not d.disaggregate:
        return Local(decode.id, d.reason, attrs, decode.id, moved)
    return PD(prefill.id, decode.id, d.reason, d.pd_s, attrs, decode.id, moved)


def _path(ask: RouteAsk, fleet: FleetView, prefill: InstanceView, decode: InstanceView) -> Any:
    """Whether the hop to decode pays (``disaggregation``). One line prices both computes: the same model on the
    same kind of machine, and a decode instance's own fit comes from one-token steps, which pin down no prompt
    speed. The streams decode runs: what the routers have in flight there (a heartbeat lags)."""
    speed = prefill.cost or fleet.cost
    target = TTFTTarget(ask.ttft_s, int(prefill.waiting_tokens), int(decode.waiting_tokens),
                        local_share(decode.decode_step_s, ask.itl_s)) if ask.ttft_s else None
    d = disaggregation(ask.disaggregate, ask.prompt_tokens, fleet.block_size, fleet.matched.get(prefill.id, 0),
                       fleet.matched.get(decode.id, 0), speed, speed, decode.routed, ttft=target)
    if d.disaggregate and not fleet.bus_up:  # kv.ready would wait out decode's kv_timeout_s
        d = d._replace(disaggregate=False, reason="local: NATS is unreachable, so no kv.ready could announce a push")
    return d


def choose(policy: Policy, role: str, instances: list[InstanceView], fleet: FleetView, ask: RouteAsk,
           ttft_s: float = 0.0, itl_s: float = 0.0) -> tuple[InstanceView | None, Decision, dict[str, Any]]:
    """The policy's choice among ``instances`` (None: admission refused it), its decision, and the span
    attributes that say so. Instances lacking the request's adapter: the cache-aware policy prices loading it
    there; the others choose among the instances that hold it, if any do."""
    missing = {i.id for i in instances if not i.has_lora}
    pool = instances
    if missing and not isinstance(policy, CacheAware) and len(missing) < len(instances):
        pool = [i for i in instances if i.id not in missing]
    decision = policy.choose(candidates(pool, fleet.matched, fleet.cost, missing, itl_s, ask.prompt_tokens,
                                        fleet.block_size), ask.prompt_tokens,
                             fleet.block_size, fleet.matched.get(POOL, 0), ttft_s)
    chosen = next((i for i in pool if decision.chosen and i.id == decision.chosen.id), None)
    attrs: dict[str, Any] = {f"kvmesh.route.{role}.choice": (chosen or instances[0]).id,
                             f"kvmesh.route.{role}.policy": ask.policy_name,
                             f"kvmesh.route.{role}.reason": decision.reason}
    if ask.explain:
        listed = _listed(instances, chosen, decision.scores)
        attrs.update(route_attributes(role, listed, fleet.matched, chosen or instances[0], len(instances)))
        ids = {i.id for i in listed}
        attrs[f"kvmesh.route.{role}.estimates"] = [f"{k}={v:.3f}" for k, v in decision.scores.items() if k in ids]
    return chosen, decision, attrs


def _listed(instances: list[InstanceView], chosen: InstanceView | None,
            scores: Mapping[str, float]) -> list[InstanceView]:
    """The candidates a span names: all of a fleet of up to ``LISTED``; of a larger one the chosen and those with
    the lowest estimates (no estimates: the least queued), in the fleet's order."""
    if len(instances) <= LISTED:
        return instances
    others = [i for i in instances if i is not chosen]
    keep = {others[k].id for k in lowest([scores.get(i.id, i.queue_depth) for i in others], LISTED - 1)}
    if chosen is not None:
        keep.add(chosen.id)
    return [i for i in instances if i.id in keep]


def candidates(instances: Sequence[InstanceView], matched: Mapping[str, int], cost: CostModel | None = None,
               lora_missing: frozenset[str] | set[str] = frozenset(), itl_s: float = 0.0, prompt_tokens: int = 0,
               block_size: int = 0) -> list[Candidate]:
    """The instances as the policies see them. ``itl_s``: the request's ITL target: an instance that decodes
    streams and sizes its steps by their targets (it reports its decode step) computes a prompt only in what
    each step has left beside them (``local_share``), so its prefill is priced that much slower. With the
    request's ``prompt_tokens`` and the ``block_size``, an instance that serves least work first is queued with
    only what the request would wait for there (``InstanceView.tokens_ahead`` of its compute past the blocks the
    instance holds); else with its whole queue. An instance with streams running is in the middle of a decode
    step when the request arrives: half its measured step (the mean of what is left of it) comes first."""
    def share(i: InstanceView) -> float:
        return local_share(i.decode_step_s, itl_s) if itl_s and i.decode_step_s and i.running else 1.0

    get = matched.get
    default = cost or CostModel()

    def ahead(i: InstanceView) -> int:  # least work first: what this request waits for there
        own = prompt_tokens - min(get(i.id, 0) * block_size, prompt_tokens - 1)
        return int(i.tokens_ahead((i.cost or default).prefill_s(own)))

    # positional, in Candidate's field order: a large fleet builds one per instance per request, and keywords
    # cost twice as much (and an arrival-order instance's queue is read inline, not through a call)
    return [Candidate(i.id, ahead(i) if i.ahead and prompt_tokens else int(i.waiting_tokens), int(i.queue_depth),
                      get(i.id, 0), i.free_blocks, i.cost,
                      i.id in lora_missing, share(i) if itl_s else 1.0, not i.kv_unconvertible,
                      i.decode_step_s / 2 if i.running else 0.0)
            for i in instances]


def choose_decode(instances: Sequence[InstanceView], rank: int = 0) -> InstanceView:
    """The least loaded instance, then the one with the most free KV blocks; among equals, the first in id order
    rotated by ``rank`` (this router's place among its replicas: replicas that decide at the same moment, before
    each hears of the other's choice, break the tie towards different instances instead of herding)."""
    ids = sorted(i.id for i in instances)
    place = {iid: (n - rank) % len(ids) for n, iid in enumerate(ids)}
    return min(instances, key=lambda i: (i.queue_depth, -i.free_blocks, place[i.id]))


def place_session(home_id: str | None, candidates: Sequence[InstanceView],
                  overload: int) -> tuple[InstanceView | None, str, bool]:
    """The candidate a session stays on (None: choose as for any request), why, and whether it left an
    overloaded instance: a session stays where its KV is unless that instance has ``overload`` more requests
    queued or running than the least loaded candidate; then its KV follows through the pool."""
    if home_id is None:
        return None, "", False
    home = next((i for i in candidates if i.id == home_id), None)
    if home is None:
        return None, f"session: its instance {home_id} is gone", False
    least = min(i.queue_depth for i in candidates)
    if home.queue_depth - least >= overload:
        return None, (f"session: {home.id} is overloaded ({home.queue_depth:g} queued or running, "
                      f"{least:g} on the least loaded): moved through the pool"), True
    return home, f"session: stays on {home.id}, where its KV is", False


def _sooner_elsewhere(home: InstanceView, why: str, chosen: InstanceView | None, decision: Decision,
                      margin_s: float) -> tuple[InstanceView | None, str, bool]:
    """A session's ``home`` that is not overloaded, weighed by the policy's choice and TTFT estimates (what each
    instance holds of the prompt counted): it moves (None) when ``chosen`` is expected to serve it ``margin_s``
    sooner."""
    est = decision.scores
    if chosen is None or chosen.id == home.id or home.id not in est or chosen.id not in est:
        return home, why, False
    if est[chosen.id] + margin_s < est[home.id]:
        return None, (f"session: {chosen.id} serves it sooner ({est[chosen.id]:.3f} s estimated, "
                      f"{est[home.id]:.3f} s on {home.id}, its KV counted)"), True
    return home, why, False


def can_hand_off(a: InstanceView, b: InstanceView) -> bool:
    """Whether a push from ``a`` means the same to ``b``: neither says its KV cannot be converted, and their KV
    layouts are equal or differ in the dtype alone with ``b`` naming ``a``'s (it casts on intake). An instance
    that did not say its layout is taken at its word that model and block size match."""
    if a.kv_unconvertible or b.kv_unconvertible:
        return False
    la, lb = a.kv_layout, b.kv_layout
    if la is None or lb is None:
        return True
    how = converter(la, lb)
    return how == "" or (how is not None and la.dtype in b.kv_accepts)


def route_attributes(role: str, instances: Sequence[InstanceView], matched: Mapping[str, int],
                     chosen: InstanceView, total: int = 0) -> dict[str, Any]:
    """``router.route`` attributes for one choice: the candidates, their scores (leading blocks cached there,
    queue depth, waiting tokens) and the one chosen; ``total``: the candidates there were, when ``instances``
    lists only some."""
    attrs: dict[str, Any] = {
        f"kvmesh.route.{role}.candidates": [c.id for c in instances],
        f"kvmesh.route.{role}.scores": [f"cached_blocks={matched.get(c.id, 0)} queue={c.queue_depth:g} "
                                        f"waiting_tokens={c.waiting_tokens:g}" for c in instances],
        f"kvmesh.route.{role}.choice": chosen.id}
    if total > len(instances):
        attrs[f"kvmesh.route.{role}.candidates_total"] = total
    return attrs


def _with_lora(instances: list[InstanceView]) -> list[InstanceView]:
    return [i for i in instances if i.has_lora] or instances
