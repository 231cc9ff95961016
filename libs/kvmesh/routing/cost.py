"""How long a prefill takes, from the engine's measured speed: a linear model in computed tokens, plus the
time to fetch blocks from the pool. Mooncake's estimated TTFT is built from these.

Each engine instance fits its own line (``SpeedEstimator``, fed by every forward step) and reports it in its
heartbeat ``load`` (``prefill_tok_per_s``, ``prefill_overhead_s``, ``kv_block_bytes``); the router turns that
into the instance's ``CostModel`` (``CostModel.from_load``). A key that is missing or not a sane number keeps
the router's configured value, so old engines and new routers (and the reverse) work together.
"""

from __future__ import annotations

import dataclasses
import math
import threading
from collections import deque
from dataclasses import dataclass
from typing import Any, NamedTuple

from kvmesh.contracts.engine import Speed
from kvmesh.contracts.ids import choices
from kvmesh.contracts.messages import InstanceLoad
from kvmesh.contracts.names import DisaggregationMode
from kvmesh.contracts.slo import ITL_HEADROOM


@dataclass(frozen=True)
class CostModel:
    prefill_tok_per_s: float = 240.0   # measured on this machine: SmolLM2-135M, 1 thread, fp32
    prefill_overhead_s: float = 0.03   # per prefill (first-token sampling, scheduling)
    fetch_gbps: float = 1.0            # pool → instance, per the transfer benchmark
    block_bytes: int = 737_280         # SmolLM2-135M fp32, 16-token blocks
    calibrated: bool = False           # the speed was measured on the instance itself, not configured
    lora_load_s: float = 0.25          # loading a LoRA adapter where it is missing (read + validate + register)

    def prefill_s(self, tokens: int) -> float:
        return self.prefill_overhead_s + max(0, tokens) / self.prefill_tok_per_s if tokens > 0 else 0.0

    def fetch_s(self, blocks: int) -> float:
        return blocks * self.block_bytes / (self.fetch_gbps * 1e9)

    @classmethod
    def from_load(cls, load: InstanceLoad, default: CostModel) -> CostModel | None:
        """An instance's model from its heartbeat's load: ``default`` with what the instance measured in place of
        the configured values; None when it reports nothing usable (an old engine)."""
        fields: dict[str, Any] = {}
        if (speed := load.speed.prefill_tok_per_s) is not None and speed > 0:
            fields.update(prefill_tok_per_s=speed, calibrated=True)
            if (overhead := load.speed.prefill_overhead_s) is not None:
                fields["prefill_overhead_s"] = overhead
        if load.kv_block_bytes >= 1:
            fields["block_bytes"] = load.kv_block_bytes
        if load.lora_load_s is not None:
            fields["lora_load_s"] = load.lora_load_s
        return dataclasses.replace(default, **fields) if fields else None


DISAGGREGATE_MODES = choices(DisaggregationMode)


class Disaggregation(NamedTuple):
    disaggregate: bool
    reason: str          # the route reason (a span attribute): which path and why
    pd_s: float = 0.0    # estimated TTFT through prefill + push
    local_s: float = 0.0  # estimated TTFT with decode computing the rest itself
    refuse: bool = False  # neither path meets the request's TTFT target (admission control)


class TTFTTarget(NamedTuple):
    """A request's TTFT target as the path choice weighs it: ``left_s``, what is left of it; the prompt tokens
    queued ahead of it at the prefill and at the decode instance; ``local_share``, the share of decode's steps its
    prompt tokens would get beside the streams decode runs (``local_share``)."""

    left_s: float
    prefill_queued: int = 0
    decode_queued: int = 0
    local_share: float = 1 / 3


def local_share(decode_step_s: float, itl_s: float) -> float:
    """The share of each of decode's steps that a prompt computed there gets beside its streams: what is left of
    a step planned within ``ITL_HEADROOM`` of the ITL target after its decode rows (``decode_step_s``, which
    decode reports); without a target or a measured step, a third (a mixed step costing 1.5 decode steps, the
    engine's best-effort cap)."""
    if not itl_s or not decode_step_s:
        return 1 / 3
    return min(0.9, max(0.1, 1 - decode_step_s / (ITL_HEADROOM * itl_s)))


