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
