"""``kvmesh bench planner``: the planner (``kvmesh.planning``) against a static allocation chosen in hindsight and
a plain utilisation autoscaler, on the Mooncake conversation trace replayed with a load ramp (1x, 2x, 4x, 2x, 1x
its rate) and a tenant surge, on the simulated PD fleet of ``app.fleet_sim`` (real routing and eviction code).

A request attains its SLO when its TTFT and its mean ITL both meet the targets. The static allocation is the
cheapest fixed (prefill, decode) pair whose attainment reaches ``--goal``, found by replaying each candidate; the
utilisation autoscaler is Kubernetes' HPA rule (desired = ceil(n x utilisation / target), a 10% tolerance, scale-in
stabilised over the last 300 s) on each pool's utilisation: prefill busy time, decode streams over the engine's
batch cap."""

from __future__ import annotations

import argparse
import json
import math
import sys
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, replace

from kvmesh.contracts.ids import Role
from kvmesh.planning import Observation, PlannerConfig, PlannerState, Speed, Targets, Traffic, plan

from app.bench.trace import TraceRequest, load_trace
from app.fleet_sim import FleetModel, Result, Scaler, Sizes, Window, replay

SECTION = "Planner on the simulated fleet (Mooncake trace, load ramp + tenant surge)"  # and the steps
TRACE = "/work/shared/data/traces/conversation_trace.jsonl"
TENANT_ID_OFFSET = 10**9  # the surging tenant's block ids: another cache salt, so nothing is shared

# a GPU-class instance (an 8B model on one accelerator, in round figures): 16k prefill tok/s, a decode step of
# 15 ms + 0.8 ms a stream, 1M tokens of KV; blocks of 512 tokens are 64 MiB, fetched at 10 GB/s
SPEED = Speed(prefill_tok_per_s=16000.0, prefill_overhead_s=0.03, step_base_s=0.015, step_per_stream_s=0.0008,
              kv_tokens=1_000_000.0)
TARGETS = Targets(ttft_s=4.0, itl_s=0.05)


RAMP = ((300, 1, 1), (150, 1, 2), (150, 2, 2), (150, 2, 4), (300, 4, 4), (300, 4, 1), (300, 1, 1))
# a second shape, so the planner is not judged on the scenario its defaults were chosen on: steps no trend
# foresees (1x to 3x and back at once), a ramp, and the tenant's surge in the middle instead of at the end
STEPS = ((240, 1, 1), (240, 3, 3), (240, 1.5, 1.5), (120, 1.5, 3.5), (240, 3.5, 3.5), (240, 1, 1), (200, 1, 1))


@dataclass(frozen=True)
class Shape:
    """A scenario: the phases ``(seconds, rate multiple at start, at end)``, and where the tenant surge falls
    (``surge_at``: its start as a share of the run, and its length in seconds; its rate is ``--surge``)."""

    name: str
    phases: tuple[tuple[float, float, float], ...]
    surge_at: float
    surge_s: float


SHAPES = {"ramp": Shape("ramp", RAMP, (1650 - 225) / 1650, 150),
          "steps": Shape("steps", STEPS, 600 / 1520, 120)}


def _elapsed(d_tau: float, seconds: float, m0: float, m1: float) -> float:
    """The seconds into a phase whose rate goes from ``m0`` to ``m1`` over ``seconds`` at which ``d_tau``
    seconds of the trace have played (the root of m0 s + (m1 - m0) s^2 / 2 seconds = d_tau)."""
    a = (m1 - m0) / (2 * seconds)
    if abs(a) < 1e-12:
        return d_tau / m0
    return (-m0 + math.sqrt(max(0.0, m0 * m0 + 4 * a * d_tau))) / (2 * a)


def scenario(trace: Sequence[TraceRequest], phases: Sequence[tuple[float, float, float]],
             surge: tuple[float, float, float] | None) -> list[TraceRequest]:
    """``trace`` replayed phase by phase, each ``(seconds, rate multiple at its start, at its end)`` with the
    multiple changing linearly (a second at 4x plays 4 s of the trace), plus a surge ``(start, seconds, rate
    multiple)`` of another tenant: the trace's first requests again at that rate, with block ids of their own."""
    out: list[TraceRequest] = []
    t0 = tau0 = 0.0
    it = iter(trace)
    r = next(it, None)
    for seconds, m0, m1 in phases:
        played = seconds * (m0 + m1) / 2
        while r is not None and r.arrival_s < tau0 + played:
            out.append(replace(r, arrival_s=t0 + _elapsed(r.arrival_s - tau0, seconds, m0, m1)))
            r = next(it, None)
        t0, tau0 = t0 + seconds, tau0 + played
    if surge is not None:
        start, seconds, mult = surge
        out += [replace(q, arrival_s=start + q.arrival_s / mult,
                        hash_ids=tuple(h + TENANT_ID_OFFSET for h in q.hash_ids))
                for q in trace if q.arrival_s < seconds * mult]
    return sorted(out, key=lambda q: q.arrival_s)


