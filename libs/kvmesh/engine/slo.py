"""The step budget by SLO: how many prompt tokens the next step may carry beside the running decode rows, and
which prompts get them first.

The running streams' ITL targets cap a step: it is planned to end within ``HEADROOM`` of the tightest target
(streams without a target are held back by the best-effort rule instead, ``scheduler.chunk_budget``). The
waiting prompts' TTFT targets order the prompts (earliest deadline first, among those that can still make it at
full speed; the rest keep their arrival order behind them) and say how many tokens a step must carry for them
to make it. When that is more than the streams' cap, the streams may lend: a step may run past their ITL
targets only while every stream with a target can still take a late gap within its p99
(``Sequence.late_allowance``; a stream without a target always lends). Such a step (a burst) carries what the
prompts need for the remaining steps to fit under the cap again. Otherwise the cap holds and the prompt may miss:
a stream's ITL is not traded for one prompt's TTFT beyond its own p99.

Pure functions of the engine's measured step costs, so they are tested without a model.
"""

from __future__ import annotations

import math
from collections.abc import Sequence as Seq
from typing import NamedTuple

from kvmesh.engine.scheduler import MIN_CHUNK
from kvmesh.engine.sequence import Sequence

HEADROOM = 0.85      # a step is planned to end this share of the tightest ITL target after the one before
TTFT_HEADROOM = 0.9  # a prompt is planned to finish within this share of the time left to its deadline
BURST_MARGIN = 1.25  # a burst carries this much more than the bare need (the cost line is an estimate)
URGENT, IN_TURN = 0, 1  # Sequence.slo_rank's first field: a prompt that can still make its deadline, the others


class StepCost(NamedTuple):
    """What a step costs here: ``decode_s``, the decode-only step of the running batch; ``token_s``, what each
    prompt token adds to it (both measured by the engine's owner)."""

    decode_s: float
    token_s: float

    def step_s(self, tokens: int) -> float:
        return self.decode_s + tokens * self.token_s


class Plan(NamedTuple):
    tokens: int | None  # prompt tokens the step may carry beside the decode rows (None: no cap)
    burst: bool         # the step runs past the streams' ITL targets (they lend a late gap each)
    reason: str


def _need(pending: list[tuple[int, float]], cost: StepCost) -> float:
    """The tokens a step must carry, at a constant chunk per step, for every prompt in ``pending`` (cumulative
    tokens, seconds left, in deadline order) to finish in time; inf when some cannot at any chunk."""
    need = 0.0
    for tokens, left in pending:
        spare = left - tokens * cost.token_s  # what the steps' fixed part may take
        if spare <= 0:
            return math.inf
        need = max(need, tokens * cost.decode_s / spare)
    return need


def _burst(pending: list[tuple[int, float]], cost: StepCost, cap: int) -> float:
    """Tokens of one step so that, at ``cap`` per step afterwards, every prompt in ``pending`` finishes in time."""
    pace = cap / cost.step_s(cap)  # prompt tokens a second at the cap
    worst = 0.0
    for tokens, left in pending:
        # cost.step_s(B) + (tokens - B) / pace <= left
        worst = max(worst, (cost.decode_s + tokens / pace - left) / (1 / pace - cost.token_s))
    return worst


def rank_prompts(now: float, prompts: Seq[Sequence], cost: StepCost, budget: int) -> list[tuple[int, float]]:
    """Set each prompt's ``slo_rank`` (deadline first among those that can still make it at full speed, the
    others in arrival order behind them) and return the urgent ones as (cumulative tokens, seconds left to plan
    with: ``TTFT_HEADROOM`` of the time to the deadline) in deadline order. Full speed: steps of ``budget``
    tokens beside the decode rows."""
    for p in prompts:
        p.slo_rank = (IN_TURN, 0.0)
    timed = sorted((p for p in prompts if p.ttft_deadline is not None), key=lambda p: p.ttft_deadline)
    pending, total = [], 0
    for p in timed:
        tokens = total + p.num_uncomputed
        left = TTFT_HEADROOM * (p.ttft_deadline - now)
        full_speed = tokens * cost.token_s + math.ceil(tokens / max(1, budget)) * cost.decode_s
        if full_speed > left:
            continue  # it misses whatever this step does: it keeps its turn, the others are not held up
        total = tokens
        p.slo_rank = (URGENT, p.ttft_deadline)
        pending.append((tokens, left))
    return pending


def plan_step(now: float, decoding: Seq[Sequence], prompts: Seq[Sequence], cost: StepCost, budget: int,
              best_effort: int | None) -> Plan:
    """The next step's prompt tokens beside ``decoding`` (the running decode rows), ``prompts`` (waiting or
    computing their prompt) ranked by their deadlines. ``budget``: the engine's token budget of a step;
    ``best_effort``: the cap that holds streams without an ITL target back (``chunk_budget``)."""
    pending = rank_prompts(now, prompts, cost, budget)
    if not decoding:
        return Plan(None, False, "no stream decoding: the whole budget")
    targets = [s.itl_target for s in decoding if s.itl_target > 0]
    caps = []
    if targets:
        caps.append(max(MIN_CHUNK, int((HEADROOM * min(targets) - cost.decode_s) / cost.token_s)))
    if best_effort is not None and len(targets) < len(decoding):
        caps.append(best_effort)
    if not caps:
        return Plan(None, False, "no cap")
    cap = min(caps)
    need = _need(pending, cost) if pending else 0.0
    if need <= cap:
        return Plan(cap, False, f"cap {cap}: the prompts' deadlines need {math.ceil(need)} a step")
    lenders = all(s.late_allowance > 0 for s in decoding if s.itl_target > 0)
    if not lenders:
        return Plan(cap, False, f"cap {cap}: the prompts need {need:.0f} a step, the streams have no late gap left")
    tokens = min(budget, max(cap + 1, math.ceil(BURST_MARGIN * _burst(pending, cost, cap))))
    return Plan(tokens, True, f"burst of {tokens}: the prompts need {need:.0f} a step at cap {cap}")
