"""A request's latency targets (its SLO), how the inter-token target is read (a quantile of the request's
gaps), and their protocol codec. The router reads them off the request and admits by them; the engine sizes its
steps by them and counts the requests that met them (goodput)."""

from __future__ import annotations

import math
from dataclasses import dataclass

from kvmesh.proto.v1 import common_pb2

ITL_QUANTILE_PERCENT = 99  # the ITL target bounds this percentile of a request's inter-token gaps (p99)
ITL_HEADROOM = 0.85  # an engine plans each step to end within this share of its streams' tightest ITL target
MAX_TARGET_S = 3600.0


@dataclass(frozen=True)
class SLO:
    """Targets in seconds, 0 = none (an engine's default may apply): ``ttft_s``, time to first token from the
    request's arrival at the mesh; ``itl_s``, the p99 of its gaps between consecutive tokens."""

    ttft_s: float = 0.0
    itl_s: float = 0.0

    def __post_init__(self) -> None:
        for name in ("ttft_s", "itl_s"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) \
                    or not 0 <= value <= MAX_TARGET_S:
                raise ValueError(f"slo {name} must be a number of seconds in [0, {MAX_TARGET_S:g}] (0 = no "
                                 f"target), not {value!r}")

    def __bool__(self) -> bool:
        return bool(self.ttft_s or self.itl_s)

    def or_else(self, default: SLO) -> SLO:
        """These targets, ``default``'s where this one sets none."""
        return SLO(self.ttft_s or default.ttft_s, self.itl_s or default.itl_s)


NO_SLO = SLO()


def late_gaps_allowed(gaps: int) -> int:
    """How many of a request's ``gaps`` inter-token gaps may exceed its ITL target with the p99 of them still
    within it (nearest rank: the gap at rank ceil(0.99 n) is the p99)."""
    return gaps - (ITL_QUANTILE_PERCENT * gaps + 99) // 100 if gaps > 0 else 0


def slo_to_proto(slo: SLO) -> common_pb2.SLO:
    return common_pb2.SLO(ttft_s=slo.ttft_s, itl_s=slo.itl_s)


def slo_from_proto(msg: common_pb2.SLO) -> SLO:
    """ValueError naming the target that is out of range."""
    return SLO(msg.ttft_s, msg.itl_s)


NO_TARGET_HORIZON_S = 60.0  # a request with no TTFT target is ordered as if due this long after its arrival


class SloTrack:
    """One request against its targets as its tokens leave an engine that does not track them itself (vLLM): its
    TTFT deadline (``arrival + ttft_s``, None without a target, or for a migrated stream, whose first token came
    from another instance), and its gaps between tokens, late ones counted against ``itl_s``. ``due``: when it
    is due (its deadline, or ``NO_TARGET_HORIZON_S`` after arrival), the order an earliest-deadline-first
    scheduler serves requests in."""

    def __init__(self, targets: SLO, arrival: float, continued: bool = False) -> None:
        self.targets = targets
        self.deadline = arrival + targets.ttft_s if targets.ttft_s and not continued else None
        self.due = self.deadline if self.deadline is not None else arrival + NO_TARGET_HORIZON_S
        self.first: float | None = None
        self.last = 0.0
        self.gaps = self.late = 0

    def token(self, now: float) -> None:
        if self.first is None:
            self.first = now
        else:
            self.gaps += 1
            self.late += bool(self.targets.itl_s) and now - self.last > self.targets.itl_s
        self.last = now

    def met(self) -> tuple[bool, bool]:
        """Whether it met its TTFT and its ITL target (True where it has none)."""
        ttft = self.deadline is None or (self.first is not None and self.first <= self.deadline)
        return ttft, not self.targets.itl_s or self.late <= late_gaps_allowed(self.gaps)
