"""The router's request path: an admitted request (``intake``) → block keys → MatchPrefix → pick instances →
Decode (+ Prefill) → chunks.

Both client surfaces (gRPC and OpenAI HTTP) call ``Router.generate`` with what ``Intake.admit`` admitted; errors
come out as ``RequestError`` (``errors``), whose kind each surface maps to its status code.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path

import grpc
from kvmesh import tls
from kvmesh.bus import Bus, Subjects
from kvmesh.contracts.engine import TokenLogprobs, logprobs_from_proto
from kvmesh.contracts.keys import Namespace, block_keys
from kvmesh.contracts.messages import Heartbeat, KVReady
from kvmesh.contracts.sampling import sampling_to_proto
from kvmesh.contracts.slo import slo_to_proto
from kvmesh.model_source.resolve import resolve_model
from kvmesh.model_source.tokenizer import Tokenizer
from kvmesh.proto.v1 import cache_pb2, cache_pb2_grpc, worker_pb2, worker_pb2_grpc
from kvmesh.routing import CostModel
from kvmesh.routing.cost import TTFTTarget, disaggregation, local_share
from kvmesh.settings import RouterSettings, SharedSettings
from kvmesh.telemetry import tracing
from opentelemetry.trace import Span, SpanKind, StatusCode

from services.router.errors import ErrorKind, RequestError, invalid
from services.router.intake import Admitted
from services.router.loras import Adapters
from services.router.registry import Instance, Registry
from services.router.scheduling import Policies, choose_decode
from services.router.telemetry import RequestTrace, RouterMetrics, route_attributes

log = logging.getLogger(__name__)
POOL = "pool"  # MatchPrefix's instance id for the cache service's own tiers
RETRIES = 2    # re-dispatches of a request whose instance was unreachable before its first token


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


class Router:
    def __init__(self, cfg: RouterSettings, shared: SharedSettings | None = None) -> None:
        self.cfg = cfg
        self.shared = shared or SharedSettings()
        self.subjects = Subjects(self.shared.cluster)
        self._channels: dict[str, grpc.aio.Channel] = {}
        self.metrics = RouterMetrics()
        self.policies = Policies(cfg.policy, CostModel(prefill_tok_per_s=cfg.prefill_tok_per_s), cfg.slo_ttft_s)
        self.loras = Adapters(lambda: self.registry, self._channel, cfg.lora_root)

    async def start(self) -> None:
        loop = asyncio.get_running_loop()
        self.source = await loop.run_in_executor(None, resolve_model, self.cfg.model)
        self.tokenizer = await loop.run_in_executor(None, Tokenizer.from_dir, self.source.hf_dir)
        self.max_model_len = self.source.config.max_position_embeddings
        self.model_id = self.cfg.model_name or _model_name(self.cfg.model, self.source.hf_dir)
        self.registry = Registry(self.cfg.instance_timeout_s, self.cfg.block_size, self.source.fingerprint)
        self.metrics.watch(self.registry)
        self.bus = await Bus.connect(self.shared.nats_url, name="router")
        await self.bus.subscribe(self.subjects.heartbeats_all, self._on_heartbeat)
        self.cache = (cache_pb2_grpc.CacheServiceStub(self._channel(self.cfg.cachesvc_address))
                      if self.cfg.cachesvc_address else None)

    async def stop(self) -> None:
        await self.bus.close()
        for ch in self._channels.values():
            await ch.close()

    async def _on_heartbeat(self, beat: Heartbeat, headers: dict[str, str]) -> None:
        if beat.role.is_engine:
            self.registry.observe(beat)

    def _channel(self, address: str) -> grpc.aio.Channel:
        if address not in self._channels:
            self._channels[address] = tls.aio_channel(address, [("grpc.max_receive_message_length", 64 * 2**20)])
        return self._channels[address]

    # ---- routing ---------------------------------------------------------------------------------------------
    async def matched_blocks(self, keys: list[int], parent: Span | None = None,
                             attrs: dict | None = None) -> dict[str, int]:
        """Per instance, the longest run of leading blocks it holds in any tier. Traced as the client span
        ``cachesvc.match_prefix`` under ``parent``, whose context the call carries to cachesvc."""
        if self.cache is None or not keys:
            return {}
        span = tracing.start("cachesvc.match_prefix", parent, SpanKind.CLIENT,
                             {**(attrs or {}), "kvmesh.blocks": len(keys)})
        try:
            resp = await self.cache.MatchPrefix(cache_pb2.MatchPrefixRequest(block_keys=keys),
                                                timeout=self.cfg.match_timeout_s,
                                                metadata=tracing.grpc_metadata(span) + tracing.request_metadata(attrs))
        except grpc.aio.AioRpcError as e:
            log.warning("MatchPrefix failed (%s); routing by load only", e.code().name)
            self.metrics.match_errors.inc()
            span.set_status(StatusCode.ERROR, f"MatchPrefix failed: {e.code().name}; routing by load only")
            span.end()
            return {}
        best: dict[str, int] = {}
        for m in resp.matches:
            best[m.instance_id] = max(best.get(m.instance_id, 0), m.num_blocks)
        if span.is_recording():
            span.set_attribute("kvmesh.matched", [f"{k}={v}" for k, v in sorted(best.items())])
        span.end()
        return best

    def _choose(self, policy: str | None, role: str, instances: list[Instance], matched: dict[str, int],
                prompt: list[int], route: Span, lora: str = "", ttft_s: float = 0.0) -> Instance:
        """``ttft_s``: what is left of the request's TTFT target (0 = none), which admission holds it to."""
        missing = {i.id for i in instances if not self.loras.holds(i, lora)}
        inst, decision = self.policies.choose(policy, instances, matched, len(prompt), self.cfg.block_size,
                                              matched.get(POOL, 0), missing, ttft_s)
        if route.is_recording():
            route.set_attributes({**route_attributes(role, instances, matched, inst or instances[0]),
                                  f"kvmesh.route.{role}.policy": policy or self.policies.default,
                                  f"kvmesh.route.{role}.estimates": [f"{k}={v:.3f}" for k, v in decision.scores.items()],
                                  f"kvmesh.route.{role}.reason": decision.reason})
        if inst is None:
            raise RequestError(ErrorKind.OVERLOADED, decision.reason)
        return inst

    async def generate(self, request: Admitted, rt: RequestTrace) -> AsyncIterator[Chunk]:
        """Route, dispatch and stream one admitted request. ``rt``: its root span and TTFT clock, which the API
        layer owns. An instance found unreachable before the first token costs a retry on another one (at most
        ``RETRIES``), never the request; after the first token, the error goes out."""
        request_id, prompt, lora, policy = request.request_id, request.prompt, request.lora, request.policy
        # the engines' namespace for this adapter: name@generation (the generation the instances hold)
        lora_id = self.loras.lora_id(lora) if lora else ""
        seed = Namespace(self.source.fingerprint, self.tokenizer.fingerprint, lora_id, request.cache_salt).seed
        keys = block_keys(seed, prompt, self.cfg.block_size)
        matched: dict[str, int] | None = None
        avoid: set[str] = set()
        failure: RequestError | None = None
        for attempt in range(RETRIES + 1):
            route = rt.child("router.route", **({"kvmesh.retry": attempt} if attempt else {}))
            try:
                if matched is None:
                    matched = await self.matched_blocks(keys, route, rt.attrs)
                route.set_attribute("kvmesh.pool_blocks", matched.get(POOL, 0))
                work = worker_pb2.WorkRequest(
                    request_id=request_id if attempt == 0 else f"{request_id}.retry{attempt}",
                    prompt_token_ids=prompt, sampling=sampling_to_proto(request.sampling),
                    cache_salt=request.cache_salt, pool_blocks=matched.get(POOL, 0), lora_name=lora,
                    slo=slo_to_proto(request.slo), waited_s=time.monotonic() - rt.t0)
                stream = self._route(work, matched, rt, policy, route, avoid,
                                     request.disaggregate or self.cfg.disaggregate)
                if stream is None:
                    if failure is not None:  # nowhere else to go: the error of the last attempt stands
                        raise failure
                    route.set_status(StatusCode.ERROR, "no engine instances are up")
                    raise RequestError(ErrorKind.UNAVAILABLE, "no engine instances are up (need a prefill and a "
                                                              "decode instance, or one with role both)")
            finally:
                route.end()
            completion, started = 0, False
            try:
                async for chunk, cached in stream:
                    started = True
                    rt.chunk_arrived()
                    completion += len(chunk.token_ids)
                    if chunk.finished:
                        chunk.usage = Usage(len(prompt), completion, await cached())
                        rt.usage(len(prompt), completion, chunk.usage.cached_tokens)
                    yield chunk
                return
            except RequestError as e:
                if e.kind == ErrorKind.INTERNAL:
                    log.error("request %s (trace %s): %s", request_id, rt.trace_id, e.message)
                if started or not e.retryable or attempt == RETRIES:
                    raise
                failure = e
                avoid.add(e.instance)
                log.warning("request %s (trace %s): %s; retrying on another instance", request_id, rt.trace_id,
                            e.message)
                rt.retry(self.registry.role_of(e.instance), e.instance, e.message)

    def _route(self, work: worker_pb2.WorkRequest, matched: dict[str, int], rt: RequestTrace,
               policy: str | None, route: Span, avoid: set[str], disaggregate: str = "auto"):
        """The chosen instances' chunk stream, or None when no live instance (outside ``avoid``) can serve.
        With prefill and decode instances, the cost model decides whether the hop pays (``disaggregation``):
        when decode already holds about as much of the prompt as prefill, decode computes the rest itself."""
        prompt = list(work.prompt_token_ids)
        ttft_s = max(1e-3, work.slo.ttft_s - work.waited_s) if work.slo.ttft_s else 0.0  # admission's bound
        prefills = [i for i in self.registry.alive("prefill") if i.id not in avoid]
        decodes = [i for i in self.registry.alive("decode") if i.id not in avoid]
        lora = work.lora_name
        if prefills and decodes:
            # a request's own TTFT target is held by the path choice below (prefill's queue, or decode beside its
            # streams), not by the prefill instance alone
            prefill = self._choose(policy, "prefill", prefills, matched, prompt, route, lora,
                                   0.0 if ttft_s and disaggregate == "auto" else ttft_s)
            holders = [i for i in decodes if self.loras.holds(i, lora)]
            decode = choose_decode(holders or decodes)
            if route.is_recording():
                route.set_attributes(route_attributes("decode", decodes, {}, decode))
            # one line prices both computes: the same model on the same kind of machine, and a decode
            # instance's own fit comes from one-token steps, which pin down no prompt speed. The streams decode
            # runs: what this router has in flight there (a heartbeat lags: in a chat it still reports the
            # previous turn decoding)
            speed = CostModel.from_load(prefill.beat.load, self.policies.cost) or self.policies.cost
            target = TTFTTarget(ttft_s, int(prefill.waiting_tokens), int(decode.waiting_tokens),
                                local_share(decode.beat.load.get("decode_step_s", 0.0), work.slo.itl_s)) \
                if ttft_s else None
            d = disaggregation(disaggregate, len(prompt), self.cfg.block_size, matched.get(prefill.id, 0),
                               matched.get(decode.id, 0), speed, speed, decode.inflight, ttft=target)
            route.set_attributes({"kvmesh.route.path": "pd" if d.disaggregate else "local",
                                  "kvmesh.route.reason": d.reason,
                                  "kvmesh.route.pd_ms": round(d.pd_s * 1e3, 1),
                                  "kvmesh.route.local_ms": round(d.local_s * 1e3, 1)})
            if d.refuse:
                raise RequestError(ErrorKind.OVERLOADED, d.reason)
            if not d.disaggregate:
                return self._local(work, decode, rt, d.reason)
            # decode waits for kv.ready its own kv_timeout_s past this estimate of prefill + push: a long cold
            # prompt must not time out while prefill is still computing it
            return self._disaggregated(work, prefill, decode, rt, policy, matched, d.pd_s)
        both = [i for i in self.registry.alive("both") if i.id not in avoid]
        if both:
            route.set_attributes({"kvmesh.route.path": "local", "kvmesh.route.reason": "local: role both"})
            return self._local(work, self._choose(policy, "both", both, matched, prompt, route, lora, ttft_s), rt)
        return None

    async def _ensure_lora(self, work: worker_pb2.WorkRequest, *instances: Instance) -> None:
        """The request's adapter on each chosen instance (loaded there when missing: priced in routing)."""
        for inst in instances:
            if work.lora_name:
                await self.loras.ensure(inst, work.lora_name)

    async def _local(self, work: worker_pb2.WorkRequest, inst: Instance, rt: RequestTrace, reason: str = ""):
        await self._ensure_lora(work, inst)
        done = self.registry.dispatched(inst, len(work.prompt_token_ids))
        dispatch = rt.child("router.dispatch", SpanKind.CLIENT, **{"kvmesh.decode_instance": inst.id})
        call = worker_pb2_grpc.DecodeStub(self._channel(inst.beat.grpc_address)).Decode(
            worker_pb2.DecodeRequest(work=work, prefill_locally=True, route_reason=reason),
            metadata=tracing.grpc_metadata(dispatch), timeout=self.cfg.request_timeout_s)
        cached = 0

        async def cached_tokens() -> int:
            return cached

        try:
            async for msg, first in _chunks(call, inst, work.request_id):
                if first:
                    cached = msg.cached_tokens
                yield _chunk(msg), cached_tokens
        finally:
            done()
            dispatch.end()

    async def _disaggregated(self, work: worker_pb2.WorkRequest, prefill: Instance, decode: Instance,
                             rt: RequestTrace, policy: str | None, matched: dict[str, int],
                             expected_prefill_s: float = 0.0):
        await self._ensure_lora(work, decode, prefill)
        decode_done = self.registry.dispatched(decode)
        dispatch = rt.child("router.dispatch", SpanKind.CLIENT, **{"kvmesh.prefill_instance": prefill.id,
                                                                   "kvmesh.decode_instance": decode.id})
        md = tracing.grpc_metadata(dispatch)
        held = self._decode_holds(work, decode, matched)  # decode pins them; prefill pushes only the rest
        dispatch.set_attribute("kvmesh.decode_cached_blocks", held)
        call = worker_pb2_grpc.DecodeStub(self._channel(decode.beat.grpc_address)).Decode(
            worker_pb2.DecodeRequest(work=work, expected_prefill_s=expected_prefill_s, cached_blocks=held),
            metadata=md, timeout=self.cfg.request_timeout_s)
        prefill_call = asyncio.ensure_future(self._prefill(work, prefill, decode, md, rt, policy, matched, held))
        prefill_call.add_done_callback(lambda f: f.cancelled() or f.exception())  # failures are logged inside
        decode_cached, fallback = 0, False

        async def cached_tokens() -> int:
            """What prefill reused; after a decode fallback, what decode reused."""
            if fallback:
                return decode_cached
            done, _ = await asyncio.wait([prefill_call], timeout=1.0)
            return prefill_call.result().cached_tokens if done and not prefill_call.exception() else 0

        try:
            async for msg, first in _chunks(call, decode, work.request_id):
                if first:
                    decode_cached, fallback = msg.cached_tokens, msg.kv_fallback
                    if fallback:
                        rt.fallback(msg.fallback_reason)
                yield _chunk(msg), cached_tokens
        finally:
            decode_done()
            dispatch.end()
            if not prefill_call.done():
                prefill_call.cancel()

    def _decode_holds(self, work: worker_pb2.WorkRequest, decode: Instance, matched: dict[str, int]) -> int:
        """The leading full blocks of the prompt the decode instance holds (MatchPrefix), at most the blocks
        before the one holding the last prompt token (so a push always carries at least one block)."""
        return min(matched.get(decode.id, 0), (len(work.prompt_token_ids) - 1) // self.cfg.block_size)

    async def _prefill(self, work: worker_pb2.WorkRequest, prefill: Instance, decode: Instance, md,
                       rt: RequestTrace, policy: str | None, matched: dict[str, int],
                       held: int = 0) -> worker_pb2.PrefillResponse:
        """The request's Prefill call, while decode waits for its ``kv.ready``. An unreachable prefill instance
        is replaced by another one; when none is left (or prefill failed otherwise), decode is told at once
        (``kv.ready`` with ok=False) and recomputes the prompt instead of waiting out ``kv_timeout_s``."""
        tried: set[str] = set()
        while True:
            tried.add(prefill.id)
            await self._ensure_lora(work, prefill)  # a replacement prefill may lack the adapter
            done = self.registry.dispatched(prefill, len(work.prompt_token_ids))
            try:
                return await worker_pb2_grpc.PrefillStub(self._channel(prefill.beat.grpc_address)).Prefill(
                    worker_pb2.PrefillRequest(work=work, decode_instance=decode.id,
                                              decode_transfer_address=decode.beat.transfer_address,
                                              decode_cached_blocks=held),
                    metadata=md, timeout=self.cfg.request_timeout_s)
            except grpc.aio.AioRpcError as e:
                why = f"prefill on {prefill.id} failed: {e.code().name}: {e.details()}"
                log.warning("request %s (trace %s): %s", work.request_id, rt.trace_id, why)
                if e.code() in (grpc.StatusCode.ABORTED, grpc.StatusCode.CANCELLED):
                    raise  # ABORTED: prefill computed but could not push, and told decode itself
                nxt = self._another_prefill(tried, policy, matched, work) \
                    if e.code() == grpc.StatusCode.UNAVAILABLE else None
                if nxt is None:
                    await self._tell_decode(work, decode, prefill, why)
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
        missing = {i.id for i in others if not self.loras.holds(i, work.lora_name)}
        inst, _ = self.policies.choose(policy, others, matched, len(work.prompt_token_ids), self.cfg.block_size,
                                       matched.get(POOL, 0), missing)
        return inst or min(others, key=lambda i: (i.queue_depth, i.id))  # an SLO miss beats a recompute

    async def _tell_decode(self, work: worker_pb2.WorkRequest, decode: Instance, prefill: Instance,
                           error: str) -> None:
        ready = KVReady(request_id=work.request_id, decode_instance=decode.id, transfer_id="", block_keys=(),
                        num_tokens=0, first_token=0, layout=None, prefill_instance=prefill.id, ok=False,
                        error=error)
        try:
            await self.bus.publish(self.subjects.kv_ready(decode.id), ready)
        except Exception as e:  # noqa: BLE001 - decode still falls back after kv_timeout_s
            log.warning("could not tell %s that request %s's prefill failed: %s", decode.id, work.request_id, e)


async def _chunks(call, inst: Instance, request_id: str):
    """The call's messages (and whether each is the first); its failure as a ``RequestError``: INVALID_ARGUMENT
    is the request's fault, INTERNAL the instance's (a 500 naming the request, never retried: the request may
    be what breaks it), anything else makes the instance unavailable for it."""
    first = True
    try:
        async for msg in call:
            yield msg, first
            first = False
    except grpc.aio.AioRpcError as e:
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
                           inst.id, retryable=e.code() == grpc.StatusCode.UNAVAILABLE) from None
    finally:
        call.cancel()


def _chunk(msg: worker_pb2.DecodeChunk) -> Chunk:
    return Chunk(list(msg.token_ids), msg.text, msg.finished, msg.finish_reason,
                 logprobs=tuple(logprobs_from_proto(lp) for lp in msg.logprobs))


def _model_name(source: str | None, hf_dir: Path) -> str:
    if source is None:
        return "SmolLM2-135M-Instruct"
    return Path(source).stem if Path(source).is_file() else Path(source).name

