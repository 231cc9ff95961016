"""The step budget by SLO: how many prompt tokens the next step may carry beside the running decode rows, and
which prompts get them first.

The running streams' ITL targets cap a step: it is planned to end within ``HEADROOM`` of the tightest target
(``SPENT_HEADROOM`` for a stream with no late gap left to lose; streams without a target are held back by the
best-effort rule instead, ``chunk_budget``). A prompt's tokens cost more the later they sit in it (their
attention covers the ones before: ``StepCost.work``), so the cap is sized at the position the leading prompt has
reached. The waiting prompts' TTFT targets order the prompts (earliest deadline first, among those that can still
make it at full speed; the rest behind them in arrival order, or with ``PrefillOrder.LEAST_WORK`` by arrival +
the work left past a prompt's cached prefix: least work first, and none passed for ever) and say whether steps at
the cap, which carries fewer tokens the further a prompt has got, finish them in time. When they would not, the
streams may lend at once (before an ordinary slow step spends what they could lend): a step may run past their
ITL targets only while every stream with a target has a late gap to lend within its p99 beyond ``RESERVE_GAPS``
kept for what no plan sees (a stolen core, a pause; ``Sequence.late_allowance``; a stream without a target
always lends). Such a step (a burst) carries the whole step budget: the late gap is spent however long it runs,
and a large step computes a prompt token for less than the small ones under the cap do (a large matrix
product is nearer the machine's peak). Otherwise the cap holds and the prompt may miss: a stream's ITL is not
traded for one prompt's TTFT beyond its own p99.

Pure functions of the engine's measured step costs, so they are tested without a model; the pacer
(``engine/pacer.py``) measures those costs and plans each step with them.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from collections.abc import Sequence as Seq
from typing import NamedTuple

from kvmesh.contracts.names import PrefillOrder
from kvmesh.contracts.slo import ITL_HEADROOM
from kvmesh.engine.sequence import Sequence, Status

MIN_CHUNK = 16  # prefill tokens a step always grants a waiting prompt, however slow the machine
HEADROOM = ITL_HEADROOM  # a step is planned to end this share of the tightest ITL target after the one before
SPENT_HEADROOM = 0.7  # ... of the target of a stream with no late gap left to lose
TTFT_HEADROOM = 0.9  # a prompt is planned to finish within this share of the time left to its deadline
RESERVE_GAPS = 1  # late gaps a stream keeps within its p99 for what no plan sees; it lends only those beyond
SPAN = 128  # positions over which _late_at_cap holds the cap constant
URGENT, IN_TURN = 0, 1  # Sequence.slo_rank's first field: a prompt that can still make its deadline, the others


def prompt_work(first: int, end: int, context: float) -> float:
    """Tokens ``first .. end - 1`` of a prompt in units of a prompt token at position 0: a token at position p
    costs ``1 + p / context`` of those (``StepCost.context``; 0: every token the same)."""
    if not context:
        return float(end - first)
    return (end - first) * (1 + (first + end - 1) / (2 * context))


def chunk_budget(overhead_s: float, tok_per_s: float, decode_rows: int, stall: float = 1.0,
                 decode_line: tuple[float, float] | None = None, settled_rows: int = 0) -> int:
    """Prefill tokens a mixed step may carry: the running streams together are held back at most ``stall``
    times the decode-only step of the batch the waiting prompts settle it at, times that batch's rows.

    - Nobody waiting beyond the running rows (``settled_rows <= decode_rows``): the step costs at most
      ``1 + stall`` times today's decode-only step.
    - Prompts waiting to join a small batch: the delay is shared by few streams, so each may wait longer, up to
      the total the settled batch would bear. Sixteen short prompts arriving together then join in a step or
      two instead of about one per step (which leaves the batch part-empty for as many steps at the end).

    ``overhead_s``, ``tok_per_s``: the line ``step = overhead + tokens / speed`` fitted over steps with prompt
    tokens (a prompt token costs ``1 / tok_per_s``). ``decode_line``: ``(overhead_s, rows_per_s)`` fitted over
    decode-only steps; without it the decode-only step is read off the prefill line, and the cap without
    waiting prompts is ``stall * (overhead * speed + decode_rows)``."""
    overhead, rows_per_s = decode_line or (overhead_s, tok_per_s)

    def step(rows: int) -> float:
        return overhead + rows / rows_per_s

    settled = max(settled_rows, decode_rows, 1)
    held_back = stall * step(settled) * settled / max(1, decode_rows)  # seconds each running stream may wait
    return max(MIN_CHUNK, int(held_back * tok_per_s))


class StepCost(NamedTuple):
    """What a step costs here: ``decode_s``, the decode-only step of the running batch; ``token_s``, what a
    prompt token at position 0 adds to it (both measured by the pacer); ``context``: the position at
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
    """A prompt with a deadline, in deadline order: where its uncomputed tokens start, how many there are, and
    the seconds left to plan with."""

    start: int
    tokens: int
    left: float