def planner_scaler(config: PlannerConfig, targets: Targets) -> Scaler:
    state, rates = PlannerState(), deque[float](maxlen=config.trend_windows)

    def scale(w: Window) -> Sizes:
        nonlocal state
        out = plan(Observation(w.now, w.fleet, w.traffic, targets, tuple(rates)), config, state,
                   {Role.PREFILL: w.sizes.prefill, Role.DECODE: w.sizes.decode})
        state = out.state
        rates.append(w.traffic.rate)
        return Sizes(out.target(Role.PREFILL) or w.sizes.prefill, out.target(Role.DECODE) or w.sizes.decode)

    return scale


def opening_sizes(trace: Sequence[TraceRequest], config: PlannerConfig, targets: Targets) -> Sizes:
    """What the planner asks for the trace's first window with no fleet yet: where both autoscalers start (a
    cold cache, so no hits)."""
    first = [q for q in trace if q.arrival_s < config.window_s]
    traffic = Traffic.of(config.window_s, [q.input_length for q in first], [q.output_length for q in first])
    out = plan(Observation(0.0, (), traffic, targets), config, PlannerState(), {Role.PREFILL: 1, Role.DECODE: 1})
    return Sizes(out.target(Role.PREFILL) or 1, out.target(Role.DECODE) or 1)


def utilisation_scaler(target: float, batch_cap: int, window_s: float, stabilise_s: float = 300.0,
                       tolerance: float = 0.1) -> Scaler:
    """Kubernetes' HPA rule on each pool's utilisation, as the HPA controller applies it: utilisation is
    measured on the ready pods, a pod still starting counts as capacity using nothing (so desired = ceil(ready
    pods' total utilisation / target), not the pool's size times the ready pods' mean: a pool is not grown
    again for the pods it is already starting), a scale-in is skipped while pods are starting, and scale-in is
    stabilised over the last ``stabilise_s`` (the highest recommendation wins)."""
    history: deque[Sizes] = deque(maxlen=max(1, round(stabilise_s / window_s)))

    def desired(n: int, ready: int, used: float) -> int:
        if ready == 0:
            return n
        ratio = used * ready / (target * n)  # the pods starting count at 0% utilisation
        want = n if abs(ratio - 1) <= tolerance else max(1, math.ceil(n * ratio))
        return n if want < n and ready < n else want

    def scale(w: Window) -> Sizes:
        ready_p = sum(i.role is Role.PREFILL for i in w.fleet)
        ready_d = sum(i.role is Role.DECODE for i in w.fleet)
        want = Sizes(desired(w.sizes.prefill, ready_p, w.prefill_busy),
                     desired(w.sizes.decode, ready_d, w.decode_busy / batch_cap))
        history.append(want)
        return Sizes(max(s.prefill for s in history), max(s.decode for s in history))

    return scale


@dataclass
class Run:
    name: str
    result: Result
    sizes: str = ""

    def row(self, targets: Targets) -> dict:
        r = self.result
        return {"scaler": self.name, "SLO attainment": r.attainment(targets.ttft_s, targets.itl_s),
                "TTFT met": sum(x <= targets.ttft_s for x in r.ttft_s) / len(r.ttft_s),
                "ITL met": sum(x <= targets.itl_s for x in r.itl_s) / len(r.itl_s),
                "instance-hours": r.instance_s / 3600,
                "prefill min-max": f"{min(s[1] for s in r.sizes)}-{max(s[1] for s in r.sizes)}",
                "decode min-max": f"{min(s[2] for s in r.sizes)}-{max(s[2] for s in r.sizes)}"}


