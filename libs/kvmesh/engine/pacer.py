"""Pacing: how many prompt tokens the next step may carry beside the running decode rows, from what steps cost
on this machine.

The pacer owns the measured step lines (``routing.cost.SpeedEstimator``: steps with prompt tokens by their tokens,
the same steps by their work, decode-only steps by their rows), the running corrections (how far the steps that
mixed prompt tokens into decode rows ran off the lines; the time between two decoding steps), and the cap they
yield. Each step's report feeds it (``observe``); it then plans the next step from the queues (``plan``:
``slo.plan_step`` for the streams' ITL targets and the prompts' TTFT deadlines, ``slo.chunk_budget`` for streams
without a target), and its owner hands ``cap`` to ``LLMEngine.step``. Nothing else sets the cap.

Threading: the engine thread feeds and plans; heartbeats and metrics read ``speed`` and the estimators from other
threads (racy but safe snapshots).
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

from kvmesh.contracts.engine import Speed
from kvmesh.contracts.names import PrefillOrder
from kvmesh.engine.slo import StepCost, chunk_budget, leading_position, plan_step, prompt_work
from kvmesh.routing.cost import CostModel, SpeedEstimator, SpeedFit

if TYPE_CHECKING:
    from kvmesh.engine.llm_engine import StepReport
    from kvmesh.engine.scheduler import Scheduler

log = logging.getLogger(__name__)

# a prompt token's cost before any step with prompt tokens is measured
PRIOR = SpeedFit(CostModel().prefill_overhead_s, CostModel().prefill_tok_per_s, 0)
BETWEEN_MAX_S = 0.05  # a longer pause between two decoding steps is not the loop's own cost (a stall, a GC)
REFIT_STEPS = 8  # the lines are refitted every this many steps
REESTIMATE_STEPS = 8  # least_work: a waiting prompt's cached prefix is looked up again after this many steps
REESTIMATES = 32  # ... and at most this many lookups a step (a long queue's others keep their last estimate)


class Pacer:
    """The step lines, their corrections and the next step's cap. ``stall``: a mixed step may cost ``1 + stall``
    times a decode-only one (``slo.chunk_budget``); ``context``: the model's ``StepCost.context``
    (``slo.break_even_context``); ``order``: the order of the prompts without a TTFT deadline
    (``engine.prefill_order``)."""

    def __init__(self, stall: float, context: float, order: PrefillOrder = PrefillOrder.ARRIVAL) -> None:
        self.stall = stall
        self.context = context
        self.order = order
        # steps with prompt tokens (a prompt token's cost, which the router prices prefill with), and decode-only
        # steps over their rows (a batch's step as it grows)
        self.speed_fit, self.decode_speed = SpeedEstimator(), SpeedEstimator()
        # steps with prompt tokens again, over their work (a prompt token at position p counts 1 + p / context,
        # decode rows 1): a prompt token's cost at position 0, which the plan prices chunks with at the position
        # they start from (engine.slo)
        self.chunk_speed = SpeedEstimator()
        self.cap: int | None = None  # the next step's prompt tokens beside decode rows (None: the whole budget)
        self._fit = self.speed_fit.fit()
        self._decode_fit = self.decode_speed.fit()
        self._chunk_fit = self.chunk_speed.fit()
        self._steps = 0
        # measured / predicted time of the steps that mixed prompt tokens into decode rows (a running mean): the
        # lines are fitted over every step, a mixed step's share of them is what the streams' ITL depends on
        self._mixed_error = 1.0
        # what a stream's gap adds to the step between two steps that both decode (the outputs' delivery, the
        # next plan): a running mean, planned into each step's fixed part; the end of the last decoding step
        self._between_s, self._decoded_until = 0.0, 0.0
        self._burst = False  # the step being planned / just taken is a burst (engine.slo): not priced by the cap's line

    # ---- measuring -----------------------------------------------------------------------------------------------
    def observe(self, step: StepReport) -> None:
        """Feed the step just taken to the lines and the corrections."""
        if step.decode_rows:
            if self._decoded_until:  # the step before decoded too: the time between is part of the streams' gap
                self._between_s = 0.9 * self._between_s + 0.1 * min(BETWEEN_MAX_S, step.began - self._decoded_until)
            self._decoded_until = step.began + step.seconds
        else:
            self._decoded_until = 0.0
        if not step.tokens:
            return
        (self.decode_speed if step.decode_only else self.speed_fit).observe(step.tokens, step.seconds)
        # a burst is not what the cap's steps cost (a large product runs nearer the machine's peak per token): it
        # would bend their line and the correction after it, and the streams' next gaps with them
        if step.decode_only or self._burst:
            return
        work = step.decode_rows + sum(prompt_work(first, first + n, self.context) for first, n in step.prompt_chunks)
        self.chunk_speed.observe(work, step.seconds)
        if step.decode_rows and (expected := self._expected_step(step.decode_rows, work)) is not None:
            ratio = min(4.0, max(0.25, step.seconds / expected))
            self._mixed_error = 0.7 * self._mixed_error + 0.3 * ratio

    def calibrate(self, time_forward: Callable[[list[tuple[int, int]]], float], top: int) -> None:
        """Measure the lines before the first step: prompt passes of up to ``top`` tokens and decode batches of 1
        to 8 rows, each timed by ``time_forward`` (``LLMEngine.time_forward``)."""
        began = time.monotonic()
        # (first position, tokens) of each prompt pass; the first one pays one-off costs, and each fit skips it
        for first, n in ((0, top // 16), (0, top // 8), (0, top * 3 // 8), (0, top), (top, top // 8)):
            took = time_forward([(first, n)])
            self.speed_fit.observe(n, took)
            self.chunk_speed.observe(prompt_work(first, first + n, self.context), took)
        for rows in (1, 1, 2, 4, 8):
            self.decode_speed.observe(rows, time_forward([(top // 16, 1)] * rows))
        self._refit()
        log.info("calibrated in %.2f s: prefill %s, decode %s", time.monotonic() - began,
                 f"{self._fit.tok_per_s:.0f} tok/s + {self._fit.overhead_s * 1e3:.1f} ms" if self._fit else "-",
                 f"{self._decode_fit.overhead_s * 1e3:.1f} ms + {1e3 / self._decode_fit.tok_per_s:.2f} ms/row"
                 if self._decode_fit else "-")

    def speed(self, running: int) -> Speed:
        """The prefill line and, once decode-only steps are measured, the decode-only step of ``running`` streams
        and one more."""
        prefill = self.speed_fit.report()
        if (d := self.decode_speed.fit()) is None:
            return prefill
        return dataclasses.replace(prefill, decode_step_s=round(d.overhead_s + (running + 1) / d.tok_per_s, 6))

    # ---- planning ------------------------------------------------------------------------------------------------
    def plan(self, sched: Scheduler) -> None:
        """Size the next step's prompt tokens beside the decode rows (``cap``) and rank the prompts
        (``slo.plan_step``): the streams' ITL targets and the prompts' TTFT deadlines, over the measured step
        costs (lines refitted every ``REFIT_STEPS`` steps, corrected by how far the mixed steps have been off
        them); streams without an ITL target are held back by ``chunk_budget`` against the decode step of the
        batch the waiting prompts will settle it at. Until a prompt's cost is measured (the first steps with
        prompt tokens), the configured prior prices it."""
        self._steps += 1
        self._burst = False
        if self._steps % REFIT_STEPS == 1:
            self._refit()
        if self._fit is None and self._decode_fit is None:
            return  # nothing measured yet: the first steps run the whole token budget
        decoding = [s for s in sched.running if not s.in_prefill]
        prompts = [s for s in sched.running if s.in_prefill] + list(sched.waiting)
        cost = self._step_cost(len(decoding))
        cost = cost._replace(decode_s=cost.decode_s * self._mixed_error + self._between_s,
                             token_s=cost.token_s * self._mixed_error)
        if self.order != PrefillOrder.ARRIVAL:
            self._estimate_cached(sched)
        plan = plan_step(time.monotonic(), decoding, prompts, cost, sched.max_batched_tokens,
                         self._best_effort(sched), self.order)
        self.cap, self._burst = plan.tokens, plan.burst
        if log.isEnabledFor(logging.DEBUG) and prompts and decoding:
            log.debug("step plan: %d streams, %d prompts: %s (a step of it ~%.0f ms; between steps %.1f ms)",
                      len(decoding), len(prompts), plan.reason,
                      1e3 * cost.step_s(plan.tokens or 0, leading_position(prompts)), 1e3 * self._between_s)

    def _estimate_cached(self, sched: Scheduler) -> None:
        """Look up the cached prefix of the waiting prompts not looked up in ``REESTIMATE_STEPS`` steps (at most
        ``REESTIMATES``, the longest unseen first): what ``slo.work_s`` prices their work past. A radix
        walk of the prompt's full blocks, with no side effect; the prefix may grow meanwhile (another request
        computes it, a pool fetch lands) or shrink (eviction), hence again every few steps."""
        stale = [s for s in sched.waiting if self._steps - s.estimated_at >= REESTIMATE_STEPS or s.estimated_at < 0]
        stale.sort(key=lambda s: s.estimated_at)
        for seq in stale[:REESTIMATES]:
            tokens = seq.all_token_ids
            reusable = 0 if seq.scores_prompt else len(tokens) - 1  # a scored prompt reuses nothing
            seq.cached_estimate = sched.blocks.match(seq.namespace_seed, tokens, reusable).num_tokens
            seq.estimated_at = self._steps

    def _best_effort(self, sched: Scheduler) -> int:
        """The cap that holds streams without an ITL target back (``chunk_budget``), against the batch the
        waiting prompts settle it at."""
        prefill = self._fit or PRIOR
        line = None if self._decode_fit is None else (self._decode_fit.overhead_s, self._decode_fit.tok_per_s)
        settled = min(sched.max_num_seqs, len(sched.running) + len(sched.waiting))
        return chunk_budget(prefill.overhead_s, prefill.tok_per_s, len(sched.running), self.stall, line, settled)

    def _step_cost(self, rows: int) -> StepCost:
        """A step of ``rows`` decode rows, and what a prompt token at position 0 adds to it, from the measured
        lines (the prompt line alone until decode-only steps are measured; the configured prior before anything
        is)."""
        prefill = self._chunk_fit or PRIOR
        d = self._decode_fit
        decode_s = d.overhead_s + rows / d.tok_per_s if d is not None else prefill.overhead_s + rows / prefill.tok_per_s
        return StepCost(decode_s, 1.0 / prefill.tok_per_s, self.context)

    def _expected_step(self, decode_rows: int, work: float) -> float | None:
        """The plan's estimate of a mixed step of ``decode_rows`` and ``work`` (decode rows and prompt tokens by
        their position, ``prompt_work``), before the running correction."""
        if self._chunk_fit is None and self._decode_fit is None:
            return None
        cost = self._step_cost(decode_rows)
        return cost.decode_s + (work - decode_rows) * cost.token_s

    def _refit(self) -> None:
        self._fit, self._decode_fit = self.speed_fit.fit(), self.decode_speed.fit()
        self._chunk_fit = self.chunk_speed.fit()