def _late_at_cap(pending: list[Due], cost: StepCost, cap_at: Callable[[int], int]) -> float:
    """How far past its time the worst prompt in ``pending`` finishes when every step carries the cap
    (``cap_at(position)``: fewer tokens the further into a prompt), the prompts one after another in deadline
    order; <= 0 when they all make it."""
    took, worst = 0.0, -math.inf
    for d in pending:
        at, end = d.start, d.start + d.tokens
        while at < end:  # in spans of SPAN positions, each at the cap where it starts (it shrinks slowly)
            span = min(SPAN, end - at)
            took += math.ceil(span / max(1, cap_at(at))) * cost.decode_s + cost.work(at, at + span) * cost.token_s
            at += span
        worst = max(worst, took - d.left)
        if worst > 0:
            return worst  # this one misses: that is all the plan needs to know
    return worst


def work_from(p: Sequence) -> int:
    """Where a prompt's compute left starts: past what it has computed, or for a waiting one past the cached
    prefix last found for it (``Sequence.cached_estimate``)."""
    return p.num_computed_tokens if p.status is not Status.WAITING else max(p.num_computed_tokens, p.cached_estimate)


def work_s(p: Sequence, cost: StepCost, budget: int) -> float:
    """Seconds of compute left to a prompt's first token at full speed (steps of ``budget`` tokens beside the
    decode rows) from ``work_from``; at least one step."""
    first = min(work_from(p), p.num_tokens - 1)
    steps = math.ceil((p.num_tokens - first) / max(1, budget))
    return cost.work(first, p.num_tokens) * cost.token_s + steps * cost.decode_s


def finish_alone(p: Sequence, cost: StepCost, budget: int) -> float:
    """``PrefillOrder.LEAST_WORK``'s key: when the prompt would have had its first token had it been served alone
    from its arrival at the mesh (``Sequence.mesh_arrival`` + ``work_s``: a prompt that waited at the router or for
    its hand-off before this engine took it counts that wait), earliest first. Among prompts that came together the
    least work goes first (a mostly cached prompt, a session's next step, before a long cold one); a prompt is
    passed only by prompts that arrived before its key, so however long it is, it is not passed for ever."""
    return p.mesh_arrival + work_s(p, cost, budget)


