"""An engine owned by one thread, driven from asyncio.

Ownership: the engine thread is the only caller of ``LLMEngine``; coroutines send it commands through a queue
and receive each request's outputs on an ``asyncio.Queue``. KV events raised during a step are handed to
``on_events`` on the event loop after that step. Every forward step's tokens and wall time feed ``speed``, the
instance's measured prefill speed (heartbeats report it; the router prices this instance with it), and the
same fit sizes the scheduler's prefill chunks while streams decode (``scheduler.chunk_budget``).

Errors: a request that failed inside a step (``StepOutput.error``) gets that ``SequenceError`` raised from its
``generate``; the rest of the batch carries on. A step that failed as a whole fails every active request.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from collections.abc import AsyncIterator, Callable
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

from kvmesh.contracts.events import KVEvent
from kvmesh.engine.errors import SequenceError
from kvmesh.engine.llm_engine import LLMEngine, StepOutput
from kvmesh.engine.scheduler import chunk_budget
from kvmesh.engine.sequence import Sequence, Status
from kvmesh.routing.cost import CostModel, SpeedEstimator, SpeedFit

log = logging.getLogger(__name__)

# a prompt token's cost before any step with prompt tokens is measured
PRIOR = SpeedFit(CostModel().prefill_overhead_s, CostModel().prefill_tok_per_s, 0)


@dataclass
class EngineLoad:
    running: int
    waiting: int
    free_blocks: int
    total_blocks: int
    cached_blocks: int
    host_blocks: int
    waiting_tokens: int


@dataclass
class RequestTiming:
    """Where one request's time went inside the engine (``time.monotonic()`` readings; 0 = did not happen).

    Filled on the engine thread; read it on the event loop only after the request's first output arrived (the
    output's delivery orders the writes before the read)."""

    submitted: float = 0.0     # the coroutine handed add_request to the engine thread
    started: float = 0.0       # the engine thread began add_request (the wait before it: the step in flight)
    added: float = 0.0         # add_request returned (an imported prefix is in the paged cache by then)
    scheduled: float = 0.0     # the forward step that first admitted it began (stays 0 when imported)
    first_output: float = 0.0  # its first output left the engine thread
    preemptions: int = 0       # times it was preempted before its first output