def disaggregation(mode: DisaggregationMode | str, prompt_tokens: int, block_size: int,
                   prefill_hit_blocks: int, decode_hit_blocks: int, prefill: CostModel, decode: CostModel,
                   decode_running: int = 0, hop_s: float = 0.02,
                   ttft: TTFTTarget | None = None) -> Disaggregation:
    """Whether a request goes prefill → decode (PD) or decode computes what it lacks itself.

    PD: prefill computes the tokens it does not hold, then pushes the blocks decode lacks (``fetch_s`` of them)
    plus ``hop_s`` (the Prefill call, ``kv.ready``, decode's import). Local: decode computes the tokens it does
    not hold, and every stream it is decoding waits that long too (a prefill chunk in their steps), so the
    local estimate counts once per running stream plus the request itself. Decode computes locally only when it
    holds at least half the prompt: a long cold prefill on decode stalls every stream that joins later too,
    which a one-request estimate does not see, and keeping those off decode is what PD is for. ``mode``
    ``always`` / ``never`` forces PD / local (experiments).

    ``decode`` prices decode's own compute: give it the prefill instance's measured line when decode has none
    of its own for prompts (its steps are one token each, which pins down no speed).

    ``ttft`` (mode ``auto``, a request with a TTFT target): the path chosen so must meet it, counting the prompt
    tokens queued at each instance and, on decode, only its share of the steps beside its streams' ITL targets;
    else the other path if that one does (decode prefills a cold prompt while prefill is busy), else
    ``refuse``."""
    covered = lambda blocks: min(blocks * block_size, prompt_tokens - 1)  # the last token is always computed
    pd_s = (prefill.prefill_s(prompt_tokens - covered(prefill_hit_blocks))
            + decode.fetch_s(-(-prompt_tokens // block_size) - decode_hit_blocks) + hop_s)
    lacks = prompt_tokens - covered(decode_hit_blocks)
    local_s = decode.prefill_s(lacks) * (1 + max(0, decode_running))
    choice = _path(mode, prompt_tokens, block_size, decode_hit_blocks, lacks, decode_running, pd_s, local_s)
    if ttft is None or mode != DisaggregationMode.AUTO:
        return choice
    pd_t = prefill.prefill_s(ttft.prefill_queued) + pd_s
    local_t = decode.prefill_s(ttft.decode_queued + lacks) / ttft.local_share
    meets = {True: pd_t <= ttft.left_s, False: local_t <= ttft.left_s}
    if meets[choice.disaggregate]:
        return choice
    times = f"~{pd_t:.2f}s through prefill and its queue, ~{local_t:.2f}s on decode beside its streams"
    if meets[not choice.disaggregate]:
        path = "local" if choice.disaggregate else "pd"
        return Disaggregation(not choice.disaggregate, f"{path}: only it meets the TTFT target of {ttft.left_s:.2f}s "
                                                       f"({times})", pd_s, local_s)
    return Disaggregation(choice.disaggregate, f"no instance meets the TTFT SLO of {ttft.left_s:.2f}s ({times})",
                          pd_s, local_s, refuse=True)


def _path(mode: DisaggregationMode | str, prompt_tokens: int, block_size: int, decode_hit_blocks: int, lacks: int,
          decode_running: int, pd_s: float, local_s: float) -> Disaggregation:
    if mode == DisaggregationMode.ALWAYS:
        return Disaggregation(True, "pd: forced (disaggregate=always)", pd_s, local_s)
    if mode == DisaggregationMode.NEVER:
        return Disaggregation(False, "local: forced (disaggregate=never)", pd_s, local_s)
    if decode_hit_blocks * block_size * 2 < prompt_tokens:
        return Disaggregation(True, f"pd: decode holds {decode_hit_blocks} of {-(-prompt_tokens // block_size)} "
                                    f"blocks (less than half the prompt)", pd_s, local_s)
    if local_s <= pd_s:
        return Disaggregation(False, f"local: decode holds {decode_hit_blocks} blocks, computes the {lacks} tokens "
                                     f"it lacks in ~{local_s * 1e3:.0f} ms ({decode_running} streams wait) vs "
                                     f"~{pd_s * 1e3:.0f} ms through prefill", pd_s, local_s)
    return Disaggregation(True, f"pd: ~{pd_s * 1e3:.0f} ms through prefill vs ~{local_s * 1e3:.0f} ms for decode "
                                f"to compute the {lacks} tokens it lacks ({decode_running} streams wait)",
                          pd_s, local_s)


class SpeedFit(NamedTuple):
    overhead_s: float      # per forward step
    tok_per_s: float       # per computed token beyond that
    samples: int           # steps the fit kept (outliers left out)


class SpeedEstimator:
    """A weighted least-squares fit of ``step time = overhead + tokens / speed`` over an engine's recent
    forward steps (the last ``window``).

    - Weights halve every ``half_life`` steps, so the fit follows a machine that slows down or speeds up.
    - Outliers (a GC pause, a stolen CPU): a step more than ``outlier``× off the typical step, relative to the
      line, is left out and the line refitted (twice). The typical step is the weighted median, so a lasting
      change takes over once it holds half the weight, about ``half_life`` steps.
    - Overhead and speed are only told apart when the steps pin the speed down (the slope's standard error is
      under ``slope_error`` of it). Otherwise the last such line is kept, and its miss split between overhead
      and speed by which one dominates these steps: tiny prompts refit the overhead, long ones the speed.
    - The first ``warmup_steps`` steps pay one-off costs (lazy init, kernel compilation) and are skipped.

    ``observe`` (the engine thread, once per step) only records; ``fit`` (heartbeats, any thread) solves.
    """

    def __init__(self, prior: CostModel | None = None, window: int = 128, half_life: float = 32.0,
                 outlier: float = 3.0, slope_error: float = 0.2, warmup_steps: int = 1) -> None:
        prior = prior or CostModel()
        self._line = (prior.prefill_overhead_s, 1.0 / prior.prefill_tok_per_s)  # the last identified line
        self.decay = 0.5 ** (1.0 / half_life)
        self.outlier = outlier
        self.slope_error = slope_error
        self._skip = warmup_steps
        self._steps: deque[tuple[float, float]] = deque(maxlen=window)
        self._lock = threading.Lock()

    def observe(self, tokens: float, seconds: float) -> None:
        """One forward step that computed ``tokens`` tokens (or units of work) in ``seconds``."""
        if tokens <= 0 or not seconds > 0 or not math.isfinite(seconds):
            return
        if self._skip > 0:
            self._skip -= 1
            return
        with self._lock:
            self._steps.append((tokens, seconds))

    def fit(self) -> SpeedFit | None:
        """The current line; None before the first measured step."""
        with self._lock:
            steps = list(self._steps)
        if not steps:
            return None
        weights = [self.decay ** age for age in range(len(steps) - 1, -1, -1)]
        kept = list(range(len(steps)))
        (overhead, slope), identified = self._solve(steps, weights, kept)
        for _ in range(2):
            ratios = [t / (overhead + slope * n) for n, t in steps]
            typical = _weighted_median(ratios, weights)
            kept = [i for i, r in enumerate(ratios) if typical / self.outlier <= r <= typical * self.outlier]
            (overhead, slope), identified = self._solve(steps, weights, kept)
        if identified:
            self._line = (overhead, slope)
        return SpeedFit(overhead, 1.0 / slope, len(kept))

    def report(self) -> Speed:
        """The prefill line as the heartbeat carries it (unmeasured before the first step: the router keeps its
        configured speed)."""
        fit = self.fit()
        if fit is None:
            return Speed()
        return Speed(round(fit.tok_per_s, 3), round(fit.overhead_s, 6))

    def _solve(self, steps: list[tuple[float, float]], weights: list[float],
               kept: list[int]) -> tuple[tuple[float, float], bool]:
        """(overhead, seconds per token) of the kept steps, and whether the steps alone determined both."""
        w = w2 = sn = st = snn = snt = stt = 0.0
        for i in kept:
            (n, t), wi = steps[i], weights[i]
            w, w2, sn, st = w + wi, w2 + wi * wi, sn + wi * n, st + wi * t
            snn, snt, stt = snn + wi * n * n, snt + wi * n * t, stt + wi * t * t
        mean_n, mean_t = sn / w, st / w
        var_n, var_t = max(0.0, snn / w - mean_n ** 2), max(0.0, stt / w - mean_t ** 2)
        cov = snt / w - mean_n * mean_t
        if len(kept) >= 3 and var_n > 0 and cov > 0:
            residual = max(0.0, var_t - cov * cov / var_n)
            slope_var = residual / (var_n * max(1.0, w * w / w2 - 2))  # the slope's squared standard error
            identified = slope_var <= (self.slope_error * cov / var_n) ** 2
        else:
            identified = False
        if identified:
            slope = cov / var_n
            overhead = mean_t - slope * mean_n
            if overhead < 0:
                overhead, slope = 0.0, snt / snn
            return (overhead, slope), True
        a, s = self._line
        predicted = a + s * mean_n
        token_part = (s * mean_n) ** 4 / ((s * mean_n) ** 4 + a ** 4)  # ~1 where tokens dominate, else ~0
        overhead = a + (1 - token_part) * (mean_t - predicted)
        slope = s + token_part * (mean_t - predicted) / mean_n
        if overhead < 0 or slope <= 0:  # the miss is larger than the part it was given: scale the whole line
            overhead, slope = a * mean_t / predicted, s * mean_t / predicted
        return (overhead, slope), False


def _weighted_median(values: list[float], weights: list[float]) -> float:
    pairs = sorted(zip(values, weights))
    half, acc = sum(weights) / 2, 0.0
    for v, w in pairs:
        acc += w
        if acc >= half:
            return v
    return pairs[-1][0]
