"""The step budget by SLO: how many prompt tokens the next step may carry beside the running decode rows, and
which prompts get them first.

The running streams' ITL targets cap a step: it is planned to end within ``HEADROOM`` of the tightest target
(``SPENT_HEADROOM`` for a stream with no late gap left to lose; streams without a target are held back by the
best-effort rule instead, ``scheduler.chunk_budget``). A prompt's tokens cost more the later they sit in it (their
attention covers the ones before: ``StepCost.work``), so the cap is sized at the position the leading prompt has
reached. The waiting prompts' TTFT targets order the prompts (earliest deadline first, among those that can still
make it at full speed; the rest keep their arrival order behind them) and say how many tokens a step must carry
for them to make it. When that is more than the streams' cap, the streams may lend: a step may run past their
ITL targets only while every stream with a target has a late gap to lend within its p99 beyond ``RESERVE_GAPS``
kept for what no plan sees (a stolen core, a pause; ``Sequence.late_allowance``; a stream without a target
always lends). Such a step (a burst) carries the whole step budget: the late gap is spent however long it runs,
and a large step computes a prompt token for less than the small ones under the cap do (a large matrix
product is nearer the machine's peak). Otherwise the cap holds and the prompt may miss: a stream's ITL is not
traded for one prompt's TTFT beyond its own p99.

Pure functions of the engine's measured step costs, so they are tested without a model.
"""

from __future__ import annotations

import math
from collections.abc import Sequence as Seq
from typing import NamedTuple

from kvmesh.contracts.slo import ITL_HEADROOM
from kvmesh.engine.scheduler import MIN_CHUNK
from kvmesh.engine.sequence import Sequence, Status

HEADROOM = ITL_HEADROOM  # a step is planned to end this share of the tightest ITL target after the one before
SPENT_HEADROOM = 0.7  # ... of the target of a stream with no late gap left to lose
TTFT_HEADROOM = 0.9  # a prompt is planned to finish within this share of the time left to its deadline
RESERVE_GAPS = 1  # late gaps a stream keeps within its p99 for what no plan sees; it lends only those beyond
URGENT, IN_TURN = 0, 1  # Sequence.slo_rank's first field: a prompt that can still make its deadline, the others


def prompt_work(first: int, end: int, context: float) -> float:
    """Tokens ``first .. end - 1`` of a prompt in units of a prompt token at position 0: a token at position p
    costs ``1 + p / context`` of those (``StepCost.context``; 0: every token the same)."""
    if not context:
        return float(end - first)
    return (end - first) * (1 + (first + end - 1) / (2 * context))


class StepCost(NamedTuple):
    """What a step costs here: ``decode_s``, the decode-only step of the running batch; ``token_s``, what a
    prompt token at position 0 adds to it (both measured by the engine's owner); ``context``: the position at
    which a prompt token's attention (over the tokens before it) costs as much as its matmuls, so a token at
    position p costs ``1 + p / context`` of those (0: ignore the position)."""

    decode_s: float
    token_s: float
    context: float = 0.0

    def step_s(self, tokens: int, at: int = 0) -> float:
        """A step with ``tokens`` prompt tokens from position ``at``."""
        return self.decode_s + self.work(at, at + tokens) * self.token_s

    def work(self, first: int, end: int) -> float:
        """Tokens ``first .. end - 1`` of a prompt in units of a prompt token at position 0."""
        return prompt_work(first, end, self.context)

    def tokens_within(self, seconds: float, at: int) -> int:
        """The most prompt tokens from position ``at`` a step may carry and end within ``seconds``."""
        units = (seconds - self.decode_s) / self.token_s
        if units <= 0:
            return 0
        if not self.context:
            return int(units)
        b = 1 + (2 * at - 1) / (2 * self.context)  # work(at, at + n) = n * b + n^2 / (2 context)
        return int(self.context * (math.sqrt(b * b + 2 * units / self.context) - b))


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


def rank_prompts(now: float, prompts: Seq[Sequence], cost: StepCost, budget: int) -> list[Due]:
    """Set each prompt's ``slo_rank`` (deadline first among those that can still make it at full speed, the
    others in arrival order behind them) and return the urgent ones' ``Due`` s, with ``TTFT_HEADROOM`` of the time
    to each deadline to plan with (one that makes it only without the headroom gets the largest steps the streams
    can lend). Full speed: steps of ``budget`` tokens beside the decode rows."""
    for p in prompts:
        p.slo_rank = (IN_TURN, 0.0)
    timed = sorted((p for p in prompts if p.ttft_deadline is not None), key=lambda p: p.ttft_deadline)
    pending: list[Due] = []
    tokens, work = 0, 0.0
    for p in timed:
        more = cost.work(p.num_computed_tokens, p.num_tokens)
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
        caps.append(max(MIN_CHUNK, cost.tokens_within(min(targets), leading_position(prompts))))
    if best_effort is not None and len(targets) < len(decoding):
        caps.append(best_effort)
    if not caps:
        return Plan(None, False, "no cap")
    cap = min(caps)
    need = _need(pending, cost) if pending else 0.0
    if need <= cap:
        return Plan(cap, False, f"cap {cap}: the prompts' deadlines need {math.ceil(need)} a step")
    lenders = all(s.late_allowance > RESERVE_GAPS for s in decoding if s.itl_target > 0)
    if not lenders:
        return Plan(cap, False, f"cap {cap}: the prompts need {need:.0f} a step, the streams have no late gap "
                                f"to lend")
    return Plan(budget, True, f"burst of {budget}: the prompts need {need:.0f} a step at cap {cap}")


def leading_position(prompts: Seq[Sequence]) -> int:
    """The position the next step's first prompt tokens start at: the scheduler gives a step's prompt tokens to
    the prompts it is computing first, then to the waiting ones, each in rank order."""
    if not prompts:
        return 0
    lead = min(prompts, key=lambda p: (p.status is Status.WAITING, p.slo_rank))
    return lead.num_computed_tokens


def break_even_context(hidden: int, heads: int, kv_heads: int, head_dim: int, intermediate: int) -> float:
    """``StepCost.context`` of a Llama-shaped layer: its matmuls' multiply-adds per token over its attention's per
    key (QK^T and PV of every query head)."""
    q, kv = heads * head_dim, kv_heads * head_dim
    matmuls = hidden * (q + 2 * kv) + q * hidden + 3 * hidden * intermediate
    return matmuls / (2 * q)