def rank_prompts(now: float, prompts: Seq[Sequence], cost: StepCost, budget: int,
                 order: PrefillOrder = PrefillOrder.ARRIVAL) -> list[Due]:
    """Set each prompt's ``slo_rank`` (deadline first among those that can still make it at full speed, the
    others behind them in ``order``: ``PrefillOrder.ARRIVAL``, or ``PrefillOrder.LEAST_WORK``, earliest
    ``finish_alone`` first) and return the urgent ones' ``Due`` s, with ``TTFT_HEADROOM`` of the time to each
    deadline to plan with (one that makes it only without the headroom gets the largest steps the streams can
    lend). Full speed: steps of ``budget`` tokens beside the decode rows."""
    for p in prompts:
        p.slo_rank = (IN_TURN, 0.0 if order == PrefillOrder.ARRIVAL else finish_alone(p, cost, budget))
    timed = sorted(((p.ttft_deadline, p) for p in prompts if p.ttft_deadline is not None), key=lambda dp: dp[0])
    pending: list[Due] = []
    tokens, work = 0, 0.0
    for deadline, p in timed:
        more = cost.work(p.num_computed_tokens, p.num_tokens)
        full_speed = (work + more) * cost.token_s + math.ceil((tokens + p.num_uncomputed) / max(1, budget)) \
            * cost.decode_s
        if full_speed > deadline - now:
            continue  # it misses whatever this step does: it keeps its turn, the others are not held up
        tokens, work = tokens + p.num_uncomputed, work + more
        p.slo_rank = (URGENT, deadline)
        pending.append(Due(p.num_computed_tokens, p.num_uncomputed, TTFT_HEADROOM * (deadline - now)))
    return pending


def tokens_ahead(now: float, prompts: Seq[Sequence], edges: Seq[float], step: int) -> tuple[int, ...]:
    """Under ``PrefillOrder.LEAST_WORK``, as last ranked (``rank_prompts``): for each of ``edges`` (seconds), the
    prompt tokens still to compute of ``prompts`` that a prompt arriving ``now`` with that much compute to its
    first token would not pass: those with a deadline they can make, those whose ``finish_alone`` key is at most
    ``now`` + the edge (a prompt not ranked yet counts as ahead of any), and of the others already computing,
    the chunk of a step (``step`` tokens) each is in: a step under way is not cut short. Cumulative: what a router
    prices a new prompt's wait with (``EngineLoad.ahead_tokens``), where under arrival order the whole queue is
    ahead."""
    rows = []
    for p in prompts:
        left = max(0, p.num_tokens - work_from(p))
        chunk = min(left, step) if p.status is not Status.WAITING else 0
        rows.append((left, chunk, -math.inf if p.slo_rank[0] == URGENT else p.slo_rank[1] - now))
    return tuple(sum(left if o <= edge else chunk for left, chunk, o in rows) for edge in edges)


def plan_step(now: float, decoding: Seq[Sequence], prompts: Seq[Sequence], cost: StepCost, budget: int,
              best_effort: int | None, order: PrefillOrder = PrefillOrder.ARRIVAL) -> Plan:
    """The next step's prompt tokens beside ``decoding`` (the running decode rows), ``prompts`` (waiting or
    computing their prompt) ranked by their deadlines, then in ``order`` (``rank_prompts``). ``budget``: the
    engine's token budget of a step; ``best_effort``: the cap that holds streams without an ITL target back
    (``chunk_budget``)."""
    pending = rank_prompts(now, prompts, cost, budget, order)
    if not decoding:
        return Plan(None, False, "no stream decoding: the whole budget")
    targets = [s.itl_target * (HEADROOM if s.late_allowance > 0 else SPENT_HEADROOM)
               for s in decoding if s.itl_target > 0]
    limit = min(targets) if targets else None
    held = best_effort if best_effort is not None and len(targets) < len(decoding) else None
    if limit is None and held is None:
        return Plan(None, False, "no cap")

    def cap_at(position: int) -> int:
        caps = [max(MIN_CHUNK, cost.tokens_within(limit, position))] if limit is not None else []
        return min(caps + ([held] if held is not None else []))

    cap = cap_at(leading_position(prompts))
    late = _late_at_cap(pending, cost, cap_at) if pending else -math.inf
    if late <= 0:
        return Plan(cap, False, f"cap {cap}: the prompts make their deadlines at it")
    lenders = all(s.late_allowance > RESERVE_GAPS for s in decoding if s.itl_target > 0)
    if not lenders:
        return Plan(cap, False, f"cap {cap}: at it a prompt would finish {late:.2f}s late, the streams have no "
                                f"late gap to lend")
    return Plan(budget, True, f"burst of {budget}: at cap {cap} a prompt would finish {late:.2f}s late")


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

