"""The native engine behind the seam: an ``LLMEngine`` owned by one thread, driven from asyncio (``Engine``).

Ownership: the engine thread is the only caller of ``LLMEngine``; coroutines send it commands through a queue
and receive each request's outputs on an ``asyncio.Queue``, turned into the seam's types on the engine thread
(KV read out becomes bytes in wire order there: on CUDA the device-to-host copy stays off the event loop). KV events
raised during a step are handed to ``on_events`` on the event loop after that step. Every step's report feeds the
pacer (``engine/pacer.py``): its lines give ``speed``, the instance's measured prefill speed (heartbeats report it; the
router prices this instance with it), and size the next step's prompt tokens beside the decoding streams (its cap,
handed to ``LLMEngine.step``).

Errors: a request that failed inside a step (``StepOutput.error``) gets that ``SequenceError`` raised from its
``generate``; the rest of the batch carries on. A step that failed as a whole fails every active request.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Callable, Mapping
from collections.abc import Sequence as Sequence_
from typing import Any

from kvmesh.contracts.engine import (
    AHEAD_EDGES_S,
    AdapterInfo,
    BlockStates,
    EngineLoad,
    EngineOutput,
    EngineRequest,
    EngineStats,
    ExportedKV,
    RequestTiming,
    SloOutcomes,
    Speed,
    StepCounts,
)
from kvmesh.contracts.events import TIER_DEVICE, AllBlocksCleared, BlockRemoved, BlockStored, KVEvent
from kvmesh.contracts.ids import BlockKey, NamespaceSeed
from kvmesh.contracts.keys import Namespace, block_keys
from kvmesh.contracts.messages import SessionSignal
from kvmesh.contracts.sessions import SessionEvent
from kvmesh.engine.errors import SequenceError
from kvmesh.engine.kv_cache import block_bytes, blocks_from_bytes
from kvmesh.engine.llm_engine import LLMEngine, StepOutput
from kvmesh.engine.pacer import Pacer
from kvmesh.engine.sequence import Sequence, Status
from kvmesh.engine.slo import break_even_context, tokens_ahead
from kvmesh.engines.base import Engine, KVEventSink, Reserved
from kvmesh.engines.loop import EngineLoop
from kvmesh.settings import EngineSettings
from kvmesh.transfer.landing import Landing

log = logging.getLogger(__name__)

CALIBRATION_TOKENS = 256  # the largest prompt pass of the calibration at start


class AsyncEngine(EngineLoop, Engine):
    """The native engine (``backend = "native"``): ``LLMEngine`` on its own thread (``EngineLoop``), behind the
    seam."""

    backend = "native"
    continues_requests = True

    def __init__(self, engine: LLMEngine, loop: asyncio.AbstractEventLoop,
                 on_events: Callable[[list[KVEvent]], None] | None = None, stall: float | None = None,
                 model_name: str = "") -> None:
        EngineLoop.__init__(self, loop)
        self.engine = engine
        self.layout = engine.layout
        self.model_name = model_name or "SmolLM2-135M-Instruct"
        self.max_model_len = engine.max_model_len
        self.on_events = on_events
        self._events: list[KVEvent] = []
        # the full blocks on the device, as their keys: updated on the engine thread as blocks come and go, read
        # by ``holds`` from the event loop (set membership needs no lock)
        self._device_keys: set[BlockKey] = set()
        engine.blocks.on_event = self._on_event  # called on the engine thread only
        # KV read out during a forward pass (layer groups) reaches its request at once, not after the step
        engine.on_piece = lambda out: self._deliver(out.request_id, out)
        # engine thread only: timed requests not yet admitted by the scheduler / without a first output yet
        self._unscheduled: dict[str, tuple[Sequence, RequestTiming]] = {}
        self._timed: dict[str, tuple[Sequence, RequestTiming]] = {}
        # a mixed step may cost (1 + stall) x a decode-only one (slo.chunk_budget; engine.mixed_step_stall)
        mc = engine.model_config
        self.pacer = Pacer(engine.cfg.mixed_step_stall if stall is None else stall,
                           break_even_context(mc.hidden_size, mc.num_heads, mc.num_kv_heads, mc.head_dim,
                                              mc.intermediate_size), engine.cfg.prefill_order)
        self.step_totals = StepTotals()  # fed on the engine thread, read by the metrics collector
        self._session_due: Callable[[str], None] | None = None  # the host's warm-from-pool of a returning session
        self.start()

    # ---- called from the event loop: the engine's own commands ------------------------------------------------
    async def call(self, fn: Callable[[LLMEngine], Any]) -> Any:
        """Run ``fn(engine)`` on the engine thread and await its result (exceptions propagate). Tools and tests
        only: a service goes through the ``Engine`` methods."""
        return await self.run(lambda: fn(self.engine))

    def submit(self, fn: Callable[[LLMEngine], Any]) -> None:
        """Run ``fn(engine)`` on the engine thread, in order with the other commands; nobody waits for it
        (releases that must happen even while the caller is being cancelled). Failures are logged."""
        self.queue(lambda: fn(self.engine))

    # ---- the seam: requests ----------------------------------------------------------------------------------
    async def generate(self, request: EngineRequest,
                       timing: RequestTiming | None = None) -> AsyncIterator[EngineOutput]:
        """Add a request and yield its outputs until it finishes. Leaving early aborts it. ``timing``, when
        given, is filled in as the request passes through the engine (see ``RequestTiming``)."""
        rid = request.request_id
        stream = self.open_stream(rid)
        try:
            structured = request.params.structured
            if structured is not None:  # a cold schema compiles here, not in the batch
                await self.loop.run_in_executor(None, lambda: self.engine.grammars.compile(structured))
            if timing is not None:
                timing.submitted = time.monotonic()
            await self.call(lambda e: self._add(request, timing))
            while True:
                out = await stream.get()
                if isinstance(out, BaseException):
                    raise out
                yield out
                if out.finished:
                    return
        finally:
            if self.close_stream(rid):
                self.queue(lambda: self._abort(rid))

    # ---- the seam: the prefix cache and its blocks ------------------------------------------------------------
    def namespace(self, cache_salt: str = "", lora: str = "") -> NamespaceSeed:
        """Safe from any thread: the adapter registry is read (a dict lookup), the seed computed afresh."""
        e = self.engine
        spec = e.lora_spec(lora)  # ValueError naming the adapters served
        tok_fp = e.tokenizer.fingerprint if e.tokenizer else ""
        return NamespaceSeed(Namespace(e.fingerprint, tok_fp, spec.lora_id if spec else "", cache_salt).seed)

    async def match_prefix(self, namespace: NamespaceSeed, tokens: Sequence_[int], max_tokens: int) -> int:
        return await self.call(lambda e: len(e.blocks.match(namespace, tokens, max_tokens).nodes))

    def holds(self, namespace: NamespaceSeed, tokens: Sequence_[int], max_blocks: int) -> int:
        n = 0
        for key in block_keys(namespace, tokens[:max_blocks * self.layout.block_size], self.layout.block_size):
            if key not in self._device_keys:
                break
            n += 1
        return n

    async def pin(self, lease: str, namespace: NamespaceSeed, tokens: Sequence_[int], max_blocks: int) -> int:
        return await self.call(lambda e: e.blocks.pin(lease, namespace, tokens, max_blocks))

    def unpin(self, lease: str) -> None:
        self.submit(lambda e: e.blocks.unpin(lease))

    async def reserve(self, lease: str, request: EngineRequest, first_block: int) -> Reserved | None:
        """Device blocks for the prompt's blocks ``first_block ..``, lent as a landing over the pool's own
        memory; None when the pool is not in process memory (CUDA) or has no room."""
        arrays = self.engine.kv.landing_arrays()
        n = -(-len(request.prompt) // self.layout.block_size) - first_block
        if arrays is None or n <= 0:
            return None
        ids = await self.call(lambda e: e.blocks.reserve(lease, n))
        if ids is None:
            return None
        return Reserved(lease, first_block, tuple(ids), Landing(*arrays, ids, first_block))

    def release(self, lease: str) -> None:
        self.submit(lambda e: e.blocks.release_reserved(lease))

    async def adopt(self, namespace: NamespaceSeed, tokens: Sequence_[int], first_block: int, data: memoryview,
                    num_blocks: int) -> bool:
        blocks = blocks_from_bytes(self.layout, data)[:num_blocks]
        end = (first_block + num_blocks) * self.layout.block_size

        def adopt(e: LLMEngine) -> bool:
            ok = e.blocks.adopt(namespace, list(tokens[:end]), blocks, first_block)
            if ok and e.canary.share > 0:  # a check of a reuse of these says it came from the pool
                e.canary.from_pool(block_keys(namespace, tokens[:end], self.layout.block_size)[first_block:])
            return ok

        return await self.call(adopt)

    async def held_blocks(self) -> list[tuple[BlockKey, str]]:
        return await self.call(lambda e: e.blocks.held_blocks())

    def subscribe(self, sink: KVEventSink) -> None:
        self.on_events = sink

    # ---- the seam: what the cluster says about the cached blocks ----------------------------------------------
    def signal_session(self, signal: SessionSignal) -> None:
        """Queued on the engine thread; a pause also sets a timer that warms the session's demoted blocks back
        ``session_prefetch_lead_s`` before it is expected (the pause the client announced, else its own
        cadence), if it is still paused then, and then tells ``on_session_due``'s sink; ``RESUME`` (its next
        request reached the router) warms them at once."""
        self.queue(lambda: self._session_signal(signal))

    def on_session_due(self, sink: Callable[[str], None]) -> None:
        """``sink(session)`` on the event loop when a paused session is ``session_prefetch_lead_s`` from its
        expected return (the timer above, after the host-tier warm-up): the host fetches what the pool holds of
        its context then. Pauses get that timer with or without a host tier once a sink is set."""
        self._session_due = sink

    def cluster_copies(self, shared: Sequence_[BlockKey], sole: Sequence_[BlockKey]) -> None:
        self.queue(lambda: self.engine.blocks.cluster_copies(shared, sole))

    # ---- the seam: LoRA adapters -----------------------------------------------------------------------------
    async def load_lora(self, name: str, path: str) -> AdapterInfo:
        """The files are read and checked off the engine thread; only the registration runs on it, so a slow
        or bad adapter never stalls the running batch."""
        spec = await self.loop.run_in_executor(None, self.engine.loras.read, name, path)
        await self.call(lambda e: e.loras.register(spec))
        return AdapterInfo(spec.name, spec.generation, spec.path, spec.rank)

    async def unload_lora(self, name: str) -> None:
        await self.call(lambda e: e.unload_lora(name))

    def adapters(self) -> list[AdapterInfo]:
        specs = list(self.engine.loras.registered.values())
        return sorted((AdapterInfo(s.name, s.generation, s.path, s.rank) for s in specs), key=lambda a: a.name)

    # ---- the seam: load and speed ----------------------------------------------------------------------------
    def load(self) -> EngineLoad:
        """A racy but safe snapshot (ints read from another thread) for heartbeats and routing."""
        e = self.engine
        sched = e.scheduler
        waiting = list(sched.waiting)
        ahead: tuple[int, ...] = ()
        if sched.one_order:  # least work first: a new prompt passes some of the queue
            prompts = [s for s in list(sched.running) if s.in_prefill] + waiting
            step = self.pacer.cap or sched.max_batched_tokens
            ahead = tokens_ahead(time.monotonic(), prompts, AHEAD_EDGES_S, step)
        return EngineLoad(len(sched.running), len(waiting), e.blocks.num_free_blocks, e.kv.num_blocks,
                          e.blocks.num_cached_blocks, e.blocks.num_host_blocks,
                          sum(s.num_tokens for s in waiting),
                          self.step_totals.decode.steps + self.step_totals.prefill.steps, ahead)

    def speed(self) -> Speed:
        """The prefill line and, once decode-only steps are measured, the decode-only step of the running batch
        with one more stream (what the router prices prompt tokens computed beside the streams with, under their
        ITL targets)."""
        return self.pacer.speed(len(self.engine.scheduler.running))

    def stats(self) -> EngineStats:
        """Read when scraped: racy reads of ints and containers the engine thread owns (a container that
        changed while it was counted is looked at again, at most three times)."""
        e = self.engine
        for _ in range(3):
            try:
                load, counts = self.load(), e.blocks.counts()
                break
            except RuntimeError:  # a queue or set changed while we copied it
                continue
        else:
            raise RuntimeError("the engine's state kept changing while it was read")
        st = dict(e.blocks.stats)
        return EngineStats(
            load, self.speed(), e.blocks.host.num_blocks if e.blocks.host is not None else 0,
            BlockStates(counts["referenced"], counts["pinned"], counts["reserved"]),
            st.get("evicted_device", 0), st.get("evicted_host", 0), st.get("spilled_host", 0),
            st.get("loaded_host", 0), e.scheduler.num_preemptions, self.step_totals.decode,
            self.step_totals.prefill, st.get("prefetch_loaded", 0), st.get("prefetch_used", 0),
            st.get("prefetch_wasted", 0), len(e.blocks.sessions) if e.blocks.sessions is not None else 0,
            SloOutcomes(**e.slo_outcomes))

    async def close(self) -> None:
        await self.stop()

    # ---- engine thread ---------------------------------------------------------------------------------------
    def _abort(self, request_id: str) -> None:
        self._unscheduled.pop(request_id, None)
        self._timed.pop(request_id, None)
        self.engine.abort(request_id)

    def _add(self, request: EngineRequest, timing: RequestTiming | None) -> None:
        if timing is not None:
            timing.started = time.monotonic()
        seq = self.engine.add_request(request)
        if timing is None:
            return
        timing.added = time.monotonic()
        self._timed[request.request_id] = (seq, timing)
        if seq.status is Status.WAITING:
            self._unscheduled[request.request_id] = (seq, timing)

    def _session_signal(self, signal: SessionSignal) -> None:
        blocks, cfg = self.engine.blocks, self.engine.cfg
        key, event = signal.session, signal.event
        if event is SessionEvent.RESUME:
            if blocks.host is not None and (loaded := blocks.prefetch(key)):
                log.debug("session %s is back: %d blocks warmed back from the host", key, loaded)
            return
        blocks.session_signal(key, event, signal.expected_s)
        if event not in (SessionEvent.PAUSE, SessionEvent.DEMOTE) or not cfg.session_prefetch or \
                (blocks.host is None and self._session_due is None):
            return
        expected = blocks.sessions.expected_return(key) if blocks.sessions is not None else None
        if expected is not None:
            delay = max(0.0, expected - cfg.session_prefetch_lead_s - time.monotonic())
            self.loop.call_soon_threadsafe(self._prefetch_later, key, expected, delay)

    def _prefetch_later(self, key: str, expected: float, delay: float) -> None:
        """On the event loop: queue the warm-up of paused session ``key`` after ``delay`` seconds."""
        self.loop.call_later(delay, lambda: self.queue(lambda: self._prefetch(key, expected)))

    def _prefetch(self, key: str, expected: float) -> None:
        """Still paused, the same pause (it was not back meanwhile): warm its demoted blocks back, then tell the
        host (which warms what only the pool holds)."""
        blocks = self.engine.blocks
        if blocks.sessions is None or blocks.sessions.expected_return(key) != expected:
            return
        if blocks.host is not None and (loaded := blocks.prefetch(key)):
            log.debug("session %s: %d blocks warmed back before its expected return", key, loaded)
        if self._session_due is not None:
            self.loop.call_soon_threadsafe(self._session_due, key)

    def busy(self) -> bool:
        return self.engine.has_unfinished()

    def canary_counts(self) -> Mapping[tuple[str, str], int]:
        return dict(self.engine.canary.counts)

    def on_quarantine(self, sink: Callable[[list[BlockKey], str], None]) -> None:
        def on_loop(keys: list[BlockKey], path: str) -> None:
            self.loop.call_soon_threadsafe(sink, keys, path)

        self.engine.canary.on_quarantine = on_loop

    def idle_in(self) -> float | None:
        return self.engine.canary.due_in()

    def idle(self) -> None:
        self.engine.canary_step()

    def _on_event(self, event: KVEvent) -> None:
        if isinstance(event, BlockStored) and event.tier == TIER_DEVICE:
            self._device_keys.update(event.block_keys)
        elif isinstance(event, BlockRemoved) and event.tier == TIER_DEVICE:
            self._device_keys.difference_update(event.block_keys)
        elif isinstance(event, AllBlocksCleared):
            self._device_keys.clear()
        self._events.append(event)

    def after_round(self) -> None:
        self._flush_events()

    def step(self) -> None:
        try:
            outputs, report = self.engine.step(self.pacer.cap)
        except Exception as e:  # not one sequence's fault (those come back as outputs with an error): fail all
            log.exception("engine step failed")
            for rid in self.engine.active_requests():
                self._deliver(rid, SequenceError(rid, f"the engine step failed: {type(e).__name__}: {e}"))
                self._abort(rid)
            return
        self.pacer.observe(report)
        if report.tokens:
            self.step_totals.add(report.decode_only, report.rows, report.seconds, report.cpu_seconds)
        self.pacer.plan(self.engine.scheduler)
        if self._unscheduled:
            for rid, (seq, timing) in list(self._unscheduled.items()):
                if seq.status is not Status.WAITING:
                    timing.scheduled = report.began
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

    async def calibrate(self) -> None:
        """Measure the step lines before the first request (``engine.calibrate``): a few forward passes over
        dummy rows, prompt chunks of several sizes and decode batches of 1 to 8 rows, fed to the same fits the
        steps feed, so the first heartbeat reports a measured prefill speed and the first plans price steps at
        this machine's cost, not the configured prior. About 450 prompt tokens' worth of compute (a second or
        two on one core for the default model); skipped where the KV pool is too small for it."""
        await self.run(self._calibrate)

    def _calibrate(self) -> None:
        e = self.engine
        top = min(CALIBRATION_TOKENS, e.scheduler.max_batched_tokens, e.kv.num_blocks * e.cfg.block_size * 8 // 9)
        if top < 16:
            log.info("no calibration: the KV pool or the step budget is too small for it")
            return
        self.pacer.calibrate(e.time_forward, top)

    def _flush_events(self) -> None:
        if not self._events:
            return
        events = self._events[:]
        self._events.clear()
        if self.on_events is not None:
            self.loop.call_soon_threadsafe(self.on_events, events)

    def _deliver(self, request_id: str, item: StepOutput | BaseException) -> None:
        if request_id not in self._streams:
            return
        out: EngineOutput | BaseException = item if isinstance(item, BaseException) else self._output(item)
        self.deliver(request_id, out)

    @staticmethod
    def _output(step: StepOutput) -> EngineOutput:
        """A step's output for one request as the engine seam gives it."""
        readout = step.exported
        exported = None if readout is None else ExportedKV(
            block_bytes(readout.blocks), int(readout.blocks.shape[0]), readout.first_block, readout.num_tokens,
            tuple(readout.block_keys), readout.final, readout.layers)
        return EngineOutput(step.request_id, tuple(step.new_token_ids), step.text_delta, step.finished,
                            step.finish_reason, step.cached_tokens, exported, tuple(step.logprobs),
                            tuple(step.prompt_logprobs))


class StepTotals:
    """Forward steps so far, decode-only ones apart from those with prompt tokens, for the metrics (a mean step
    time and batch over any window, from rates). Written by the engine thread, read by the metrics collector: each
    kind's counts are replaced whole, so a reader sees one step's counts or the next's."""

    def __init__(self) -> None:
        self.decode = StepCounts()
        self.prefill = StepCounts()

    def add(self, decode_only: bool, rows: int, seconds: float, cpu_seconds: float = 0.0) -> None:
        kind = "decode" if decode_only else "prefill"
        c: StepCounts = getattr(self, kind)
        setattr(self, kind, StepCounts(c.steps + 1, c.rows + rows, c.seconds + seconds, c.cpu_seconds + cpu_seconds))




async def start_native(cfg: EngineSettings) -> AsyncEngine:
    """The native engine of ``cfg``: its model loaded (off the event loop) and its thread running."""
    from kvmesh.model_source.resolve import model_name

    loop = asyncio.get_running_loop()
    llm = await loop.run_in_executor(None, LLMEngine, cfg)
    engine = AsyncEngine(llm, loop, model_name=model_name(cfg.model))
    if cfg.calibrate:
        await engine.calibrate()
    return engine
