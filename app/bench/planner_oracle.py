"""How far below the static allocation's instance-hours any scaler could go on ``kvmesh bench planner``'s
scenarios, on the same simulated fleet: a clairvoyant scaler that knows the load profile (the phases' rate
multiple and the tenant surge, not the requests) and holds, for the highest multiple the next 75 s bring (what
an instance asked for now serves), the least pools that attain within ``--slack`` of each level's ceiling.

    python -m app.bench.planner_oracle [--scenario ramp|steps] [--slack 0.001] [--extra 0:0,0:1,1:1]

The per-level pools are found by replaying 400 s of the trace at each constant multiple (0.5 apart, 1x up to the
scenario's peak) on fleets of one size: the ceiling is the attainment of 24 + 24 instances, prefill is the least
count whose TTFT attainment comes within the slack of it (decode 24), decode the least whose ITL attainment
reaches 99.9% (prefill 24). ``--extra P:D`` adds that many instances to every level (a margin). Each row is one
replay of the scenario with that scaler; the static row is ``kvmesh bench planner``'s. What it shows: the
attainment a scaler that cannot be surprised reaches at what cost; a planner that must forecast can only do
worse on both.
"""

from __future__ import annotations

import argparse
import math
from collections.abc import Callable, Sequence

from kvmesh.planning import PlannerConfig

from app.bench.planner import SHAPES, SPEED, TARGETS, TRACE, Run, Shape, best_static, opening_sizes, scenario
from app.bench.trace import TraceRequest, load_trace
from app.fleet_sim import FleetModel, Scaler, Sizes, Window, replay

LOOKAHEAD_S = 75.0  # an instance asked for now serves after the 60 s start-up, for at least one 15 s window
LIMIT = 24


def multiple(shape: Shape, t: float) -> float:
    """The scenario's rate multiple at ``t`` (its phase's, plus the surge's 1x while it lasts)."""
    end = sum(p[0] for p in shape.phases)
    x, m = 0.0, shape.phases[-1][2]
    for seconds, m0, m1 in shape.phases:
        if t < x + seconds:
            m = m0 + (m1 - m0) * (t - x) / seconds
            break
        x += seconds
    surge0 = shape.surge_at * end
    return m + (1.0 if surge0 <= t < surge0 + shape.surge_s else 0.0)


def levels(base: Sequence[TraceRequest], model: FleetModel, peak: float, slack: float) -> dict[float, Sizes]:
    """The least pools near each constant multiple's ceiling, every 0.5 from 1 to ``peak``."""
    out: dict[float, Sizes] = {}
    m = 1.0
    while m <= peak + 1e-9:
        trace = scenario(base, [(400.0, m, m)], None)
        ceiling = replay(trace, model, Sizes(LIMIT, LIMIT))
        goal = sum(x <= TARGETS.ttft_s for x in ceiling.ttft_s) / len(trace) - slack
        p = next(n for n in range(1, LIMIT + 1) if n == LIMIT or sum(
            x <= TARGETS.ttft_s for x in replay(trace, model, Sizes(n, LIMIT)).ttft_s) / len(trace) >= goal)
        d = next(n for n in range(1, LIMIT + 1) if n == LIMIT or sum(
            x <= TARGETS.itl_s for x in replay(trace, model, Sizes(LIMIT, n)).itl_s) / len(trace) >= 0.999)
        out[m] = Sizes(p, d)
        m += 0.5
    return out


def oracle_scaler(shape: Shape, table: dict[float, Sizes], extra: Sizes) -> Callable[..., Scaler]:
    """Every window: the pools of the level at or above the highest multiple of the next ``LOOKAHEAD_S``."""
    keys = sorted(table)

    def make(*_: object) -> Scaler:
        def scale(w: Window) -> Sizes:
            m = max(multiple(shape, w.now + d) for d in range(0, int(LOOKAHEAD_S) + 1, 5))
            level = table[next((k for k in keys if k >= m - 1e-9), keys[-1])]
            over = max(0, math.ceil((m - keys[-1]) / 0.5))  # past the table: one more of each a half multiple
            return Sizes(level.prefill + extra.prefill + over, level.decode + extra.decode + over)
        return scale

    return make


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m app.bench.planner_oracle", description=__doc__.split("\n\n")[0])
    p.add_argument("--trace", default=TRACE)
    p.add_argument("--scenario", choices=tuple(SHAPES), default="ramp")
    p.add_argument("--slack", type=float, default=0.001, help="a level's pools come this close to its ceiling")
    p.add_argument("--extra", default="0:0,0:1,1:1", help="margins P:D added to every level, one row each")
    p.add_argument("--goal", type=float, default=0.95, help="the static allocation's goal, as the planner bench's")
    args = p.parse_args(argv)
    shape = SHAPES[args.scenario]
    base = load_trace(args.trace)
    end = sum(ph[0] for ph in shape.phases)
    trace = scenario(base, list(shape.phases), (shape.surge_at * end, shape.surge_s, 1.0))
    model = FleetModel(SPEED, startup_s=60.0)
    peak = max(max(m0, m1) for _, m0, m1 in shape.phases)
    table = levels(base, model, peak, args.slack)
    print("levels (multiple: prefill + decode): " + ", ".join(f"{m:g}x {s.prefill}+{s.decode}"
                                                                for m, s in table.items()))
    static, static_result, _ = best_static(trace, model, TARGETS, args.goal)
    rows = [Run(f"static {static.prefill}P+{static.decode}D", static_result).row(TARGETS)]
    config = PlannerConfig(speed=SPEED, startup_s=60.0, window_s=model.window_s)
    for margin in args.extra.split(","):
        dp, dd = (int(x) for x in margin.split(":"))
        scaler = oracle_scaler(shape, table, Sizes(dp, dd))()
        result = replay(trace, model, opening_sizes(trace, config, TARGETS), scaler)
        rows.append(Run(f"oracle, levels +{dp}P +{dd}D", result).row(TARGETS))
    hours = rows[0]["instance-hours"]
    print(f"scenario {shape.name}: {len(trace)} requests")
    for row in rows:
        print(f"{row['scaler']:>28}: SLO {row['SLO attainment']:6.2%} (TTFT {row['TTFT met']:6.2%}, ITL "
              f"{row['ITL met']:6.2%})  {row['instance-hours']:5.2f} instance-h ({row['instance-hours'] / hours:.2f}x)"
              f"  P {row['prefill min-max']}  D {row['decode min-max']}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
