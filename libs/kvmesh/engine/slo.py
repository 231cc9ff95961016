"""The step budget by SLO: how many prompt tokens the next step may carry beside the running decode rows, and
which prompts get them first.

The running streams' ITL targets cap a step: it is planned to end within ``HEADROOM`` of the tightest target
(``SPENT_HEADROOM`` for a stream with no late gap left to lose; streams without a target are held back by the
best-effort rule instead, ``scheduler.chunk_budget``). A prompt's tokens cost more the later they sit in it (their
attention covers the ones before: ``StepCost.work``). The
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

from kvmesh.contracts.slo import ITL_HEADROOM
from kvmesh.engine.scheduler import MIN_CHUNK
from kvmesh.engine.sequence import Sequence

HEADROOM = ITL_HEADROOM  # a step is planned to end this share of the tightest ITL target after the one before
SPENT_HEADROOM = 0.7  # ... of the target of a stream with no late gap left to lose
TTFT_HEADROOM = 0.9  # a prompt is planned to finish within this share of the time left to its deadline
BURST_MARGIN = 1.25  # a burst carries this much more than the bare need (the cost line is an estimate)
URGENT, IN_TURN = 0, 1  # Sequence.slo_rank's first field: a prompt that can still make its deadline, the others


class StepCost(NamedTuple):
    """What a step costs here: ``decode_s``, the decode-only step of the running batch; ``token_s``, what each
    prompt token adds to it at the positions the last steps computed (both measured by the engine's owner);
    ``context``: the position at which a prompt token's attention (over the tokens before it) costs as much as
    its matmuls, so a token at position p costs ``1 + p / context`` in units of one at position 0 (0: ignore
    the position)."""

    decode_s: float
    token_s: float
    context: float = 0.0

    def step_s(self, tokens: int) -> float:
        return self.decode_s + tokens * self.token_s

    def work(self, first: int, end: int, at: int) -> float:
        """Tokens ``first .. end - 1`` of a prompt in units of a prompt token at position ``at``."""
        if not self.context:
            return float(end - first)
        return (end - first) * (1 + (first + end - 1) / (2 * self.context)) / (1 + at / self.context)


class Plan(NamedTuple):
    tokens: int | None  # prompt tokens the step may carry beside the decode rows (None: no cap)
    burst: bool         # the step runs past the streams' ITL targets (they lend a late gap each)
    reason: str


class Due(NamedTuple):
    """The prompts up to one deadline, in deadline order: their tokens and their work (``StepCost.work``) left,
    and the seconds left to plan with."""

    tokens: int
    work: float
    left: float


def _need(pending: list[Due], cost: StepCost) -> float:
    """The tokens a step must carry, at a constant chunk per step, for every prompt in ``pending`` to finish in
    time; inf when some cannot at any chunk."""
    need = 0.0
    for d in pending:
        spare = d.left - d.work * cost.token_s  # what the steps' fixed part may take
        if spare <= 0:
            return math.inf
        need = max(need, d.tokens * cost.decode_s / spare)
    return need


def _burst(pending: list[Due], cost: StepCost, cap: int) -> float:
    """Tokens of one step so that, at ``cap`` per step afterwards, every prompt in ``pending`` finishes in time."""
    worst = 0.0
    for d in pending:
        per_token = cost.token_s * d.work / d.tokens  # these prompts' tokens cost this on average
        pace = cap / (cost.decode_s + cap * per_token)  # prompt tokens a second at the cap
        # decode_s + B * per_token + (tokens - B) / pace <= left
        worst = max(worst, (cost.decode_s + d.tokens / pace - d.left) / (1 / pace - per_token))
    return worst


def rank_prompts(now: float, prompts: Seq[Sequence], cost: StepCost, budget: int) -> list[Due]:
    """Set each prompt's ``slo_rank`` (deadline first among those that can still make it at full speed, the
    others in arrival order behind them) and return the urgent ones' ``Due`` s, with ``TTFT_HEADROOM`` of the time
    to each deadline to plan with (one that makes it only without the headroom gets the largest steps the streams
    can lend). Full speed: steps of ``budget`` tokens beside the decode rows."""
    for p in prompts:
        p.slo_rank = (IN_TURN, 0.0)
    timed = sorted((p for p in prompts if p.ttft_deadline is not None), key=lambda p: p.ttft_deadline)
    at = timed[0].num_computed_tokens if timed else 0  # where the steps measured lately computed, about
    pending: list[Due] = []
    tokens, work = 0, 0.0
    for p in timed:
        more = cost.work(p.num_computed_tokens, p.num_tokens, at)
        full_speed = (work + more) * cost.token_s + math.ceil((tokens + p.num_uncomputed) / max(1, budget)) \
            * cost.decode_s
        if full_speed > p.ttft_deadline - now:
            continue  # it misses whatever this step does: it keeps its turn, the others are not held up
        tokens, work = tokens + p.num_uncomputed, work + more
        p.slo_rank = (URGENT, p.ttft_deadline)
        pending.append(Due(tokens, work, TTFT_HEADROOM * (p.ttft_deadline - now)))
    return pending


def plan_step(now: float, decoding: Seq[Sequence], prompts: Seq[Sequence], cost: StepCost, budget: int,
              best_effort: int | None) -> Plan:
    """The next step's prompt tokens beside ``decoding`` (the running decode rows), ``prompts`` (waiting or
    computing their prompt) ranked by their deadlines. ``budget``: the engine's token budget of a step;
    ``best_effort``: the cap that holds streams without an ITL target back (``chunk_budget``)."""
    pending = rank_prompts(now, prompts, cost, budget)
    if not decoding:
        return Plan(None, False, "no stream decoding: the whole budget")
    targets = [s.itl_target * (HEADROOM if s.late_allowance > 0 else SPENT_HEADROOM)
               for s in decoding if s.itl_target > 0]
    caps = []
    if targets:
        caps.append(max(MIN_CHUNK, int((min(targets) - cost.decode_s) / cost.token_s)))
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


def break_even_context(hidden: int, heads: int, kv_heads: int, head_dim: int, intermediate: int) -> float:
    """``StepCost.context`` of a Llama-shaped layer: its matmuls' multiply-adds per token over its attention's per
    key (QK^T and PV of every query head)."""
    q, kv = heads * head_dim, kv_heads * head_dim
    matmuls = hidden * (q + 2 * kv) + q * hidden + 3 * hidden * intermediate
    return matmuls / (2 * q)

