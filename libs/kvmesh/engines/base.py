"""``Engine``: the one interface between an engine instance's services and the engine it hosts.

Who calls what. The instance host (``kvmesh.instance``) starts an engine by backend name, forwards its KV events to
the bus, reports its load and speed in heartbeats and its stats as metrics, and serves adapter loads. The prefill
service runs a request with an ``ExportPlan`` (the push); the decode service pins the prefix it holds, reserves
blocks for the push and lends their memory to the transfer server (``Reserved.landing``), then runs the request
with the verified ``ImportedKV``. Nothing else of an engine is reachable from a service: a backend keeps its block
manager, its KV layout in memory and its threads to itself.

Threading. Every method is called on the event loop. ``generate``, ``pin``, ``reserve``, ``adopt``,
``held_blocks``, ``load_lora`` / ``unload_lora`` run in order with each other on the engine's side (its thread or
its scheduler); ``unpin`` and ``release`` are queued in that same order and never wait, so a call being cancelled
can still give back what it held. ``namespace``, ``load``, ``speed``, ``stats``, ``adapters`` answer at once from a
snapshot.

Ownership of reserved memory. ``Reserved.landing`` lends the reserved blocks' memory to whoever receives the push
(the transfer server) until the landing is revoked; ``release`` is called only after that, and frees the blocks
unless an import adopted them (``ImportedKV.reservation``).
"""

from __future__ import annotations

import abc
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from dataclasses import dataclass

from kvmesh.contracts.engine import (
    AdapterInfo,
    EngineLoad,
    EngineOutput,
    EngineRequest,
    EngineStats,
    RequestTiming,
    Speed,
)
from kvmesh.contracts.events import KVEvent
from kvmesh.contracts.ids import BlockKey, NamespaceSeed
from kvmesh.contracts.layout import KVLayout
from kvmesh.contracts.messages import SessionSignal
from kvmesh.transfer.landing import Landing

KVEventSink = Callable[[list[KVEvent]], None]


@dataclass(frozen=True)
class Reserved:
    """Blocks an engine set aside under ``lease`` for a push: ``block_ids`` (the engine's own ids, for tracing)
    hold the request's blocks ``first_block ..``; ``landing``: their memory, lent for receiving in place (None:
    the engine's memory cannot be written from outside, the push is buffered and copied in at import)."""

    lease: str
    first_block: int
    block_ids: tuple[int, ...]
    landing: Landing | None