def best_static(trace: list[TraceRequest], model: FleetModel, targets: Targets, goal: float,
                limit: int = 24) -> tuple[Sizes, Result, int]:
    """The cheapest fixed pair whose attainment reaches ``goal`` (else the best found): the least prefill whose
    TTFT attainment reaches it with decode to spare, the same for decode's ITL, then one more instance on the
    weaker side until the pair does. Returns the pair, its run and how many replays it took."""
    runs = 0

    def run(s: Sizes) -> Result:
        nonlocal runs
        runs += 1
        return replay(trace, model, s)

    def least(met: str, sizes: callable) -> int:  # type: ignore[valid-type]
        lo, hi = 1, limit
        while lo < hi:
            mid = (lo + hi) // 2
            r = run(sizes(mid))
            values = r.ttft_s if met == "ttft" else r.itl_s
            target = targets.ttft_s if met == "ttft" else targets.itl_s
            if sum(x <= target for x in values) / len(values) >= goal:
                hi = mid
            else:
                lo = mid + 1
        return lo

    p = least("ttft", lambda k: Sizes(k, limit))
    d = least("itl", lambda k: Sizes(limit, k))
    best = Sizes(p, d)
    result = run(best)
    while result.attainment(targets.ttft_s, targets.itl_s) < goal and best.prefill + best.decode < 2 * limit:
        ttft_met = sum(x <= targets.ttft_s for x in result.ttft_s)
        itl_met = sum(x <= targets.itl_s for x in result.itl_s)
        best = Sizes(best.prefill + 1, best.decode) if ttft_met <= itl_met else Sizes(best.prefill, best.decode + 1)
        result = run(best)
    return best, result, runs


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="kvmesh bench planner", description=__doc__.split("\n\n")[0])
    p.add_argument("--trace", default=TRACE, help="Mooncake-format JSONL trace")
    p.add_argument("--scenario", choices=(*SHAPES, "all"), default="all",
                   help="ramp: 1x 300 s, to 2x 150 s, 2x 150 s, to 4x 150 s, 4x 300 s, down to 1x 300 s, 1x 300 s, "
                        "the surge near the end; steps: 1x 240 s, 3x 240 s, 1.5x 240 s, to 3.5x 120 s, 3.5x 240 s, "
                        "1x 440 s, the surge at 600 s (the trace has 3,537 s)")
    p.add_argument("--time-scale", type=float, default=1.0, help="stretch the phases")
    p.add_argument("--surge", type=float, default=1.0, metavar="X",
                   help="the tenant surge's rate, a multiple of the trace's (0: none)")
    p.add_argument("--goal", type=float, default=0.95, help="the SLO attainment the static allocation must reach")
    p.add_argument("--startup-s", type=float, default=60.0, help="how long a new instance takes to serve")
    p.add_argument("--util-target", type=float, default=0.6, help="the utilisation autoscaler's target")
    p.add_argument("--batch-cap", type=int, default=64, help="decode streams per instance at 100%% utilisation")
    p.add_argument("--json", action="store_true")
    p.add_argument("--write", action="store_true", help="also write the tables into docs/benchmarks.md")
    args = p.parse_args(argv)
    try:
        base = load_trace(args.trace)
    except (OSError, ValueError) as e:
        print(f"kvmesh bench planner: {e}", file=sys.stderr)
        return 2
    shapes = list(SHAPES.values()) if args.scenario == "all" else [SHAPES[args.scenario]]
    results = [run_shape(base, shape, args) for shape in shapes]
    if args.json:
        print(json.dumps([{"scenario": r.shape.name, "rows": r.rows, "verdict": r.verdict, "requests": r.requests}
                          for r in results], indent=2))
    else:
        for r in results:
            print(f"scenario {r.shape.name}: {r.requests} requests")
            for row in r.rows:
                print(f"{row['scaler']:>55}: SLO {row['SLO attainment']:6.1%} (TTFT {row['TTFT met']:6.1%}, ITL "
                      f"{row['ITL met']:6.1%})  {row['instance-hours']:6.2f} instance-h ({row['vs static hours']})"
                      f"  P {row['prefill min-max']}  D {row['decode min-max']}")
            for name, ok in r.verdict.items():
                print(f"{name}: {'yes' if ok else 'NO'}")
    if args.write:
        _write(args, results)
    return 0


@dataclass
class ShapeResult:
    shape: Shape
    phases: list[tuple[float, float, float]]
    surge: tuple[float, float, float] | None
    requests: int
    rows: list[dict]
    verdict: dict[str, bool]


