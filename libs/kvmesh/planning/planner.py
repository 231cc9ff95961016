"""The planner's decision: how many instances each pool should have now, and why, from one observation of the
fleet (``Observation``) and the planner's own memory (``PlannerState``). A pure function: the caller owns the
clock, the heartbeats and the actuator; the same inputs give the same plan.

Scaling out is immediate, sized for the forecast rate over the time a new instance takes to start (prefill: its
steady state at the rate sustained over that time, a burst by the queue it builds on the backlog now). Scaling in
needs three things: fewer instances meet the targets with a tighter TTFT headroom (``down_headroom``, a band
that keeps the two decisions apart; the TTFT tail is held to the target tightened in proportion), that has held for
``down_delay_s`` (sized for the most needed while it held), and the last change is ``cooldown_s`` old. So a
pool neither flaps on noise nor scales in on a dip that an instance's start-up could not follow back."""

from __future__ import annotations

import dataclasses
import math
import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from kvmesh.contracts.ids import Role
from kvmesh.contracts.slo import ITL_HEADROOM
from kvmesh.planning.capacity import Need, both_need, burst_prefill_need, decode_need
from kvmesh.planning.signals import InstanceLoad, Speed, Targets, Traffic, forecast

POOL_ROLES = (Role.PREFILL, Role.DECODE, Role.BOTH)


@dataclass(frozen=True)
class PlannerConfig:
    """The planner's knobs. ``headroom``: the share of the TTFT target a pool is sized to (the rest absorbs the
    spread the model does not see; the ITL target's share is ``ITL_HEADROOM``, what an engine plans its steps
    to); ``down_headroom``: the tighter share of the TTFT target fewer instances must meet before the pool
    scales in (the TTFT tail's target tightens in proportion; the ITL share does not: a decode pool's size is
    already a whole batch of streams per instance, so one fewer meeting the same share for ``down_delay_s`` is
    the band). ``startup_s``: how long a new instance takes to serve; ``window_s``: one
    observation's window (the forecast looks ``startup_s + window_s`` ahead, along the trend of the last
    ``trend_windows``). ``kv_high``: the KV utilisation
    above which a decode pool grows whatever the model says (KV the model does not see: long sessions, pinned
    prefixes). ``ttft_miss``: the share of requests a prefill pool's queue may push past the TTFT target (the
    wait's tail over the window's prompt lengths; prompts whose prefill alone exceeds the target are not counted,
    no size helps them); 0 sizes on the mean TTFT alone."""

    speed: Speed = field(default_factory=Speed)
    headroom: float = 0.45
    down_headroom: float = 0.35
    down_delay_s: float = 120.0
    cooldown_s: float = 30.0
    startup_s: float = 30.0
    window_s: float = 15.0
    trend_windows: int = 6
    kv_high: float = 0.85
    ttft_miss: float = 0.01
    min_instances: Mapping[Role, int] = field(default_factory=lambda: {r: 1 for r in POOL_ROLES})
    max_instances: Mapping[Role, int] = field(default_factory=lambda: {r: 64 for r in POOL_ROLES})

    @property
    def sustain_windows(self) -> int:
        """How many windows a rate must last to count as sustained for prefill's steady state: those a new
        instance takes to start (a burst that ends sooner is over before an instance asked for it would serve)."""
        return max(2, round(self.startup_s / self.window_s))

    def clamp(self, role: Role, n: int) -> int:
        return max(self.min_instances.get(role, 1), min(self.max_instances.get(role, 64), n))


@dataclass(frozen=True)
class Observation:
    """What the planner sees at ``now``: the live instances (their last heartbeats), the traffic of the last
    window, the request rate of each window before it (oldest first; the forecast's history), the targets."""

    now: float
    fleet: Sequence[InstanceLoad]
    traffic: Traffic
    targets: Targets
    rates: Sequence[float] = ()
    ttft_s: float = 0.0  # the mean TTFT the routers measured over the window (0: not measured)


@dataclass(frozen=True)
class PoolState:
    """A pool's memory between plans: when it last changed size, since when fewer instances would do (None:
    not now) and the most needed since then."""

    last_change: float = -math.inf
    low_since: float | None = None
    low_peak: int = 0


@dataclass(frozen=True)
class PlannerState:
    pools: Mapping[Role, PoolState] = field(default_factory=dict)

    def of(self, role: Role) -> PoolState:
        return self.pools.get(role, PoolState())


@dataclass(frozen=True)
class PoolPlan:
    """One pool's answer: ``current`` instances (live and starting) → ``target``; ``action`` is ``out``,
    ``in`` or ``hold``; ``reason`` says why in words."""

    role: Role
    current: int
    target: int
    action: str
    reason: str
    feasible: bool = True


@dataclass(frozen=True)
class Plan:
    pools: tuple[PoolPlan, ...]
    state: PlannerState

    def target(self, role: Role) -> int | None:
        return next((p.target for p in self.pools if p.role is role), None)

    def describe(self) -> str:
        return "\n".join(f"{p.role}: {p.current} -> {p.target} ({p.action}): {p.reason}" for p in self.pools)


def pools_of(fleet: Sequence[InstanceLoad]) -> dict[Role, int]:
    """The size of each pool the fleet has (instances by role)."""
    out: dict[Role, int] = {}
    for i in fleet:
        if i.role in POOL_ROLES:
            out[i.role] = out.get(i.role, 0) + 1
    return out


