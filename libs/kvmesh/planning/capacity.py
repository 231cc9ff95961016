"""How many instances a pool needs for a traffic at a latency target, from a queueing model over the measured
per-instance speed (the SLA arithmetic of Dynamo's planner, with llm-d's queueing view of a pool).

Prefill: requests queue for n identical servers; a request's service time is its prefill of the tokens the
caches do not hold. The mean wait is M/G/n's (Erlang C's M/M/n wait scaled by (1 + cs²)/2, the Lee-Longton
approximation). In ``prefill_need`` (and a ``both`` pool) a backlog the instances report counts as extra
arrivals to serve within the time new instances take to start. A pool meets the TTFT target when the mean
request's service plus that wait fits within ``headroom`` of it, and when the queue pushes at most a share
``miss`` of the requests past the target (``ttft_miss``: the wait's tail, Erlang C's probability of waiting
times an exponential with M/G/n's mean wait, over the window's spread of prompt lengths) — the mean alone does
not see the heavy-tailed prompts' tail.
The planner sizes that steady state at the rate sustained over an instance's start-up, and what a burst above it
adds by a fluid queue (``burst_prefill_need``): the backlog the instances report plus the forecast rate for one
window must leave each request's wait within the target, so a burst asks for the queue it builds, not for the
steady state of its rate.

Decode: a stream's tokens come one per step, a step of B streams costs ``step_base_s + B * step_per_stream_s``.
One instance holds at most the B whose step fits ``headroom`` of the ITL target, and whose KV fits; Little's law
gives the streams alive at once (rate x output tokens x step time); n = streams / B.

Role ``both``: an instance spends the share of its time its streams' steps take on decode, the rest prefills;
n is the least whose prefill, slowed so, meets the TTFT target."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

from kvmesh.contracts.slo import ITL_HEADROOM
from kvmesh.planning.signals import QUANTILES, Speed, Targets, Traffic

MAX_INSTANCES = 1024  # a search bound, not a policy: the planner's configured maximum applies on top


@dataclass(frozen=True)
class Need:
    """What a pool needs: ``instances`` (the least that meet the target; ``MAX_INSTANCES`` when none would),
    and why, in words."""

    instances: int
    reason: str
    feasible: bool = True


def erlang_c(servers: int, offered: float) -> float:
    """The probability that an arrival waits in M/M/``servers`` with ``offered`` = rate x mean service."""
    if offered <= 0:
        return 0.0
    if offered >= servers:
        return 1.0
    b = 1.0
    for k in range(1, servers + 1):  # Erlang B, by its stable recursion
        b = offered * b / (k + offered * b)
    rho = offered / servers
    return b / (1 - rho * (1 - b))


def prefill_wait_s(servers: int, traffic: Traffic, speed: Speed, slowdown: float = 1.0) -> float:
    """The mean queueing delay of a prefill on ``servers`` instances (inf when they cannot keep up);
    ``slowdown``: how much longer each prefill takes (an instance that also decodes)."""
    computed = traffic.prompt_tokens * (1 - traffic.hit_rate)
    mean = speed.prefill_s(computed) * slowdown
    if traffic.rate <= 0 or mean <= 0:
        return 0.0
    offered = traffic.rate * mean
    if offered >= servers:
        return math.inf
    sq = traffic.prompt_sq_tokens or 2 * computed ** 2  # exponential prompt lengths: E[x²] = 2 E[x]²
    o, v = speed.prefill_overhead_s, speed.prefill_tok_per_s
    second = (o * o + 2 * o * computed / v + sq / (v * v)) * slowdown ** 2
    cs2 = max(0.0, second / (mean * mean) - 1)
    return erlang_c(servers, offered) * mean / (servers - offered) * (1 + cs2) / 2


def ttft_miss(servers: int, traffic: Traffic, speed: Speed, target_s: float, slowdown: float = 1.0) -> float:
    """The share of requests whose wait for a prefill instance pushes their TTFT past ``target_s``: over the
    prompt lengths (``traffic.prompt_quantiles``, else exponential with the mean), P(W > target - own prefill),
    W's tail M/G/n's (wait with Erlang C's probability, then exponential with the mean of ``prefill_wait_s``).
    A prompt whose prefill alone exceeds the target misses whatever the pool: not counted (no size helps)."""
    computed = traffic.prompt_tokens * (1 - traffic.hit_rate)
    mean = speed.prefill_s(computed) * slowdown
    if traffic.rate <= 0 or mean <= 0:
        return 0.0
    sizes = traffic.prompt_quantiles or tuple(-computed * math.log(1 - (i + 0.5) / QUANTILES)
                                              for i in range(QUANTILES))
    offered = traffic.rate * mean
    feasible = [target_s - speed.prefill_s(x) * slowdown for x in sizes]
    feasible = [t for t in feasible if t >= 0]
    if offered >= servers:
        return len(feasible) / len(sizes)
    waits = erlang_c(servers, offered)
    if waits <= 0:
        return 0.0
    theta = prefill_wait_s(servers, traffic, speed, slowdown) / waits  # the mean wait of those that wait
    return sum(waits * math.exp(-t / theta) for t in feasible) / len(sizes)


def ttft_s(servers: int, traffic: Traffic, speed: Speed, slowdown: float = 1.0) -> float:
    """The modelled TTFT of the mean request on ``servers`` prefill instances."""
    computed = traffic.prompt_tokens * (1 - traffic.hit_rate)
    return speed.prefill_s(computed) * slowdown + prefill_wait_s(servers, traffic, speed, slowdown)


def with_backlog(traffic: Traffic, backlog_tokens: float, drain_s: float) -> Traffic:
    """``traffic`` plus the prompts it would take to bring ``backlog_tokens`` (queued now) in ``drain_s``: a
    backlog the model did not foresee is work the pool must clear by the time new instances could help."""
    computed = traffic.prompt_tokens * (1 - traffic.hit_rate)
    if backlog_tokens <= 0 or drain_s <= 0:
        return traffic
    if computed <= 0:
        return dataclasses.replace(traffic, rate=traffic.rate + 1 / drain_s, prompt_tokens=backlog_tokens,
                                   hit_rate=0.0, prompt_sq_tokens=0.0)
    return dataclasses.replace(traffic, rate=traffic.rate + backlog_tokens / computed / drain_s)


def queue_need(work_rate: float, backlog_s: float, horizon_s: float, budget_s: float) -> int:
    """The least instances whose queue, taken as a fluid, leaves each queued request at most ``budget_s`` of wait
    after ``horizon_s``: it starts at ``backlog_s`` instance-seconds of prefill queued and grows by ``work_rate``
    instance-seconds a second less the n the instances serve, so B + (W - n) h <= n b (a queue that drains
    meanwhile is not held to the budget now: no instance asked for now could help it sooner)."""
    if budget_s <= 0:
        return MAX_INSTANCES
    n = (backlog_s + work_rate * horizon_s) / (horizon_s + budget_s)
    return max(1, min(MAX_INSTANCES, math.ceil(n - 1e-9)))


def burst_prefill_need(sustained: Traffic, rate_ahead: float, speed: Speed, targets: Targets, headroom: float,
                       backlog_tokens: float = 0.0, window_s: float = 15.0, miss: float = 0.0,
                       tail_s: float | None = None) -> Need:
    """Prefill sized for a burst by how long it lasts: the steady-state queue (``prefill_need``) at the
    ``sustained`` rate (the level over the time a new instance takes to start), and, for load above it, a fluid
    queue (``queue_need``): the backlog the instances report plus ``rate_ahead`` for one window must leave each
    request's wait within ``headroom`` x the TTFT target less its mean prefill. A burst shorter than the
    sustained horizon so asks only for the queue it builds, not for the steady state of its rate; a rise that
    lasts lifts the level, and the backlog it leaves meanwhile is still served."""
    steady = prefill_need(sustained, speed, targets, headroom, miss=miss, tail_s=tail_s)
    service = speed.prefill_s(sustained.prompt_tokens * (1 - sustained.hit_rate))
    budget = headroom * targets.ttft_s - service
    if not steady.feasible or budget <= 0 or (rate_ahead <= 0 and backlog_tokens <= 0):
        return steady
    backlog_s = backlog_tokens / speed.prefill_tok_per_s
    fluid = queue_need(rate_ahead * service, backlog_s, window_s, budget)
    if fluid <= steady.instances:
        return steady
    return Need(fluid, f"backlog {backlog_s:.1f} instance-s + {rate_ahead:.2f} req/s x {service:.2f}s of prefill "
                       f"for {window_s:g}s leave each of {fluid} instance(s) a wait within {budget:.2f}s "
                       f"({headroom:.0%} of {targets.ttft_s:g}s less the mean prefill); sustained: {steady.reason}")


def prefill_need(traffic: Traffic, speed: Speed, targets: Targets, headroom: float,
                 backlog_tokens: float = 0.0, drain_s: float = 60.0, miss: float = 0.0,
                 tail_s: float | None = None) -> Need:
    """The least prefill instances whose modelled TTFT fits ``headroom`` x the target and, when ``miss`` > 0,
    whose queue pushes at most that share of the requests past ``tail_s`` (default: the target; ``ttft_miss``),
    for ``traffic`` and ``backlog_tokens`` queued now, cleared within ``drain_s`` (``with_backlog``)."""
    goal = headroom * targets.ttft_s
    tail = tail_s if tail_s is not None else targets.ttft_s
    traffic = with_backlog(traffic, backlog_tokens, drain_s)
    alone = speed.prefill_s(traffic.prompt_tokens * (1 - traffic.hit_rate))
    if traffic.rate <= 0 and backlog_tokens <= 0:
        return Need(1, "no prefill traffic")
    if alone > goal:
        return Need(_least_loaded(traffic, speed), f"the mean prefill alone ({alone:.2f}s) exceeds "
                                                   f"{headroom:.0%} of the TTFT target ({targets.ttft_s:g}s): "
                                                   "sized to keep up only", feasible=False)
    for n in range(1, MAX_INSTANCES + 1):
        t = ttft_s(n, traffic, speed)
        if t > goal:
            continue
        late = ttft_miss(n, traffic, speed, tail) if miss > 0 else 0.0
        if late <= miss:
            work = traffic.rate * speed.prefill_s(traffic.prompt_tokens * (1 - traffic.hit_rate))
            tail_note = f", {late:.2%} pushed past {tail:.2f}s by the queue (<= {miss:.2%})" if miss > 0 else ""
            return Need(n, f"{traffic.rate:.2f} req/s x {traffic.prompt_tokens:.0f} prompt tokens "
                           f"({traffic.hit_rate:.0%} cached) = {work:.2f} instance-s/s of prefill at "
                           f"{speed.prefill_tok_per_s:.0f} tok/s; backlog {backlog_tokens:.0f} tokens; "
                           f"{n} instance(s) give a modelled TTFT of {t:.2f}s <= {goal:.2f}s "
                           f"({headroom:.0%} of {targets.ttft_s:g}s){tail_note}")
    return Need(MAX_INSTANCES, "no instance count meets the TTFT target", feasible=False)


def _least_loaded(traffic: Traffic, speed: Speed) -> int:
    work = traffic.rate * speed.prefill_s(traffic.prompt_tokens * (1 - traffic.hit_rate))
    return max(1, math.ceil(work / 0.9))


def streams_per_instance(traffic: Traffic, speed: Speed, targets: Targets, headroom: float = ITL_HEADROOM) -> int:
    """The most streams one instance decodes with its step within ``headroom`` of the ITL target (by default the
    share an engine plans its steps to) and their KV (prompt + output) in its cache; 0: not even one."""
    by_itl = math.floor((headroom * targets.itl_s - speed.step_base_s) / speed.step_per_stream_s)
    per_stream = traffic.prompt_tokens + traffic.output_tokens
    by_kv = math.floor(speed.kv_tokens / per_stream) if per_stream > 0 else by_itl
    return max(0, min(by_itl, by_kv))


def decode_need(traffic: Traffic, speed: Speed, targets: Targets, headroom: float = ITL_HEADROOM,
                running: float = 0.0) -> Need:
    """The least decode instances that hold the streams alive at once (Little's law, or the ``running`` now
    when more) within the per-instance batch of ``streams_per_instance``."""
    batch = streams_per_instance(traffic, speed, targets, headroom)
    if batch < 1:
        return Need(MAX_INSTANCES, f"one stream's step ({speed.step_s(1):.3f}s) or KV "
                                   f"({traffic.prompt_tokens + traffic.output_tokens:.0f} tokens) does not fit "
                                   f"{headroom:.0%} of the ITL target ({targets.itl_s:g}s)", feasible=False)
    alive = traffic.rate * traffic.output_tokens * speed.step_s(batch)
    streams = max(alive, running)
    n = max(1, math.ceil(streams / batch))
    return Need(n, f"{traffic.rate:.2f} req/s x {traffic.output_tokens:.0f} output tokens keep {alive:.1f} "
                   f"streams alive ({running:.0f} running now); {batch} per instance keep a step of "
                   f"{speed.step_s(batch) * 1e3:.1f} ms within {headroom:.0%} of the ITL target "
                   f"({targets.itl_s * 1e3:g} ms) and their KV in {speed.kv_tokens:.0f} tokens")


def both_need(traffic: Traffic, speed: Speed, targets: Targets, headroom: float, itl_headroom: float = ITL_HEADROOM,
              backlog_tokens: float = 0.0, running: float = 0.0, drain_s: float = 60.0, miss: float = 0.0,
              tail_s: float | None = None) -> Need:
    """The least ``both`` instances: their streams take ``streams / (n x batch)`` of each one's time, and the
    prefills (and the backlog, ``with_backlog``), slowed by what is left, meet ``headroom`` of the TTFT target
    and the tail of ``prefill_need`` (``miss``, ``tail_s``)."""
    traffic = with_backlog(traffic, backlog_tokens, drain_s)
    batch = streams_per_instance(traffic, speed, targets, itl_headroom)
    if batch < 1:
        return decode_need(traffic, speed, targets, itl_headroom, running)
    streams = max(traffic.rate * traffic.output_tokens * speed.step_s(batch), running)
    goal = headroom * targets.ttft_s
    for n in range(max(1, math.ceil(streams / batch)), MAX_INSTANCES + 1):
        decode_share = streams / (n * batch)
        if decode_share >= 0.95:
            continue
        slowdown = 1 / (1 - decode_share)
        t = ttft_s(n, traffic, speed, slowdown)
        tail = tail_s if tail_s is not None else targets.ttft_s
        if t <= goal and (miss <= 0 or ttft_miss(n, traffic, speed, tail, slowdown) <= miss):
            return Need(n, f"{streams:.1f} streams take {decode_share:.0%} of each of {n} instance(s); the rest "
                           f"prefills {traffic.rate:.2f} req/s x {traffic.prompt_tokens:.0f} tokens "
                           f"({traffic.hit_rate:.0%} cached) with a modelled TTFT of {t:.2f}s <= {goal:.2f}s")
    return Need(MAX_INSTANCES, "no instance count meets both targets", feasible=False)
