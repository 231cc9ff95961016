"""What the planner reads: each instance's heartbeat load (typed once, here), the traffic of the last window, the
latency targets, and how fast one instance of each pool is. Everything is a plain frozen value: the planner is a
function of these, with no clock and no I/O of its own."""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from dataclasses import dataclass

from kvmesh.contracts.ids import Role
from kvmesh.contracts.messages import InstanceLoad as HeartbeatLoad


@dataclass(frozen=True)
class InstanceLoad:
    """One engine instance as its last heartbeat reports it. 0 in a measured field: not reported (yet)."""

    id: str
    role: Role
    waiting_tokens: float = 0.0       # prompt tokens queued before a new one would start
    running: float = 0.0              # streams decoding
    kv_used: float = 0.0              # share of its KV blocks in use, [0, 1]
    kv_tokens: float = 0.0            # its KV capacity in tokens (total blocks x block size)
    prefill_tok_per_s: float = 0.0    # its measured prefill line (tokens/s + overhead per prefill)
    prefill_overhead_s: float = 0.0
    decode_step_s: float = 0.0        # its measured decode step with ``running`` + 1 streams

    @classmethod
    def from_beat(cls, instance_id: str, role: Role | str, load: HeartbeatLoad, block_size: int = 16) -> InstanceLoad:
        """A heartbeat's load (typed and checked as the heartbeat was decoded) in the planner's terms."""
        total, speed = load.total_blocks, load.speed
        return cls(instance_id, Role(role), waiting_tokens=load.waiting_tokens, running=load.running,
                   kv_used=min(1.0, max(0.0, 1 - load.free_blocks / total)) if total else 0.0,
                   kv_tokens=total * block_size, prefill_tok_per_s=speed.prefill_tok_per_s or 0.0,
                   prefill_overhead_s=speed.prefill_overhead_s or 0.0, decode_step_s=speed.decode_step_s or 0.0)


QUANTILES = 50  # how many evenly spaced prompt lengths ``Traffic.of`` keeps (the TTFT tail's shape)


@dataclass(frozen=True)
class Traffic:
    """Requests over the last window: their rate, prompt and output lengths, and the share of prompt tokens the
    caches served. ``prompt_sq_tokens``: the mean of the squared computed prompt lengths (the spread of prefill
    times, which sets queueing delay); 0 = treat as exponential. ``prompt_quantiles``: the computed prompt lengths
    at evenly spaced quantiles (each stands for as many requests; the shape of the TTFT tail); empty = exponential
    with the mean."""

    rate: float                   # requests/s
    prompt_tokens: float          # mean prompt length
    output_tokens: float          # mean output length
    hit_rate: float = 0.0         # share of prompt tokens served from a cache, [0, 1)
    prompt_sq_tokens: float = 0.0
    prompt_quantiles: tuple[float, ...] = ()

    @classmethod
    def of(cls, window_s: float, prompts: Sequence[int], outputs: Sequence[int], hit_tokens: int = 0) -> Traffic:
        """The traffic of ``len(prompts)`` requests that arrived within ``window_s``."""
        if not prompts or window_s <= 0:
            return cls(0.0, 0.0, 0.0)
        total = sum(prompts)
        hit = min(0.99, hit_tokens / total) if total else 0.0
        computed = sorted(p * (1 - hit) for p in prompts)
        k = min(QUANTILES, len(computed))
        return cls(len(prompts) / window_s, total / len(prompts), statistics.fmean(outputs) if outputs else 0.0,
                   hit, statistics.fmean(c * c for c in computed),
                   tuple(computed[int((i + 0.5) * len(computed) / k)] for i in range(k)))


@dataclass(frozen=True)
class Targets:
    """The latency targets the pools are sized for: TTFT and ITL in seconds."""

    ttft_s: float
    itl_s: float


@dataclass(frozen=True)
class Speed:
    """One instance's speed: prefill ``overhead + tokens / tok_per_s``; a decode step of B streams
    ``step_base_s + B * step_per_stream_s``; ``kv_tokens`` of KV. The configured (profiled) figures, which the
    fleet's measurements correct (``Speed.measured``)."""

    prefill_tok_per_s: float = 240.0
    prefill_overhead_s: float = 0.03
    step_base_s: float = 0.02
    step_per_stream_s: float = 0.002
    kv_tokens: float = 65536.0

    def prefill_s(self, tokens: float) -> float:
        return self.prefill_overhead_s + max(0.0, tokens) / self.prefill_tok_per_s

    def step_s(self, streams: float) -> float:
        return self.step_base_s + streams * self.step_per_stream_s

    def measured(self, fleet: Sequence[InstanceLoad]) -> Speed:
        """These figures corrected by what the instances report: the median measured prefill line, the median
        ratio of measured to modelled decode step scaling both step terms (Dynamo's correction factor), the
        median KV capacity. A figure nobody reports stays configured."""
        pre = [i for i in fleet if i.prefill_tok_per_s > 0]
        dec = [i.decode_step_s / self.step_s(i.running + 1) for i in fleet if i.decode_step_s > 0]
        kv = [i.kv_tokens for i in fleet if i.kv_tokens > 0]
        ratio = statistics.median(dec) if dec else 1.0
        return Speed(statistics.median(i.prefill_tok_per_s for i in pre) if pre else self.prefill_tok_per_s,
                     statistics.median(i.prefill_overhead_s for i in pre) if pre else self.prefill_overhead_s,
                     self.step_base_s * ratio, self.step_per_stream_s * ratio,
                     statistics.median(kv) if kv else self.kv_tokens)


def forecast(rates: Sequence[float], ahead: float, level_windows: int = 2) -> float:
    """The request rate ``ahead`` windows after the last of ``rates`` (one per window, oldest first): a
    least-squares line through them, never below the level now (the mean of the last ``level_windows``, two by
    default: one window is noisy) nor below 0 — a planner must not scale in on a trend, only on what it sees —
    and never above the level plus the rise the windows show (level - their least): a rise is not extrapolated
    past what has been seen to rise, so a trend fitted over a ramp does not run on past the ramp's end. Fewer
    than three windows: the level."""
    if not rates:
        return 0.0
    level = statistics.fmean(rates[-max(1, level_windows):])
    if len(rates) < 3:
        return level
    n = len(rates)
    xm, ym = (n - 1) / 2, statistics.fmean(rates)
    slope = sum((x - xm) * (y - ym) for x, y in enumerate(rates)) / sum((x - xm) ** 2 for x in range(n))
    trend = ym + slope * (n - 1 - xm + ahead)
    return max(level, min(trend, level + max(0.0, level - min(rates))), 0.0)