class AsyncEngine:
    def __init__(self, engine: LLMEngine, loop: asyncio.AbstractEventLoop,
                 on_events: Callable[[list[KVEvent]], None] | None = None, stall: float | None = None) -> None:
        self.engine = engine
        # a mixed step may cost (1 + stall) x a decode-only one (scheduler.chunk_budget; engine.mixed_step_stall)
        self.stall = engine.cfg.mixed_step_stall if stall is None else stall
        self.loop = loop
        self.on_events = on_events
        self._events: list[KVEvent] = []
        engine.blocks.on_event = self._events.append  # called on the engine thread only
        # KV read out during a forward pass (layer groups) reaches its request at once, not after the step
        engine.on_piece = lambda out: self._deliver(out.request_id, out)
        self._commands: queue.Queue[Callable[[], Any] | None] = queue.Queue()
        self._streams: dict[str, asyncio.Queue[StepOutput | BaseException]] = {}
        # engine thread only: timed requests not yet admitted by the scheduler / without a first output yet
        self._unscheduled: dict[str, tuple[Sequence, RequestTiming]] = {}
        self._timed: dict[str, tuple[Sequence, RequestTiming]] = {}
        # fed on the engine thread, read by heartbeats: steps with prompt tokens (a prompt token's cost, which the
        # router prices prefill with), and decode-only steps over their rows (a batch's step as it grows)
        self.speed, self.decode_speed = SpeedEstimator(), SpeedEstimator()
        self.step_totals = StepTotals()  # fed on the engine thread, read by the metrics collector
        self._fit = self.speed.fit()
        self._decode_fit = self.decode_speed.fit()
        self._steps = 0
        self._thread = threading.Thread(target=self._run, name="engine", daemon=True)
        self._thread.start()

    # ---- called from the event loop --------------------------------------------------------------------------
    async def call(self, fn: Callable[[LLMEngine], Any]) -> Any:
        """Run ``fn(engine)`` on the engine thread and await its result (exceptions propagate)."""
        fut: Future = Future()

        def run() -> None:
            if not fut.set_running_or_notify_cancel():
                return  # the caller went away before the engine got to it: nothing to run, no one to answer
            try:
                result = fn(self.engine)
            except BaseException as e:  # noqa: BLE001 - handed to the awaiting coroutine
                fut.set_exception(e)
            else:
                fut.set_result(result)

        self._commands.put(run)
        return await asyncio.wrap_future(fut)

    def submit(self, fn: Callable[[LLMEngine], Any]) -> None:
        """Run ``fn(engine)`` on the engine thread, in order with the other commands; nobody waits for it
        (releases that must happen even while the caller is being cancelled). Failures are logged."""
        self._commands.put(lambda: fn(self.engine))

    async def generate(self, request_id: str, prompt: list[int], params, timing: RequestTiming | None = None,
                       **kwargs: Any) -> AsyncIterator[StepOutput]:
        """Add a request and yield its outputs until it finishes. Leaving early aborts it. ``timing``, when
        given, is filled in as the request passes through the engine (see ``RequestTiming``)."""
        stream: asyncio.Queue[StepOutput | BaseException] = asyncio.Queue()
        self._streams[request_id] = stream
        try:
            if getattr(params, "structured", None) is not None:  # a cold schema compiles here, not in the batch
                await self.loop.run_in_executor(None, lambda: self.engine.grammars.compile(params.structured))
            if timing is None:
                await self.call(lambda e: e.add_request(request_id, prompt, params, **kwargs))
            else:
                timing.submitted = time.monotonic()
                await self.call(lambda e: self._add_timed(request_id, prompt, params, timing, kwargs))
            while True:
                out = await stream.get()
                if isinstance(out, BaseException):
                    raise out
                yield out
                if out.finished:
                    return
        finally:
            if self._streams.pop(request_id, None) is not None:
                self._commands.put(lambda: self._abort(request_id))

    def load(self) -> EngineLoad:
        """A racy but safe snapshot (ints read from another thread) for heartbeats and routing."""
        e = self.engine
        sched = e.scheduler
        waiting = list(sched.waiting)
        return EngineLoad(len(sched.running), len(waiting), e.blocks.num_free_blocks, e.kv.num_blocks,
                          e.blocks.num_cached_blocks, e.blocks.num_host_blocks,
                          sum(s.num_tokens for s in waiting))

    def close(self) -> None:
        self._commands.put(None)
        self._thread.join(timeout=10)

    # ---- engine thread ---------------------------------------------------------------------------------------
    def _abort(self, request_id: str) -> None:
        self._unscheduled.pop(request_id, None)
        self._timed.pop(request_id, None)
        self.engine.abort(request_id)

    def _add_timed(self, request_id: str, prompt: list[int], params, timing: RequestTiming,
                   kwargs: dict[str, Any]) -> None:
        timing.started = time.monotonic()
        seq = self.engine.add_request(request_id, prompt, params, **kwargs)
        timing.added = time.monotonic()
        self._timed[request_id] = (seq, timing)
        if seq.status is Status.WAITING:
            self._unscheduled[request_id] = (seq, timing)

    def _run(self) -> None:
        while True:
            idle = not self.engine.has_unfinished()
            try:
                cmd = self._commands.get() if idle else self._commands.get_nowait()
            except queue.Empty:
                cmd = _NOTHING
            while cmd is not _NOTHING:  # run every command that arrived, then step once
                if cmd is None:
                    return
                try:
                    cmd()
                except Exception:
                    log.exception("engine command failed")
                try:
                    cmd = self._commands.get_nowait()
                except queue.Empty:
                    cmd = _NOTHING
            if self.engine.has_unfinished():
                self._step()
            self._flush_events()

    def _step(self) -> None:
        began, began_cpu = time.monotonic(), time.thread_time()
        try:
            outputs = self.engine.step()
        except Exception as e:  # not one sequence's fault (those come back as outputs with an error): fail all
            log.exception("engine step failed")
            for rid in self.engine.active_requests():
                self._deliver(rid, SequenceError(rid, f"the engine step failed: {type(e).__name__}: {e}"))
                self._abort(rid)
            return
        took, cpu = time.monotonic() - began, time.thread_time() - began_cpu
        if self.engine.step_tokens:
            decode_only = self.engine.step_decode_rows == self.engine.step_rows
            self.step_totals.add(decode_only, self.engine.step_rows, took, cpu)
            (self.decode_speed if decode_only else self.speed).observe(self.engine.step_tokens, took)
        self._size_chunks()
        if self._unscheduled:
            for rid, (seq, timing) in list(self._unscheduled.items()):
                if seq.status is not Status.WAITING:
                    timing.scheduled = began
                    del self._unscheduled[rid]
        if self._timed:
            now = time.monotonic()
            for out in outputs:
                if not (out.new_token_ids or out.finished):  # a KV piece read out mid-prefill: no token yet
                    continue
                if (entry := self._timed.pop(out.request_id, None)) is not None:
                    entry[1].first_output, entry[1].preemptions = now, entry[0].num_preemptions
        for out in outputs:
            self._deliver(out.request_id, out if out.error is None else out.error)
            if out.finished:
                self.engine.release(out.request_id)

    def _size_chunks(self) -> None:
        """Cap prefill chunks mixed into decode steps by the measured step costs (refitted every 8 steps),
        against the decode step of the batch the waiting prompts will settle it at. Until a prompt's cost is
        measured (the first steps with prompt tokens), the configured prior prices it."""
        self._steps += 1
        if self._steps % 8 == 1:
            self._fit, self._decode_fit = self.speed.fit(), self.decode_speed.fit()
        if self._fit is None and self._decode_fit is None:
            return  # nothing measured yet: the first steps run the whole token budget
        prefill = self._fit or PRIOR
        sched = self.engine.scheduler
        line = None if self._decode_fit is None else (self._decode_fit.overhead_s, self._decode_fit.tok_per_s)
        settled = min(sched.max_num_seqs, len(sched.running) + len(sched.waiting))
        sched.chunk_tokens = chunk_budget(prefill.overhead_s, prefill.tok_per_s, len(sched.running), self.stall,
                                          line, settled)

    def _flush_events(self) -> None:
        if not self._events:
            return
        events = self._events[:]
        self._events.clear()
        if self.on_events is not None:
            self.loop.call_soon_threadsafe(self.on_events, events)

    def _deliver(self, request_id: str, item: StepOutput | BaseException) -> None:
        stream = self._streams.get(request_id)
        if stream is not None:
            self.loop.call_soon_threadsafe(stream.put_nowait, item)


class StepTotals:
    """Forward steps so far, decode-only ones apart from those with prompt tokens: how many, their rows (the
    batch), wall seconds and the engine thread's CPU seconds in them, for the metrics (a mean step time and
    batch over any window, from rates; wall well above CPU means the thread waited: for the GIL, or for a core
    another process held)."""

    KINDS = ("decode", "prefill")

    def __init__(self) -> None:
        self.steps = dict.fromkeys(self.KINDS, 0)
        self.rows = dict.fromkeys(self.KINDS, 0)
        self.seconds = dict.fromkeys(self.KINDS, 0.0)
        self.cpu_seconds = dict.fromkeys(self.KINDS, 0.0)

    def add(self, decode_only: bool, rows: int, seconds: float, cpu_seconds: float = 0.0) -> None:
        kind = "decode" if decode_only else "prefill"
        self.steps[kind] += 1
        self.rows[kind] += rows
        self.seconds[kind] += seconds
        self.cpu_seconds[kind] += cpu_seconds


_NOTHING = object()