def need(role: Role, obs: Observation, traffic: Traffic, speed: Speed, headroom: float,
         itl_headroom: float = ITL_HEADROOM, drain_s: float = 60.0, miss: float = 0.0,
         tail_s: float | None = None, sustained: float | None = None, window_s: float = 15.0) -> Need:
    """What ``role``'s pool needs for ``traffic`` (the forecast) at ``headroom`` of the TTFT target and
    ``itl_headroom`` of the ITL target, with at most ``miss`` of the requests queued past ``tail_s`` (default the
    TTFT target), counting the streams its instances report now and their backlog, cleared within ``drain_s``
    (a ``both`` pool). A prefill pool's steady state is sized at the ``sustained`` rate (default the forecast's)
    and the rest by the queue the forecast builds over ``window_s`` on the backlog (``burst_prefill_need``)."""
    members = [i for i in obs.fleet if i.role is role]
    backlog = sum(i.waiting_tokens for i in members)
    running = sum(i.running for i in members)
    if role is Role.PREFILL:
        steady = dataclasses.replace(traffic, rate=traffic.rate if sustained is None else sustained)
        return burst_prefill_need(steady, traffic.rate, speed, obs.targets, headroom, backlog, window_s, miss, tail_s)
    if role is Role.DECODE:
        return decode_need(traffic, speed, obs.targets, itl_headroom, running)
    return both_need(traffic, speed, obs.targets, headroom, itl_headroom, backlog, running, drain_s, miss, tail_s)


def _kv_floor(role: Role, obs: Observation, current: int, kv_high: float) -> tuple[int, str]:
    """The size that brings the pool's mean KV utilisation under ``kv_high`` (0 when it is under already)."""
    if role is Role.PREFILL:
        return 0, ""
    used = [i.kv_used for i in obs.fleet if i.role is role]
    mean = statistics.fmean(used) if used else 0.0
    if mean <= kv_high:
        return 0, ""
    n = math.ceil(current * mean / kv_high)
    return n, f"; KV {mean:.0%} used, above {kv_high:.0%}: at least {n}"


def _ttft_floor(role: Role, obs: Observation, current: int, headroom: float) -> tuple[int, str]:
    """The size the measured TTFT asks of a prefill (or both) pool (0 when it meets ``headroom`` of the target or
    is not measured): time the model does not see (a busy host, an engine's queue, the hand-off) is still TTFT,
    so the pool grows in proportion to how far the window's mean is past the goal, at most doubling a plan."""
    goal = headroom * obs.targets.ttft_s
    if role is Role.DECODE or obs.ttft_s <= goal:
        return 0, ""
    n = min(2 * current, max(current + 1, math.ceil(current * obs.ttft_s / goal)))
    return n, f"; measured TTFT {obs.ttft_s:.2f}s, past {goal:.2f}s: at least {n}"


def plan(obs: Observation, config: PlannerConfig, state: PlannerState,
         current: Mapping[Role, int] | None = None) -> Plan:
    """Each pool's target size. ``current``: each pool's size now, starting instances included (default: the
    live fleet's); a pool is planned when it has a size here."""
    current = dict(current) if current is not None else pools_of(obs.fleet)
    speed = config.speed.measured(obs.fleet)
    ahead = (config.startup_s + config.window_s) / config.window_s
    history = [*obs.rates, obs.traffic.rate][-config.trend_windows:]
    rate = forecast(history, ahead)
    sustained = forecast(history, ahead, config.sustain_windows)
    traffic = dataclasses.replace(obs.traffic, rate=rate)
    pools: list[PoolPlan] = []
    states: dict[Role, PoolState] = dict(state.pools)
    for role in (r for r in POOL_ROLES if r in current):
        cur, mem = current[role], state.of(role)
        drain = config.startup_s + config.window_s
        up = need(role, obs, traffic, speed, config.headroom, drain_s=drain, miss=config.ttft_miss,
                  sustained=sustained, window_s=config.window_s)
        kv_floor, kv_note = _kv_floor(role, obs, cur, config.kv_high)
        ttft_floor, ttft_note = _ttft_floor(role, obs, cur, config.headroom)
        floor, kv_note = max(kv_floor, ttft_floor), kv_note + ttft_note
        want = config.clamp(role, max(up.instances, floor))
        forecast_note = f" (forecast {rate:.2f} req/s over the next {config.startup_s + config.window_s:g}s)" \
            if rate > obs.traffic.rate else ""
        if want > cur:
            pools.append(PoolPlan(role, cur, want, "out", f"scale out: {up.reason}{forecast_note}{kv_note}",
                                  up.feasible))
            states[role] = PoolState(last_change=obs.now)
            continue
        down = need(role, obs, traffic, speed, config.down_headroom, ITL_HEADROOM, drain, config.ttft_miss,
                    obs.targets.ttft_s * config.down_headroom / config.headroom, sustained, config.window_s)
        fewer = config.clamp(role, max(down.instances, floor, want))
        if fewer >= cur:
            pools.append(PoolPlan(role, cur, cur, "hold", f"hold: {up.reason}{forecast_note}{kv_note}",
                                  up.feasible))
            states[role] = PoolState(mem.last_change)
            continue
        since = mem.low_since if mem.low_since is not None else obs.now
        peak = max(mem.low_peak, fewer)
        waited, calm = obs.now - since, obs.now - mem.last_change
        if waited >= config.down_delay_s and calm >= config.cooldown_s and peak < cur:
            pools.append(PoolPlan(role, cur, peak, "in", f"scale in: {peak} instance(s) have met the targets "
                                  f"within {config.down_headroom:.0%} for {waited:.0f}s: {down.reason}"))
            states[role] = PoolState(last_change=obs.now)
            continue
        wait = max(config.down_delay_s - waited, config.cooldown_s - calm)
        pools.append(PoolPlan(role, cur, cur, "hold", f"hold: {peak} instance(s) would do; scaling in if that "
                              f"holds {max(0.0, wait):.0f}s more: {down.reason}"))
        states[role] = PoolState(mem.last_change, since, peak)
    return Plan(tuple(pools), PlannerState(states))