class Engine(abc.ABC):
    """An engine serving one instance (see the module docstring for threading and ownership)."""

    backend: str        # "native", "vllm"
    layout: KVLayout    # what its exported and imported blocks mean (the wire layout)
    model_name: str     # the model as spans name it
    max_model_len: int
    # whether ``generate`` continues a request another instance started (``EngineRequest.generated``); a backend
    # that cannot is never handed one (the hosting service refuses it, and the router migrates elsewhere)
    continues_requests: bool = False

    def continuation_refused(self, structured: bool) -> str:
        """Why this engine cannot continue a request another instance started ("" when it can); ``structured``:
        the request's output follows a grammar. The hosting service answers FAILED_PRECONDITION with it, so the
        router migrates the request elsewhere."""
        return "" if self.continues_requests else f"the {self.backend} engine cannot continue a request another " \
                                                  "instance started"
    adopt_unit: int = 1  # ``adopt`` can use pool blocks only in whole runs of this many (vLLM: its own block)

    @property
    def kv_unconvertible(self) -> str:
        """Why this engine's KV cannot be converted to and from ``layout`` ("" when it can): such an instance
        neither exports, imports nor adopts blocks, and says so in its heartbeat."""
        return ""

    @property
    def fingerprint(self) -> str:
        return self.layout.model_fingerprint

    # ---- requests --------------------------------------------------------------------------------------------
    @abc.abstractmethod
    def generate(self, request: EngineRequest, timing: RequestTiming | None = None) -> AsyncIterator[EngineOutput]:
        """Run ``request`` and yield its outputs until one is ``finished``. Leaving the iterator early cancels the
        request (its blocks go back). A request at fault raises ``ValueError`` (before its first output) or
        ``SequenceError`` (it failed inside a step; the rest of the batch did not). ``timing``: filled in as the
        request passes through the engine."""

    # ---- the prefix cache and its blocks -----------------------------------------------------------------------
    @abc.abstractmethod
    def namespace(self, cache_salt: str = "", lora: str = "") -> NamespaceSeed:
        """The seed of a request's block keys: the model, the tokenizer, the adapter's ``name@generation`` and
        the salt. ValueError naming the adapters served when ``lora`` is not one of them."""

    @abc.abstractmethod
    async def match_prefix(self, namespace: NamespaceSeed, tokens: Sequence[int], max_tokens: int) -> int:
        """How many leading full blocks of ``tokens`` (within ``max_tokens``) this engine holds, in any tier."""

    @abc.abstractmethod
    def holds(self, namespace: NamespaceSeed, tokens: Sequence[int], max_blocks: int) -> int:
        """How many leading full blocks of ``tokens`` (at most ``max_blocks``) it has on the device now, read
        from a snapshot without waiting for the engine (decode answers with it the moment it accepts a call; the
        pin that follows may find fewer, should one be evicted in between)."""

    @abc.abstractmethod
    async def pin(self, lease: str, namespace: NamespaceSeed, tokens: Sequence[int], max_blocks: int) -> int:
        """Hold the leading full blocks of ``tokens`` it has on the device (at most ``max_blocks``) under
        ``lease`` until ``unpin``, so a push that starts past them can be imported. Returns how many."""

    @abc.abstractmethod
    def unpin(self, lease: str) -> None:
        """Let go of a pin (nothing when ``lease`` holds none). Queued, never waits."""

    @abc.abstractmethod
    async def reserve(self, lease: str, request: EngineRequest, first_block: int) -> Reserved | None:
        """Set aside blocks for ``request``'s prompt from ``first_block`` on, for a push to land in; None when
        there is no room or this engine cannot be written from outside (the push is then buffered)."""

    @abc.abstractmethod
    def release(self, lease: str) -> None:
        """Free a reservation's blocks unless an import adopted them; the caller revoked its landing first.
        Queued, never waits."""

    @abc.abstractmethod
    async def adopt(self, namespace: NamespaceSeed, tokens: Sequence[int], first_block: int, data: memoryview,
                    num_blocks: int) -> bool:
        """Put full blocks fetched from the pool (``num_blocks`` whole blocks of ``tokens`` from ``first_block``
        on, their bytes in wire order) into the prefix cache, unreferenced. False when there is no room or the
        blocks before ``first_block`` are gone."""

    @abc.abstractmethod
    async def held_blocks(self) -> list[tuple[BlockKey, str]]:
        """Every full block it caches and its tier (what a KV-event snapshot reports)."""

    @abc.abstractmethod
    def subscribe(self, sink: KVEventSink) -> None:
        """Hand the engine's KV events (block keys of ``namespace``) to ``sink`` on the event loop, in order."""

    # ---- what the cluster says about the cached blocks ---------------------------------------------------------
    def signal_session(self, signal: SessionSignal) -> None:
        """A session ended or paused (``SessionSignal``): what it holds goes first, or is kept (and warmed back
        before it is expected) while it waits on a tool. Queued, never waits; an engine that keeps no sessions
        ignores it."""

    def on_session_due(self, sink: Callable[[str], None]) -> None:
        """``sink(session)`` on the event loop when a paused session is about to return, by the engine's own
        estimate (the pause the client announced, else the session's cadence): the host fetches what the pool
        holds of its context then. An engine that keeps no sessions never calls it."""

    def cluster_copies(self, shared: Sequence[BlockKey], sole: Sequence[BlockKey]) -> None:
        """Of its blocks, ``shared`` have another copy in the cluster now and ``sole`` no longer do (cachesvc's
        word): it evicts the former first. Queued, never waits; an engine that cannot use it ignores it."""

    # ---- the KV correctness canary (the native engine's: engine/canary.py) ------------------------------------
    def canary_counts(self) -> Mapping[tuple[str, str], int]:
        """Reused prefixes recomputed and compared, by (path, outcome: ok | diverged); racy read. An engine
        without a canary has none."""
        return {}

    def on_quarantine(self, sink: Callable[[list[BlockKey], str], None]) -> None:
        """``sink(keys, path)`` on the event loop when the canary quarantines blocks (the host tells the pool)."""

    # ---- LoRA adapters ---------------------------------------------------------------------------------------
    @abc.abstractmethod
    async def load_lora(self, name: str, path: str) -> AdapterInfo:
        """Load (or replace) adapter ``name`` from a PEFT directory; ValueError naming what to fix."""

    @abc.abstractmethod
    async def unload_lora(self, name: str) -> None:
        """Forget adapter ``name``; KeyError when it is not loaded. Requests in flight under it finish."""

    @abc.abstractmethod
    def adapters(self) -> list[AdapterInfo]:
        """The adapters served now, by name."""

    # ---- load and speed --------------------------------------------------------------------------------------
    @abc.abstractmethod
    def load(self) -> EngineLoad:
        """Queues and KV occupancy now (heartbeats, admission)."""

    @abc.abstractmethod
    def speed(self) -> Speed:
        """The measured speed the router prices this instance with (unmeasured fields None)."""

    @abc.abstractmethod
    def stats(self) -> EngineStats:
        """Counters and gauges for the instance's metrics."""

    @abc.abstractmethod
    async def close(self) -> None:
        """Stop: requests in flight end, the engine's threads and processes are gone when it returns."""
