"""How far a keep-time strategy can get on a trace: the fluid bound per feature set.

A keep-time strategy (``tailfirst``, ``ghost``, any learned per-class keep time) decides, when a block is used,
how long to keep it, from what it can see then: the block's class. Whatever it learns, it cannot beat the best
keep time per class chosen knowing each class's exact gap distribution on this very trace. That optimum, in the
fluid limit (the cache holds ``capacity`` blocks on average; Little's law), is a concave-hull problem per class
with one price on block-time (LHD, Beckmann et al., NSDI'18). It reproduces LRU exactly with one class, and
with an oracle feature "this block is used again" comes within 1% of Belady: so it measures how much a feature
set can tell.

    python -m app.bench.eviction_bound --trace T --capacity 6000 --features t,ut,utd,utdc,utdcgL,R

Features (each a letter): u uses so far (0-3+), t a request's last block (a tail), d depth (log2), c the
conversation's turn (how often the chain in front came back), g the block's previous reuse gap (log2), L the
request's length (log2); R is the oracle (used again: yes/no), for reference.
"""

from __future__ import annotations

import argparse
import bisect
import math
from collections import defaultdict

from app.bench.trace import TraceRequest, load_trace


def _log2(x: float) -> int:
    return min(16, int(math.log2(x))) if 0 < x < math.inf else -1


def accesses(trace: list[TraceRequest]) -> tuple[list[float], list[dict[str, object]]]:
    """Per block access (the simulator's clock): the gap to the block's next access (``inf``: none) and what a
    cache can see at the access."""
    gaps: list[float] = []
    seen: list[dict[str, object]] = []
    state: dict[int, tuple[int, float, int, int]] = {}  # block -> (uses, clock, its access index, turn)
    children: dict[int, int] = defaultdict(int)
    clock = 0
    for r in trace:
        ids = r.hash_ids
        turn_in_front = 0
        for d, i in enumerate(ids):
            clock += 1
            s = state.get(i)
            if s is None:
                uses, gap, turn = 0, math.inf, turn_in_front
                if d:
                    children[ids[d - 1]] += 1
            else:
                gaps[s[2]] = clock - s[1]
                uses, gap, turn = s[0] + 1, clock - s[1], max(s[3] + 1, turn_in_front)
            seen.append({"u": min(uses, 3), "t": d == len(ids) - 1, "d": _log2(d + 1), "c": min(turn, 4),
                         "g": _log2(gap), "L": _log2(len(ids))})
            state[i] = (uses, clock, len(gaps), turn)
            gaps.append(math.inf)
            turn_in_front = turn if children[i] <= 2 else 0  # a prefix shared by many chains starts none
    return gaps, seen


def _hull(gaps: list[float], grid: list[float]) -> list[tuple[float, float]]:
    """Upper concave hull of (block-time used, reuses caught) over keep times ``grid``, from keeping nothing."""
    finite = sorted(g for g in gaps if g < math.inf)
    prefix = [0.0]
    for g in finite:
        prefix.append(prefix[-1] + g)
    hull: list[tuple[float, float]] = []
    for p in [(0.0, 0.0)] + [(prefix[k] + t * (len(gaps) - k), float(k))
                             for t in grid for k in [bisect.bisect_right(finite, t)]]:
        while len(hull) >= 2 and ((hull[-1][1] - hull[-2][1]) * (p[0] - hull[-2][0])
                                  <= (p[1] - hull[-2][1]) * (hull[-1][0] - hull[-2][0])):
            hull.pop()
        hull.append(p)
    return hull


def bound(gaps: list[float], seen: list[dict[str, object]], features: str, capacity: int) -> tuple[float, int]:
    """The fluid optimum's block hit rate with classes ``features``, and the number of classes."""
    by: dict[tuple, list[float]] = defaultdict(list)
    for g, s in zip(gaps, seen):
        by[tuple(g < math.inf if f == "R" else s[f] for f in features.strip("-"))].append(g)
    grid = [2 ** (x / 4) for x in range(80)]
    hulls = [_hull(gs, grid) for gs in by.values()]
    budget = capacity * len(gaps)  # block-time: ``capacity`` blocks held over the trace's clock

    def solve(price: float) -> tuple[float, float]:
        used = caught = 0.0
        for hull in hulls:
            x, y = max(hull, key=lambda p: p[1] - price * p[0])
            used, caught = used + x, caught + y
        return used, caught

    lo, hi = 1e-12, 1.0
    for _ in range(60):
        mid = math.sqrt(lo * hi)
        lo, hi = (mid, hi) if solve(mid)[0] > budget else (lo, mid)
    (u0, c0), (u1, c1) = solve(lo), solve(hi)  # the budget falls between two vertices: admit a fraction
    w = (budget - u1) / (u0 - u1) if u0 != u1 else 0.0
    return (c1 + w * (c0 - c1)) / len(gaps), len(hulls)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m app.bench.eviction_bound", description=__doc__.split("\n\n")[0])
    p.add_argument("--trace", required=True)
    p.add_argument("--capacity", default="6000", help="blocks, comma-separated")
    p.add_argument("--features", default="-,t,ut,utd,utdc,utdcg,utdcgL,R", help="- = one class (LRU)")
    p.add_argument("--max-requests", type=int)
    args = p.parse_args(argv)
    gaps, seen = accesses(load_trace(args.trace, args.max_requests))
    print("| features | classes | " + " | ".join(f"{int(c):,} blocks" for c in args.capacity.split(",")) + " |")
    print("|---|---|" + "---|" * len(args.capacity.split(",")))
    for features in args.features.split(","):
        cells = [bound(gaps, seen, features, int(c)) for c in args.capacity.split(",")]
        print(f"| {features} | {cells[0][1]} | " + " | ".join(f"{h * 100:.1f}%" for h, _ in cells) + " |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