def run_shape(base: Sequence[TraceRequest], shape: Shape, args: argparse.Namespace) -> ShapeResult:
    """The three scalers on one scenario: the rows of its table and the verdicts."""
    phases = [(seconds * args.time_scale, m0, m1) for seconds, m0, m1 in shape.phases]
    end = sum(p[0] for p in phases)
    surge = (shape.surge_at * end, shape.surge_s * args.time_scale, args.surge) if args.surge > 0 else None
    trace = scenario(base, phases, surge)
    model = FleetModel(SPEED, startup_s=args.startup_s)
    config = PlannerConfig(speed=SPEED, startup_s=args.startup_s, window_s=model.window_s)
    static, static_result, replays = best_static(trace, model, TARGETS, args.goal)
    opening = opening_sizes(trace, config, TARGETS)
    runs = [Run(f"static {static.prefill}P+{static.decode}D (best in hindsight, {replays} replays)", static_result),
            Run(f"utilisation autoscaler (HPA rule, target {args.util_target:.0%})",
                replay(trace, model, opening, utilisation_scaler(args.util_target, args.batch_cap, model.window_s))),
            Run("planner (kvmesh.planning)", replay(trace, model, opening, planner_scaler(config, TARGETS)))]
    rows = [r.row(TARGETS) for r in runs]
    s_row, u_row, p_row = rows
    verdict = {
        "planner vs static: attainment >= and <= 0.8x instance-hours":
            p_row["SLO attainment"] >= s_row["SLO attainment"]
            and p_row["instance-hours"] <= 0.8 * s_row["instance-hours"],
        "planner vs utilisation: better on both":
            p_row["SLO attainment"] > u_row["SLO attainment"] and p_row["instance-hours"] < u_row["instance-hours"],
    }
    for row in rows:
        row["vs static hours"] = f"{row['instance-hours'] / s_row['instance-hours']:.2f}x"
    return ShapeResult(shape, phases, surge, len(trace), rows, verdict)


def _write(args: argparse.Namespace, results: list[ShapeResult]) -> None:
    from app.bench.report import markdown_table, write_section

    cols = ["scaler", "SLO attainment", "TTFT met", "ITL met", "instance-hours", "vs static hours",
            "prefill min-max", "decode min-max"]
    s = SPEED
    parts = [(f"Simulated PD fleet (`app/fleet_sim.py`: the real cache-aware routing and LRU eviction, the router's "
             f"decode choice): prefill {s.prefill_tok_per_s:.0f} tok/s + {s.prefill_overhead_s * 1e3:.0f} ms, decode "
             f"step {s.step_base_s * 1e3:.0f} ms + {s.step_per_stream_s * 1e3:.1f} ms a stream, "
             f"{s.kv_tokens / 1e6:g}M tokens of KV; a new instance serves {args.startup_s:.0f} s after it is asked "
             f"for; an instance scaled in drains. Targets: TTFT <= {TARGETS.ttft_s:g} s, mean ITL <= "
             f"{TARGETS.itl_s * 1e3:g} ms; a request attains its SLO when it meets both. Static: the cheapest fixed "
             f"pair reaching {args.goal:.0%} attainment, found by replaying. The utilisation autoscaler counts a "
             "starting pod as capacity at 0% (as the HPA controller does) rather than multiplying the ready pods' "
             "utilisation by the pool's size. Every scaler is asked every 15 s.")]
    for r in results:
        table = [{**row, "SLO attainment": f"{row['SLO attainment']:.1%}", "TTFT met": f"{row['TTFT met']:.1%}",
                  "ITL met": f"{row['ITL met']:.1%}", "instance-hours": f"{row['instance-hours']:.2f}"}
                 for row in r.rows]
        phases = ", ".join(f"{m0:g}x {sec:.0f} s" if m0 == m1 else f"{m0:g}x to {m1:g}x {sec:.0f} s"
                           for sec, m0, m1 in r.phases)
        surge = (f", plus another tenant's surge at {r.surge[2]:g}x the trace's rate for {r.surge[1]:.0f} s from "
                 f"{r.surge[0]:.0f} s (no prefix shared with the rest)" if r.surge else "")
        parts.append(f"**{r.shape.name}** ({r.requests} requests: `conversation_trace.jsonl` replayed at {phases}"
                     f"{surge}):\n\n" + markdown_table(table, cols) + "\n\n"
                     + "\n".join(f"- {name}: **{'yes' if ok else 'no'}**" for name, ok in r.verdict.items()))
    write_section(SECTION, "kvmesh bench planner --write", "\n\n".join(parts))


if __name__ == "__main__":
    sys.exit(main())
