"""The router's request path: an admitted request (``intake``) → block keys → MatchPrefix → pick instances →
Decode (+ Prefill) → chunks.

Both client surfaces (gRPC and OpenAI HTTP) call ``Router.generate`` with what ``Intake.admit`` admitted; errors
come out as ``RequestError`` (``errors``), whose kind each surface maps to its status code.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import socket
import time
from array import array
from collections.abc import AsyncIterator, Awaitable, Callable, Coroutine, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, NamedTuple

import grpc
from kvmesh import tls
from kvmesh.bus import Bus, Subjects
from kvmesh.bus.shard_directory import DISCOVER, ShardDirectory
from kvmesh.contracts.engine import (
    SessionHint,
    TokenLogprobs,
    logprobs_from_proto,
    prompt_length,
    retention_to_proto,
    unpacked,
)
from kvmesh.contracts.ids import (
    HELD_BLOCKS_METADATA,
    PUSH_TOKEN_METADATA,
    TRANSFER_VERSIONS_METADATA,
    BlockKey,
    RequestId,
    TransferId,
)
from kvmesh.contracts.keys import Namespace, block_keys, int32s
from kvmesh.contracts.messages import PACKED_PROMPT, Heartbeat, KVReady, Message, RouterLoad
from kvmesh.contracts.sampling import LOGITS, PROMPT_LOGPROBS, SPECIAL_TOKENS, SamplingParams, sampling_to_proto
from kvmesh.contracts.shards import ShardMap, pool_entries
from kvmesh.contracts.slo import slo_to_proto
from kvmesh.model_source.resolve import resolve_model
from kvmesh.model_source.tokenizer import Tokenizer
from kvmesh.proto.v1 import cache_pb2, cache_pb2_grpc, worker_pb2, worker_pb2_grpc
from kvmesh.routing import CostModel
from kvmesh.routing.plan import POOL, FleetView, Local, Refuse, RouteAsk, plan
from kvmesh.settings import RouterSettings, SharedSettings
from kvmesh.telemetry import tracing
from opentelemetry.trace import Span, SpanKind, StatusCode

from services.router.errors import ErrorKind, RequestError, invalid
from services.router.hits import HitLedger, Routed, record
from services.router.holders import HolderNames, combine_packed
from services.router.intake import Admitted
from services.router.loras import Adapters
from services.router.match_batch import MatchBatcher
from services.router.migration import Migration, Migrations
from services.router.prompt_keys import PromptKeys
from services.router.reasoning import THINK_TAIL, begins_inside
from services.router.reasoning import enabled as reasoning_enabled
from services.router.recent import RecentPrefixes, merged
from services.router.registry import Instance, Registry
from services.router.scheduling import Policies, view
from services.router.sessions import Sessions
from services.router.stalls import StallWatch
from services.router.telemetry import RequestTrace, RouterMetrics
from services.router.tool_formats import keeps_special_tokens, pick

log = logging.getLogger(__name__)
RETRIES = 2    # re-dispatches of a request whose instance was unreachable before it streamed a token
LOAD_REFRESH_S = 1.0  # this router's in-flight counts go to its replicas on every change, and at least this often,
LOAD_EVERY_S = 0.02  # but at most this often (one report a dispatch start and end cost ~3% of a busy router's CPU)


# what a request sets that needs each engine feature (``SamplingParams.features``), for the refusal's words
FEATURE_FIELDS = {LOGITS: "presence, frequency or repetition penalty, min_p, min_tokens or logit_bias",
                  PROMPT_LOGPROBS: "prompt_logprobs (echo with logprobs)",
                  SPECIAL_TOKENS: "skip_special_tokens false (or tools in a form written in special tokens)"}


@dataclass
class Usage:
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int


@dataclass
class Chunk:
    token_ids: list[int]
    text: str
    finished: bool = False
    finish_reason: str = ""
    usage: Usage | None = None
    logprobs: tuple[TokenLogprobs, ...] = ()  # one per token, when the request asked for them
    # the first chunk's, when the request set prompt_logprobs: one per prompt token after the first
    prompt_logprobs: tuple[TokenLogprobs, ...] = ()


CachedTokens = Callable[[], Awaitable[int]]  # a dispatch's prompt tokens reused, once it can tell
ChunkStream = AsyncIterator[tuple[Chunk, CachedTokens]]  # one dispatch's chunks, each with its reader of those
Metadata = tuple[tuple[str, str], ...]  # a gRPC call's metadata


@dataclass
class _Shards:
    """The cachesvc shards a router asks, and what it keeps per shard list (a new list starts these afresh)."""

    addresses: tuple[str, ...]
    channels: list[grpc.aio.Channel]
    maps: dict[int, ShardMap] = field(default_factory=dict)  # index copies -> the map (the shards say how many)
    down: set[int] = field(default_factory=set)  # shards whose last MatchPrefix failed
    timeout_s: float = 0.5  # MatchPrefix's deadline
    stubs: list[cache_pb2_grpc.CacheServiceStub] = field(init=False)
    names: HolderNames = field(init=False)  # what packed MatchPrefix answers' ids name
    batchers: list[MatchBatcher] = field(init=False)  # each shard's questions, a call per turn of the event loop

    def __post_init__(self) -> None:
        self.stubs = [cache_pb2_grpc.CacheServiceStub(channel) for channel in self.channels]
        self.names = HolderNames(len(self.stubs))
        self.batchers = [MatchBatcher(channel, self.timeout_s, f"cachesvc shard {i}" if len(self.stubs) > 1
                                      else "cachesvc") for i, channel in enumerate(self.channels)]

    def shard_map(self, copies: int) -> ShardMap:
        smap = self.maps.get(copies)
        if smap is None:
            if self.maps:
                log.warning("the cachesvc shards index each key %d times now (was %s)", copies,
                            ", ".join(map(str, self.maps)))
            smap = self.maps[copies] = ShardMap(len(self.stubs), max(copies, 1))
        return smap


class Router:
    def __init__(self, cfg: RouterSettings, shared: SharedSettings | None = None) -> None:
        self.cfg = cfg
        self.shared = shared or SharedSettings()
        self.id = cfg.id or f"router-{socket.gethostname()}-{os.getpid()}"
        self.subjects = Subjects(self.shared.cluster)
        self._channels: dict[str, grpc.aio.Channel] = {}
        self.shards = _Shards((), [])  # the cachesvc shards (start: configured, or found through the bus)
        self.shard_directory: ShardDirectory | None = None
        self.metrics = RouterMetrics()
        self.policies = Policies(cfg.policy, CostModel(prefill_tok_per_s=cfg.prefill_tok_per_s), cfg.slo_ttft_s)
        self.loras = Adapters(lambda: self.registry, self._channel, cfg.lora_root)
        self.migrations = Migrations(cfg.migration_limit, cfg.max_concurrent_migrations, self.metrics)
        self.stalls = StallWatch(lambda: self.registry, cfg.inter_token_timeout_s)
        self._tasks: set[asyncio.Task] = set()
        self._load_pending = False
        self._load_sent = 0.0  # time.monotonic() of the last load report
        # long prompts are tokenized here, off the event loop and several at once (the tokenizer releases the GIL)
        self.tokenize_pool = ThreadPoolExecutor(cfg.tokenize_threads or usable_cores(), "tokenize")
        self.sessions = Sessions(lambda msg: self.bus.publish(self.subjects.sessions, msg), cfg.session_affinity,
                                 cfg.session_overload, cfg.max_sessions,
                                 share=lambda msg: self.bus.publish(self.subjects.router_sessions, msg))

    def thinking(self, prompt: Sequence[int]) -> bool | None:
        """Whether a chat's output begins inside its reasoning (the prompt's tail leaves a ``<think>`` open: its
        template opened it for the model); None when the router splits no reasoning out (``reasoning_parser``)."""
        if not self.reasoning:
            return None
        return begins_inside(self.tokenizer.decode(list(prompt[-THINK_TAIL:]), skip_special_tokens=False))

    async def start(self) -> None:
        loop = asyncio.get_running_loop()
        self.source = await loop.run_in_executor(None, resolve_model, self.cfg.model)
        self.tokenizer = await loop.run_in_executor(None, Tokenizer.from_dir, self.source.hf_dir)
        if self.cfg.tokenize_cache_mb > 0:
            cache = await loop.run_in_executor(None, self.tokenizer.reuse_prefixes, self.cfg.tokenize_cache_mb << 20)
            self.metrics.watch_tokenizing(cache)
            if not cache.enabled:
                log.warning("prompts are tokenized whole: %s", cache.why_off)
        self.tool_format = pick(self.cfg.tool_call_parser, self.tokenizer.chat_template)
        self.sessions.call_format = self.tool_format
        # the markers its calls are found by are special tokens here: requests with tools keep them in the text
        self.tool_keeps_special = keeps_special_tokens(self.tool_format, self.tokenizer.special_texts)
        if self.tool_keeps_special:
            log.info("tool calls in the %s form: its markers are special tokens of this tokenizer, so requests "
                     "offering tools keep special tokens in their text", self.tool_format.name)
        self.reasoning = reasoning_enabled(self.cfg.reasoning_parser, self.tokenizer.chat_template)
        self.max_model_len = self.source.config.max_position_embeddings
        self.model_id = self.cfg.model_name or _model_name(self.cfg.model, self.source.hf_dir)
        self.registry = Registry(self.cfg.instance_timeout_s, self.cfg.block_size, self.source.fingerprint)
        self.recent = RecentPrefixes(self.cfg.recent_prefix_ttl_s)  # prompts sent, until the index has them
        self.hits = HitLedger(self.cfg.block_size)  # what it heard of each block: why a request missed
        self.prompt_keys = PromptKeys(self.cfg.block_size)  # hashes what a prompt adds to the last that began alike
        self.registry.on_drop = self._dropped
        self.metrics.watch(self.registry)
        self.metrics.watch_sessions(self.sessions)
        self.bus = await Bus.connect(self.shared.nats_url, name=self.id, tls=tls.bus_tls(self.shared))
        self.registry.bus_up = lambda: self.bus.nc.is_connected
        self.registry.on_change = self._load_changed
        await self.bus.subscribe(self.subjects.heartbeats_all, self._on_heartbeat)
        await self.bus.subscribe(self.subjects.router_load_all, self._on_router_load)
        await self.bus.subscribe(self.subjects.kv_events_all, self.hits.on_events)
        await self.bus.subscribe(self.subjects.pool_events, self.hits.on_events)  # the pool's evictions too
        await self.bus.subscribe(self.subjects.sessions, self.sessions.heard)
        await self.bus.subscribe(self.subjects.router_sessions, self.sessions.heard)
        # the cachesvc shards, in shard order (one: an unsharded cachesvc): configured, or as their beats say
        if self.cfg.cachesvc_address == DISCOVER:
            self.shard_directory = ShardDirectory(on_change=self._use_shards)
            await self.shard_directory.start(self.bus, self.subjects)
        else:
            self._use_shards(tuple(a.strip() for a in self.cfg.cachesvc_address.split(",") if a.strip()))
        self._spawn(self._tend())

    async def stop(self) -> None:
        for task in self._tasks:
            task.cancel()
        self.tokenize_pool.shutdown(wait=False, cancel_futures=True)
        await self.bus.close()
        for ch in self._channels.values():
            await ch.close()

    def _spawn(self, coro: Coroutine[Any, Any, None]) -> None:
        task = asyncio.ensure_future(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def _dropped(self, instance_id: str) -> None:
        """An instance went away (or restarted): it holds nothing it was sent, nor any block it stored."""
        self.recent.forget(instance_id)
        self.hits.history.cleared(instance_id)

    async def _on_heartbeat(self, beat: Message, headers: dict[str, str]) -> None:
        if isinstance(beat, Heartbeat) and beat.role.is_engine:
            self.registry.observe(beat)

    # ---- the router replicas' shared view of what is in flight where ---------------------------------------------
    async def _on_router_load(self, load: Message, headers: dict[str, str]) -> None:
        if isinstance(load, RouterLoad) and load.router_id != self.id:
            self.registry.peer_load(load)

    def _load_changed(self) -> None:
        """A dispatch started or ended: tell the replicas once this turn of the event loop is over (the
        dispatches of one turn go out as one report), or ``LOAD_EVERY_S`` after the last report if that is
        later (the changes meanwhile go out as one report then)."""
        if self._load_pending:
            return
        self._load_pending = True
        wait = self._load_sent + LOAD_EVERY_S - time.monotonic()
        if wait > 0:
            asyncio.get_running_loop().call_later(wait, lambda: self._spawn(self._publish_load()))
        else:
            self._spawn(self._publish_load())

    async def _publish_load(self) -> None:
        self._load_pending = False
        self._load_sent = time.monotonic()
        inflight, tokens = self.registry.own_load()
        with contextlib.suppress(Exception):  # the bus is down: the next report, after it, repairs the counts
            await self.bus.publish(self.subjects.router_load(self.id), RouterLoad(self.id, time.time(), inflight,
                                                                                  tokens))

    async def _tend(self) -> None:
        """Drop silent instances promptly (their streams migrate) and remind the replicas of this router's load
        (a report is dropped after ``instance_timeout_s`` without one: a dead router's counts go)."""
        every = min(0.5, self.cfg.instance_timeout_s / 4)
        last = 0.0
        while True:
            await asyncio.sleep(every)
            self.registry.expire()
            self.stalls.check()
            if time.monotonic() - last >= LOAD_REFRESH_S:
                last = time.monotonic()
                await self._publish_load()

    def _channel(self, address: str) -> grpc.aio.Channel:
        if address not in self._channels:
            self._channels[address] = tls.aio_channel(address, [("grpc.max_receive_message_length", 64 * 2**20)])
        return self._channels[address]

    def _use_shards(self, addresses: tuple[str, ...]) -> None:
        """Route with these cachesvc shards from now on (a MatchPrefix under way finishes with the list it
        started with; the channels of addresses the new list lacks close once such calls are over)."""
        gone = set(self.shards.addresses) - set(addresses)
        self.shards = _Shards(addresses, [self._channel(a) for a in addresses], timeout_s=self.cfg.match_timeout_s)
        if gone:
            asyncio.get_running_loop().call_later(max(10.0, 4 * self.cfg.match_timeout_s),
                                                  lambda: self._spawn(self._retire(gone)))

    async def _retire(self, addresses: set[str]) -> None:
        for address in addresses - set(self.shards.addresses):  # unless a later list has it again
            channel = self._channels.pop(address, None)
            if channel is not None:
                await channel.close()

    @property
    def cache(self) -> list[cache_pb2_grpc.CacheServiceStub]:
        """One stub per cachesvc shard, in shard order."""
        return self.shards.stubs

    # ---- routing ---------------------------------------------------------------------------------------------

    async def matched_blocks(self, keys: Sequence[BlockKey], parent: Span | None = None,
                             attrs: dict | None = None) -> dict[str, int]:
        """Per instance, the longest run of leading blocks it holds in any tier. Traced as the client span
        ``cachesvc.match_prefix`` under ``parent``, whose context the call carries to cachesvc."""
        shards = self.shards
        stubs = shards.stubs
        if not stubs or not keys:
            return {}
        span = tracing.start("cachesvc.match_prefix", parent, SpanKind.CLIENT,
                             {**(attrs or {}), "kvmesh.blocks": len(keys)})
        metadata = tracing.grpc_metadata(span) + tracing.request_metadata(attrs)
        sharded = len(stubs) > 1

        names = shards.names
        names.maybe_reset()
        copies: set[int] = set()

        async def ask(shard: int, known: int) -> cache_pb2.MatchPrefixResponse | None:
            view = cache_pb2.ShardView(shard=shard, shards=len(stubs)) if sharded else None
            try:
                resp = await shards.batchers[shard].ask(
                    cache_pb2.MatchPrefixRequest(block_keys=keys, view=view, packed=True, holders_epoch=known),
                    metadata)
            except grpc.aio.AioRpcError as e:
                self.metrics.match_errors.inc()
                if shard not in shards.down:  # once per outage, not per request
                    shards.down.add(shard)
                    where = f"cachesvc shard {shard}" if sharded else "cachesvc"
                    log.warning("MatchPrefix on %s failed (%s: %s); routing without its keys until it answers",
                                where, e.code().name, e.details())
                return None
            if shard in shards.down:
                shards.down.discard(shard)
                log.info("cachesvc%s answers MatchPrefix again", f" shard {shard}" if sharded else "")
            copies.add(resp.index_copies)
            return resp

        got = await asyncio.gather(*(ask(i, names.epoch(i)) for i in range(len(stubs))))
        responses = {i: r for i, r in enumerate(got) if r is not None}
        answers = {i: a for i, r in responses.items() if (a := names.read(i, r)) is not None}
        if len(answers) < len(responses):  # a packed answer whose names this router no longer has: once more
            again = [i for i in responses if i not in answers]
            for i, r in zip(again, await asyncio.gather(*(ask(i, 0) for i in again))):
                if r is not None:
                    responses[i] = r
            # read every answer again in one step: the numbering may have started again meanwhile
            answers = {i: a for i, r in responses.items() if (a := names.read(i, r)) is not None}
        if not answers:
            span.set_status(StatusCode.ERROR, "MatchPrefix failed on every cachesvc shard; routing by load only")
            span.end()
            return {}
        if len(answers) < len(stubs):  # the keys no shard that answered owns are cut off
            span.set_attribute("kvmesh.shards_missing", [i for i in range(len(stubs)) if i not in answers])
        if sharded:
            numbers, counts = combine_packed(shards.shard_map(min(copies)), keys, answers, len(names))
            pools = {i: [(h.tier, int.from_bytes(h.positions, "little")) for h in responses[i].pool_held]
                     for i in answers}
            pool = pool_entries(len(keys), pools)
        else:
            numbers, counts = answers[0]
            pool = [(m.instance_id, m.tier, m.num_blocks) for m in responses[0].matches if m.instance_id == POOL]
        best = names.best(numbers, counts)
        if pool:
            best[POOL] = max(n for _, _, n in pool)
        if span.is_recording():
            span.set_attribute("kvmesh.matched", [f"{k}={v}" for k, v in sorted(best.items())])
        span.end()
        return best

    async def generate(self, request: Admitted, rt: RequestTrace) -> AsyncIterator[Chunk]:
        """Route, dispatch and stream one admitted request. ``rt``: its root span and TTFT clock, which the API
        layer owns. An instance found unreachable before it streamed a token costs a retry on another one (at
        most ``RETRIES``), never the request; one that fails after it streamed some costs a migration
        (``migration.py``): the request goes on elsewhere from the tokens streamed so far, within the migration
        limits. Any other failure, or one past the limits, goes out as the error."""
        # the engines' namespace for this adapter: name@generation (the generation the instances hold)
        lora_id = self.loras.lora_id(request.lora) if request.lora else ""
        tries = _Attempts(Namespace(self.source.fingerprint, self.tokenizer.fingerprint, lora_id,
                                    request.cache_salt).seed, list(request.resume))
        try:
            while True:
                stream = await self._dispatch(request, rt, tries)
                try:
                    async for chunk in self._relay(stream, request, rt, tries):
                        yield chunk
                    return
                except RequestError as e:
                    await self._next_attempt(e, request, rt, tries)
        finally:  # the client went away (or the error went out) while a migration was under way
            if tries.migration is not None:
                tries.migration.failed(RequestError(ErrorKind.CANCELLED, "the request ended during its migration"))

    async def _dispatch(self, request: Admitted, rt: RequestTrace, tries: _Attempts) -> ChunkStream:
        """One attempt's route, planned and started (its chunk stream); the prompt's match is asked again only
        when the prompt grew (a migration carries the tokens streamed so far)."""
        # the prompt as int32, for the keys and the wire alike (the intake's packing serves one that did not grow)
        packed = request.packed if not tries.streamed else None
        prompt = packed if packed is not None else int32s(request.prompt + tuple(tries.streamed))
        route = rt.child("router.route", attrs={**({"kvmesh.retry": tries.retries} if tries.retries else {}),
                                                **({"kvmesh.migration": tries.migrations} if tries.migrations else {})})
        try:
            if tries.matched_for != len(prompt):
                tries.keys, plain = self.prompt_keys(tries.seed, prompt)
                matched = await self.matched_blocks(tries.keys, route, rt.attrs)
                recent = self.recent.matched(tries.keys, [i.id for i in self.registry.alive()])
                tries.matched = merged(matched, recent)
                tries.matched_for = len(prompt)
                tries.routed = self.hits.routing(tries.seed, tries.keys, plain)
                tries.routed.indexed, tries.routed.recent = matched, recent
            # a prompt scored (prompt_logprobs) is computed whole where it decodes: no cache, pool or push serves it
            # (a continued one has them: they went out with its first token)
            sampling, scores = request.sampling, request.sampling.prompt_logprobs is not None
            if scores and tries.streamed:
                sampling, scores = replace(sampling, prompt_logprobs=None), False
            matched = {} if scores else tries.matched
            if tries.routed is not None:
                tries.routed.scored = scores  # its misses are by design, not the cache's
            route.set_attribute("kvmesh.pool_blocks", matched.get(POOL, 0))
            stream = self._route(self._work(request, sampling, prompt, rt, tries, matched), matched, rt,
                                 request.policy, route, tries.avoid | self._lacking(sampling.features),
                                 "never" if scores else request.disaggregate or self.cfg.disaggregate, tries.keys,
                                 tries.routed, request.session)
            if stream is None:
                if tries.failure is not None:  # nowhere else to go: the error of the last attempt stands
                    raise tries.failure
                route.set_status(StatusCode.ERROR, "no engine instances are up")
                raise RequestError(ErrorKind.UNAVAILABLE, "no engine instances are up (need a prefill and a "
                                                          "decode instance, or one with role both)")
            return stream
        except RequestError as e:
            if tries.migration is not None:
                tries.migration.failed(e)
            raise
        finally:
            route.end()

    def _work(self, request: Admitted, sampling: SamplingParams, prompt: array, rt: RequestTrace,
              tries: _Attempts, matched: dict[str, int]) -> worker_pb2.WorkRequest:
        """The wire form of one attempt: the prompt with the tokens streamed so far (packed: an instance of an
        older build gets it as ``_for`` gives it), its own dispatch id."""
        return worker_pb2.WorkRequest(
            request_id=_dispatch_id(request, tries.retries, tries.migrations), prompt_packed=prompt.tobytes(),
            sampling=sampling_to_proto(sampling), cache_salt=request.cache_salt,
            pool_blocks=matched.get(POOL, 0), lora_name=request.lora, generated_tokens=len(tries.streamed),
            session_key=request.session.key if request.session else "",
            session_end=bool(request.session and request.session.end),
            retention=retention_to_proto(request.retention), slo=slo_to_proto(request.slo),
            waited_s=time.monotonic() - rt.t0)

    async def _relay(self, stream: ChunkStream, request: Admitted, rt: RequestTrace,
                     tries: _Attempts) -> AsyncIterator[Chunk]:
        """The attempt's chunks to the client; the last one with the request's usage."""
        tries.delivered, tries.cached = 0, None
        async for chunk, cached in stream:
            tries.cached = cached
            if tries.migration is not None:
                tries.migration.arrived()
                tries.migration = None
            rt.chunk_arrived()
            tries.streamed += chunk.token_ids
            tries.delivered += len(chunk.token_ids)
            if request.session is not None:
                tries.text.append(chunk.text)
            if chunk.finished:
                reused = tries.first_cached if tries.first_cached is not None else await cached()
                chunk.usage = Usage(len(request.prompt), len(tries.streamed), min(reused, len(request.prompt)))
                rt.usage(len(request.prompt), len(tries.streamed), chunk.usage.cached_tokens)
                self._attribute(request, rt, tries, chunk.usage.cached_tokens)
                event = self.sessions.finished(request.session, "".join(tries.text), chunk.finish_reason)
                if event is not None:
                    rt.root.set_attribute("kvmesh.session.signal", event.value)
            yield chunk

    def _attribute(self, request: Admitted, rt: RequestTrace, tries: _Attempts, delivered: int) -> None:
        """The finished request's hit attribution: on its root span and in the missed-token metrics."""
        routed = tries.first_routed or tries.routed
        if routed is None:
            return
        att = self.hits.settle(routed, len(request.prompt), delivered)
        if rt.root.is_recording() and not rt.sibling:  # the blocks it leaves, its output's too: what the
            # report's optimum replays (a later choice's, n > 1, are the first one's prompt again)
            left = block_keys(tries.seed, list(request.prompt) + tries.streamed, self.cfg.block_size)
            record(rt.root, att, left, self.cfg.block_size)
        tenant = str(rt.attrs.get(tracing.TENANT, ""))
        self.metrics.hits(att, tenant)

    async def _next_attempt(self, e: RequestError, request: Admitted, rt: RequestTrace, tries: _Attempts) -> None:
        """After an attempt failed with ``e``: a retry elsewhere (it streamed nothing), a migration (it streamed
        some), or ``e`` raised (not retryable, or past the limits)."""
        if e.kind == ErrorKind.INTERNAL:
            log.error("request %s (trace %s): %s", request.request_id, rt.trace_id, e.message)
        if not e.retryable or (tries.delivered == 0 and tries.retries == RETRIES):
            if tries.migration is not None:
                tries.migration.failed(e)
            raise e
        if tries.delivered == 0:  # this instance streamed nothing: another one takes the same dispatch
            tries.retries += 1
            log.warning("request %s (trace %s): %s; retrying on another instance", request.request_id,
                        rt.trace_id, e.message)
            rt.retry(self.registry.role_of(e.instance), e.instance, e.message)
        else:  # it streamed, then failed: the request goes on elsewhere after what it streamed
            tries.migration = await self.migrations.start(rt, e, tries.migrations, len(tries.streamed))
            if tries.migration is None:
                raise e
            tries.migrations += 1
            if tries.first_cached is None and tries.cached is not None:
                tries.first_cached = await _cached_or_zero(tries.cached)
                tries.first_routed = tries.routed
            log.warning("request %s (trace %s): %s after %d tokens; migrating (%d of at most %d)",
                        request.request_id, rt.trace_id, e.message, len(tries.streamed), tries.migrations,
                        self.migrations.per_request)
        tries.failure = e
        tries.avoid.add(e.instance)

    def _route(self, work: worker_pb2.WorkRequest, matched: dict[str, int], rt: RequestTrace,
               policy: str | None, route: Span, avoid: set[str], disaggregate: str = "auto",
               keys: Sequence[int] = (), routed: Routed | None = None,
               session: SessionHint | None = None) -> ChunkStream | None:
        """Plan the request's route (``kvmesh.routing.plan``) and start it: the chosen instances' chunk stream,
        or None when no live instance (outside ``avoid``) can serve. ``session``: the request's, with its hints."""
        ask = RouteAsk(prompt_length(work), policy or self.policies.default, ttft_left(work), work.slo.itl_s,
                       disaggregate, session, explain=route.is_recording())
        planned = plan(ask, self._fleet(matched, avoid, work.lora_name, session), self.policies.get(policy))
        if planned is None:
            return None
        if route.is_recording():
            route.set_attributes(dict(planned.attributes))
        if planned.session_at is not None:
            self.sessions.ran(session, planned.session_at)
        self.sessions.moved += planned.session_moved
        if isinstance(planned, Refuse):
            raise RequestError(ErrorKind.OVERLOADED, planned.reason)
        routed = routed or Routed(keys, (), 0)
        attrs = planned.attributes
        if isinstance(planned, Local):
            routed.compute = planned.instance
            routed.reason = str(planned.reason or attrs.get("kvmesh.route.both.reason")
                                or attrs.get("kvmesh.route.reason", ""))
            routed.unconvertible = self._instance(planned.instance).beat.kv_unconvertible
            return self._local(work, self._sent(keys, self._instance(planned.instance)), rt, planned.reason,
                               matched, routed)
        routed.compute = planned.prefill
        routed.reason = str(attrs.get("kvmesh.route.prefill.reason") or planned.reason)
        routed.unconvertible = self._instance(planned.prefill).beat.kv_unconvertible
        # decode waits for kv.ready its own kv_timeout_s past this estimate of prefill + push: a long cold
        # prompt must not time out while prefill is still computing it
        return self._disaggregated(work, self._sent(keys, self._instance(planned.prefill)),
                                   self._sent(keys, self._instance(planned.decode)), rt, policy, matched,
                                   planned.expected_prefill_s, routed)

    def _fleet(self, matched: dict[str, int], avoid: set[str], lora: str, session: SessionHint | None) -> FleetView:
        """The live instances outside ``avoid`` as the planner sees them, with the request's session home."""
        views = tuple(view(i, self.policies.cost, self.loras.holds(i, lora))
                      for i in self.registry.alive() if i.id not in avoid)
        home = self.sessions.home(session) if self.sessions.affinity else None
        return FleetView(views, matched, self.cfg.block_size, self.policies.cost,
                         self.registry.replica_rank(self.id), self.registry.bus_up(), home, self.sessions.overload,
                         self.cfg.session_move_margin_s)

    def _instance(self, iid: str) -> Instance:
        return self.registry.get(iid)

    def _lacking(self, needs: tuple[str, ...]) -> set[str]:
        """The live instances that do not apply all of ``needs`` (``SamplingParams.features``: an engine of an
        older build ignores what it does not know); when that is every one, the request is UNAVAILABLE."""
        if not needs:
            return set()
        alive = self.registry.alive()
        lacking: set[str] = {i.id for i in alive if not set(needs) <= set(i.beat.features)}
        if alive and len(lacking) == len(alive):
            what = " or ".join(FEATURE_FIELDS.get(n, n) for n in needs)
            raise RequestError(ErrorKind.UNAVAILABLE, f"no instance applies the {what} this request sets: the "
                               "engines run a build from before them (upgrade the engines, or send the request "
                               "without them)")
        return lacking

    def _to_compute(self, work: worker_pb2.WorkRequest, inst: Instance, matched: dict[str, int] | None) -> int:
        """The prompt tokens ``inst`` will compute for ``work``: what the match says it does not hold, which is
        what its prefill queue grows by (a prompt it holds costs it next to nothing)."""
        prompt = prompt_length(work)
        held = (matched or {}).get(inst.id, 0) * self.cfg.block_size
        return max(1, prompt - min(held, prompt - 1))

    def _sent(self, keys: Sequence[int], inst: Instance) -> Instance:
        """``inst`` gets the prompt of ``keys``: count its blocks there until the index has them."""
        self.recent.dispatched(inst.id, keys)
        return inst

    async def _ensure_lora(self, work: worker_pb2.WorkRequest, *instances: Instance) -> None:
        """The request's adapter on each chosen instance (loaded there when missing: priced in routing)."""
        for inst in instances:
            if work.lora_name:
                await self.loras.ensure(inst, work.lora_name)

    async def _local(self, work: worker_pb2.WorkRequest, inst: Instance, rt: RequestTrace, reason: str = "",
                     matched: dict[str, int] | None = None, routed: Routed | None = None) -> ChunkStream:
        await self._ensure_lora(work, inst)
        done = self.registry.dispatched(inst, self._to_compute(work, inst, matched))
        dispatch = rt.child("router.dispatch", SpanKind.CLIENT, {"kvmesh.decode_instance": inst.id,
                                                                 tracing.DISPATCH_ID: work.request_id})
        call = worker_pb2_grpc.DecodeStub(self._channel(inst.beat.grpc_address)).Decode(
            worker_pb2.DecodeRequest(work=_for(inst, work), prefill_locally=True, route_reason=reason),
            metadata=_metadata(dispatch, rt), timeout=self.cfg.request_timeout_s)
        cached = 0

        async def cached_tokens() -> int:
            return cached

        try:
            async for msg, first in self._chunks(call, inst, work.request_id):
                if first:
                    cached = msg.cached_tokens
                    if routed is not None:
                        routed.pool_fetch = msg.pool_fetch
                    done(prefilled=True)
                yield _chunk(msg), cached_tokens
        finally:
            done()
            dispatch.end()

    async def _disaggregated(self, work: worker_pb2.WorkRequest, prefill: Instance, decode: Instance,
                             rt: RequestTrace, policy: str | None, matched: dict[str, int],
                             expected_prefill_s: float = 0.0, routed: Routed | None = None) -> ChunkStream:
        await self._ensure_lora(work, decode, prefill)
        decode_done = self.registry.dispatched(decode)
        dispatch = rt.child("router.dispatch", SpanKind.CLIENT, {"kvmesh.prefill_instance": prefill.id,
                                                                 "kvmesh.decode_instance": decode.id,
                                                                 tracing.DISPATCH_ID: work.request_id})
        md = _metadata(dispatch, rt)
        held = self._decode_holds(work, decode, matched)  # decode pins them; prefill pushes only the rest
        dispatch.set_attribute("kvmesh.decode_cached_blocks", held)
        call = worker_pb2_grpc.DecodeStub(self._channel(decode.beat.grpc_address)).Decode(
            worker_pb2.DecodeRequest(work=_for(decode, work), expected_prefill_s=expected_prefill_s,
                                     cached_blocks=held),
            metadata=md, timeout=self.cfg.request_timeout_s)

        async def prefill_once_granted() -> worker_pb2.PrefillResponse:
            # decode's first response headers carry the push's capability, before it waits for the KV, and the
            # blocks decode holds exactly (the index's count above may lag): prefill pushes only past those
            grant = await _push_grant(call, decode, dispatch)
            return await self._prefill(work, prefill, decode, md, rt, policy, matched,
                                       held if grant.held is None else grant.held, grant)

        prefill_call = asyncio.ensure_future(prefill_once_granted())
        prefill_call.add_done_callback(lambda f: f.cancelled() or f.exception())  # failures are logged inside
        decode_cached, fallback = 0, False

        async def cached_tokens() -> int:
            """What prefill reused; after a decode fallback, what decode reused."""
            if fallback:
                return decode_cached
            done, _ = await asyncio.wait([prefill_call], timeout=1.0)
            ok = done and not prefill_call.cancelled() and not prefill_call.exception()
            if ok and routed is not None:
                routed.pool_fetch = prefill_call.result().pool_fetch
            return prefill_call.result().cached_tokens if ok else 0

        try:
            async for msg, first in self._chunks(call, decode, work.request_id):
                if first:
                    decode_cached, fallback = msg.cached_tokens, msg.kv_fallback
                    if fallback:
                        rt.fallback(msg.fallback_reason)
                        if routed is not None:
                            routed.fallback = msg.fallback_reason or "the pushed KV did not arrive or verify"
                yield _chunk(msg), cached_tokens
        finally:
            decode_done()
            dispatch.end()
            if not prefill_call.done():
                prefill_call.cancel()

    async def _chunks(self, call: grpc.aio.UnaryStreamCall, inst: Instance,
                      request_id: str) -> AsyncIterator[tuple[worker_pb2.DecodeChunk, bool]]:
        """The call's messages (and whether each is the first), watched for stalls from the first on
        (``services.router.stalls``: given up on like a dropped instance's, it migrates). Its failure as a
        ``RequestError``: INVALID_ARGUMENT
        is the request's fault, INTERNAL the instance's (a 500 naming the request, never retried: the request may
        be what breaks it), anything else makes the instance unavailable for it: retryable (elsewhere) when it
        could not be reached, was dropped for silence while streaming (the call is cancelled then), or cannot
        continue a migrated request."""
        lost: list[str] = []

        def on_lost(reason: str) -> None:
            lost.append(reason)
            call.cancel()

        unwatch = self.registry.watch(inst.id, on_lost)
        first, watched = True, None
        try:
            async for msg in call:
                if first:
                    watched = self.stalls.arm(inst.id, on_lost)  # from the first token on
                elif watched is not None:
                    watched.tick()
                yield msg, first
                first = False
        except asyncio.CancelledError:
            task = asyncio.current_task()
            if not lost or (task is not None and task.cancelling()):
                raise
            raise RequestError(ErrorKind.UNAVAILABLE, lost[0], inst.id, retryable=True) from None
        except grpc.aio.AioRpcError as e:
            if lost:
                raise RequestError(ErrorKind.UNAVAILABLE, lost[0], inst.id, retryable=True) from None
            if e.code() == grpc.StatusCode.INVALID_ARGUMENT:
                raise invalid(e.details() or "invalid request") from None
            if e.code() == grpc.StatusCode.CANCELLED:
                raise
            if e.code() == grpc.StatusCode.INTERNAL:
                details = e.details() or "no details"
                if request_id not in details:
                    details = f"request {request_id}: {details}"
                raise RequestError(ErrorKind.INTERNAL, f"internal error on instance {inst.id}: {details}",
                                   inst.id) from None
            raise RequestError(ErrorKind.UNAVAILABLE, f"instance {inst.id} failed: {e.code().name}: {e.details()}",
                               inst.id, retryable=e.code() in (grpc.StatusCode.UNAVAILABLE,
                                                               grpc.StatusCode.FAILED_PRECONDITION)) from None
        finally:
            unwatch()
            self.stalls.disarm(watched)
            call.cancel()

    def _decode_holds(self, work: worker_pb2.WorkRequest, decode: Instance, matched: dict[str, int]) -> int:
        """The leading full blocks of the prompt the decode instance holds (MatchPrefix), at most the blocks
        before the one holding the last prompt token (so a push always carries at least one block)."""
        return min(matched.get(decode.id, 0), (prompt_length(work) - 1) // self.cfg.block_size)

    async def _prefill(self, work: worker_pb2.WorkRequest, prefill: Instance, decode: Instance, md: Metadata,
                       rt: RequestTrace, policy: str | None, matched: dict[str, int], held: int,
                       grant: PushGrant) -> worker_pb2.PrefillResponse:
        """The request's Prefill call, while decode waits for its ``kv.ready``; ``grant``: the push capability
        decode granted, which prefill's every part carries, and the header versions decode reads. An unreachable
        prefill instance is replaced by another one; when none is left (or prefill failed otherwise), decode is
        told at once (``kv.ready`` with ok=False) and recomputes the prompt instead of waiting out
        ``kv_timeout_s``."""
        tried: set[str] = set()
        while True:
            tried.add(prefill.id)
            await self._ensure_lora(work, prefill)  # a replacement prefill may lack the adapter
            done = self.registry.dispatched(prefill, self._to_compute(work, prefill, matched))
            try:
                return await worker_pb2_grpc.PrefillStub(self._channel(prefill.beat.grpc_address)).Prefill(
                    worker_pb2.PrefillRequest(work=_for(prefill, work), decode_instance=decode.id,
                                              decode_transfer_address=decode.beat.transfer_address,
                                              decode_cached_blocks=held, push_token=grant.token,
                                              push_versions=grant.versions),
                    metadata=md, timeout=self.cfg.request_timeout_s)
            except grpc.aio.AioRpcError as e:
                why = f"prefill on {prefill.id} failed: {e.code().name}: {e.details()}"
                log.warning("request %s (trace %s): %s", work.request_id, rt.trace_id, why)
                if e.code() in (grpc.StatusCode.ABORTED, grpc.StatusCode.CANCELLED):
                    raise  # ABORTED: prefill computed but could not push, and told decode itself
                nxt = self._another_prefill(tried, policy, matched, work) \
                    if e.code() == grpc.StatusCode.UNAVAILABLE else None
                if nxt is None:
                    await self._tell_decode(work, decode, prefill, why, grant.token)
                    raise
                rt.retry("prefill", prefill.id, why)
                prefill = nxt
            finally:
                done()

    def _another_prefill(self, tried: set[str], policy: str | None, matched: dict[str, int],
                         work: worker_pb2.WorkRequest) -> Instance | None:
        others = [i for i in self.registry.alive("prefill") if i.id not in tried]
        if not others:
            return None
        missing: set[str] = {i.id for i in others if not self.loras.holds(i, work.lora_name)}
        inst, _ = self.policies.choose(policy, others, matched, prompt_length(work), self.cfg.block_size,
                                       matched.get(POOL, 0), missing)
        return inst or min(others, key=lambda i: (i.queue_depth, i.id))  # an SLO miss beats a recompute

    async def _tell_decode(self, work: worker_pb2.WorkRequest, decode: Instance, prefill: Instance,
                           error: str, token: str) -> None:
        ready = KVReady(request_id=RequestId(work.request_id), decode_instance=decode.id,
                        transfer_id=TransferId(""), block_keys=(), num_tokens=0, first_token=0, layout=None,
                        prefill_instance=prefill.id, ok=False, error=error).signed(token)  # decode checks it
        try:
            await self.bus.publish(self.subjects.kv_ready(decode.id), ready)
        except Exception as e:  # noqa: BLE001 - decode still falls back after kv_timeout_s
            log.warning("could not tell %s that request %s's prefill failed: %s", decode.id, work.request_id, e)


@dataclass
class _Attempts:
    """One request's dispatches so far: what the client has, what the index said, where not to go again."""

    seed: int                      # the namespace seed of the request's block keys
    streamed: list[int]            # every token the client has: a re-dispatch continues after them
    matched: dict[str, int] = field(default_factory=dict)
    keys: list[BlockKey] = field(default_factory=list)  # the prompt's block keys
    matched_for: int = -1          # the prompt length MatchPrefix was asked for
    avoid: set[str] = field(default_factory=set)
    failure: RequestError | None = None
    retries: int = 0
    migrations: int = 0
    migration: Migration | None = None
    first_cached: int | None = None  # the first dispatch's cached tokens, once a migration left it
    routed: Routed | None = None   # the current dispatch's route, as hit attribution needs it
    first_routed: Routed | None = None  # the first dispatch's, once a migration left it
    text: list[str] = field(default_factory=list)  # a session's response so far: whether it ended in a tool call
    delivered: int = 0             # tokens the current attempt streamed
    cached: CachedTokens | None = None  # the current attempt's cached-tokens reader


class NoGrant(RuntimeError):
    """Decode answered a Decode call without a push capability: it failed (its stream says how), so no Prefill."""


class PushGrant(NamedTuple):
    """What decode's Decode call's initial metadata hands prefill through the router."""

    token: str       # the push capability
    versions: str    # the transfer header versions decode reads, passed on as it came ("": an older decode)
    held: int | None  # the prompt's leading blocks decode holds (None from a decode that does not say)


async def _push_grant(call: grpc.aio.UnaryStreamCall, decode: Instance, dispatch: Span) -> PushGrant:
    """The push capability decode sent in the Decode call's initial metadata, the header versions it reads, and
    the prompt's leading blocks it holds (None: the index's count stands) (``kvmesh.push_grant_ms`` on the
    dispatch span: what waiting for it adds before Prefill leaves). NoGrant when the call ended without one."""
    t0 = time.monotonic()
    metadata = dict(await call.initial_metadata() or ())
    token = metadata.get(PUSH_TOKEN_METADATA, "")
    held = metadata.get(HELD_BLOCKS_METADATA, "")
    exact = int(held) if held.isdigit() else None
    if dispatch.is_recording():
        dispatch.set_attribute("kvmesh.push_grant_ms", round((time.monotonic() - t0) * 1e3, 3))
        if exact is not None:
            dispatch.set_attribute("kvmesh.decode_held_blocks", exact)
    if not token:
        raise NoGrant(f"decode {decode.id} granted no push (its call failed before accepting the request)")
    return PushGrant(token, metadata.get(TRANSFER_VERSIONS_METADATA, ""), exact)


def ttft_left(work: worker_pb2.WorkRequest) -> float:
    """What is left of the request's TTFT target, which admission holds it to (0 = none): none for a migrated or
    resumed stream, whose first token is out already."""
    if not work.slo.ttft_s or work.generated_tokens:
        return 0.0
    return max(1e-3, work.slo.ttft_s - work.waited_s)


def _metadata(dispatch: Span, rt: RequestTrace) -> tuple[tuple[str, str], ...]:
    """A dispatch's call metadata: its trace context and the client's request id (the instances label their
    spans with it, so ``kvmesh trace <client id>`` finds them; the work's id is the dispatch id)."""
    return tracing.grpc_metadata(dispatch) + tracing.request_metadata({tracing.REQUEST_ID: rt.request_id})


def _for(inst: Instance, work: worker_pb2.WorkRequest) -> worker_pb2.WorkRequest:
    """``work`` as ``inst`` reads it: packed, unless its build is from before ``prompt_packed`` (a fleet in a
    rolling upgrade)."""
    return work if PACKED_PROMPT in inst.beat.features else unpacked(work)


def _dispatch_id(request: Admitted, retries: int, migrations: int) -> str:
    """The request id a dispatch carries to the instances: each request its own (``Admitted.dispatch_id``: never
    another tenant's, even under the same client id), each dispatch its own, so a retry or migration never meets
    its predecessor's leases or transfers on an instance both reached."""
    rid = request.dispatch_id or request.request_id
    if request.resume:  # a resumed stream: its dead router's dispatch may still be winding down somewhere
        rid = f"{rid}.resume{len(request.resume)}"
    return rid + (f".migrate{migrations}" if migrations else "") + (f".retry{retries}" if retries else "")


async def _cached_or_zero(cached: CachedTokens) -> int:
    """A failed dispatch's cached tokens, where it can still tell them."""
    try:
        return await cached()
    except Exception:  # noqa: BLE001 - only the usage's cached_tokens depends on it
        return 0


def _chunk(msg: worker_pb2.DecodeChunk) -> Chunk:
    return Chunk(list(msg.token_ids), msg.text, msg.finished, msg.finish_reason,
                 logprobs=tuple(logprobs_from_proto(lp) for lp in msg.logprobs),
                 prompt_logprobs=tuple(logprobs_from_proto(lp) for lp in msg.prompt_logprobs))


def _model_name(source: str | None, hf_dir: Path) -> str:
    if source is None:
        return "SmolLM2-135M-Instruct"
    return Path(source).stem if Path(source).is_file() else Path(source).name


def usable_cores() -> int:
    """The cores this process may run on: its CPU affinity (``taskset``, a container's cpuset), not the machine's
    count (a router pinned to one core of two ran two tokenize threads, contending for one core)."""
    try:
        return len(os.sched_getaffinity(0)) or 1
    except AttributeError:  # pragma: no cover - not Linux
        return os.cpu_count() or 1
