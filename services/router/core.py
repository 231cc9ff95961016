"""The router's request path: prompt → block keys → MatchPrefix → pick instances → Decode (+ Prefill) → chunks.

Both client surfaces (gRPC and OpenAI HTTP) call ``Router.generate``; errors come out as ``RequestError`` with
a kind each surface maps to its status code.
"""

from __future__ import annotations

import asyncio
import logging
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import AsyncIterator

import grpc
from opentelemetry.trace import Span, SpanKind, StatusCode

from kvmesh.bus import Bus, Heartbeat, Subjects
from kvmesh.convert import sampling_to_proto
from kvmesh.engine.loader import resolve_model
from kvmesh.engine.sequence import SamplingParams
from kvmesh.engine.tokenizer import Tokenizer
from kvmesh.keys import Namespace, block_keys
from kvmesh.proto.v1 import cache_pb2, cache_pb2_grpc, worker_pb2, worker_pb2_grpc
from kvmesh.telemetry import tracing
from services.router.config import RouterConfig
from kvmesh.routing import CostModel
from services.router.policy import Policies, choose_decode
from services.router.registry import Instance, Registry
from services.router.telemetry import RequestTrace, RouterMetrics, route_attributes

log = logging.getLogger(__name__)
POOL = "pool"  # MatchPrefix's instance id for the cache service's own tiers


class RequestError(Exception):
    """``kind``: invalid | not_found | unavailable | overloaded | internal."""

    def __init__(self, kind: str, message: str) -> None:
        super().__init__(message)
        self.kind = kind
        self.message = message


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


def new_request_id() -> str:
    return uuid.uuid4().hex


class Router:
    def __init__(self, cfg: RouterConfig) -> None:
        self.cfg = cfg
        self.subjects = Subjects(cfg.cluster)
        self._channels: dict[str, grpc.aio.Channel] = {}
        self.metrics = RouterMetrics()
        self.policies = Policies(cfg.policy, CostModel(prefill_tok_per_s=cfg.prefill_tok_per_s), cfg.slo_ttft_s)

    async def start(self) -> None:
        loop = asyncio.get_running_loop()
        self.source = await loop.run_in_executor(None, resolve_model, self.cfg.model)
        self.tokenizer = await loop.run_in_executor(None, Tokenizer.from_dir, self.source.hf_dir)
        self.max_model_len = self.source.config.max_position_embeddings
        self.model_id = self.cfg.model_name or _model_name(self.cfg.model, self.source.hf_dir)
        self.registry = Registry(self.cfg.instance_timeout_s, self.cfg.block_size, self.source.fingerprint)
        self.metrics.watch(self.registry)
        self.bus = await Bus.connect(self.cfg.nats_url, name="router")
        await self.bus.subscribe(self.subjects.heartbeats_all, self._on_heartbeat)
        self.cache = (cache_pb2_grpc.CacheServiceStub(self._channel(self.cfg.cachesvc_address))
                      if self.cfg.cachesvc_address else None)

    async def stop(self) -> None:
        await self.bus.close()
        for ch in self._channels.values():
            await ch.close()

    async def _on_heartbeat(self, beat: Heartbeat, headers: dict[str, str]) -> None:
        if beat.role in ("prefill", "decode", "both"):
            self.registry.observe(beat)

    def _channel(self, address: str) -> grpc.aio.Channel:
        if address not in self._channels:
            self._channels[address] = grpc.aio.insecure_channel(
                address, options=[("grpc.max_receive_message_length", 64 * 2**20)])
        return self._channels[address]

    # ---- prompts ---------------------------------------------------------------------------------------------
    def prompt_ids(self, *, text: str | None = None, token_ids: list[int] | None = None,
                   messages: list[dict] | None = None) -> list[int]:
        if messages is not None:
            for m in messages:
                if not isinstance(m, dict) or m.get("role") not in ("system", "user", "assistant", "tool") \
                        or not isinstance(m.get("content"), str):
                    raise RequestError("invalid", "each message needs a role (system|user|assistant|tool) "
                                                  "and a string content")
            if not messages:
                raise RequestError("invalid", "messages is empty")
            return self.tokenizer.apply_chat_template(messages)
        if token_ids is not None:
            vocab = self.source.config.vocab_size
            if any(not isinstance(t, int) or isinstance(t, bool) or not 0 <= t < vocab for t in token_ids):
                raise RequestError("invalid", f"prompt token ids must be integers in [0, {vocab})")
            return list(token_ids)
        if text is not None:
            return self.tokenizer.encode(text)
        raise RequestError("invalid", "a prompt is required (text, token ids or messages)")

    def check(self, model: str, prompt: list[int], params: SamplingParams) -> None:
        if model and model != self.model_id:
            raise RequestError("not_found", f"model {model!r} is not served here; this router serves "
                                            f"{self.model_id!r}")
        if not prompt:
            raise RequestError("invalid", "the prompt is empty")
        if len(prompt) + params.max_tokens > self.max_model_len:
            raise RequestError("invalid", f"prompt ({len(prompt)} tokens) + max_tokens ({params.max_tokens}) "
                                          f"exceeds the context of {self.max_model_len} tokens")

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

    def check_policy(self, name: str | None) -> None:
        try:
            self.policies.get(name)
        except ValueError as e:
            raise RequestError("invalid", str(e)) from None

    def _choose(self, policy: str | None, role: str, instances: list[Instance], matched: dict[str, int],
                prompt: list[int], route: Span) -> Instance:
        inst, decision = self.policies.choose(policy, instances, matched, len(prompt), self.cfg.block_size,
                                              matched.get(POOL, 0))
        if route.is_recording():
            route.set_attributes({**route_attributes(role, instances, matched, inst or instances[0]),
                                  f"kvmesh.route.{role}.policy": policy or self.policies.default,
                                  f"kvmesh.route.{role}.estimates": [f"{k}={v:.3f}" for k, v in decision.scores.items()],
                                  f"kvmesh.route.{role}.reason": decision.reason})
        if inst is None:
            raise RequestError("overloaded", decision.reason)
        return inst

    def generate(self, request_id: str, prompt: list[int], params: SamplingParams,
                 cache_salt: str = "", trace: RequestTrace | None = None,
                 policy: str | None = None) -> AsyncIterator[Chunk]:
        """Route and run one request, yielding its chunks. ``trace``: the request's root span and TTFT clock,
        which the API layer owns (without one, the request is traced here, TTFT ending at the first chunk).
        ``policy``: a per-request routing policy (else the configured one)."""
        self.check_policy(policy)
        if trace is not None:
            return self._generate(request_id, prompt, params, cache_salt, trace, policy)
        return self._traced_here(request_id, prompt, params, cache_salt, policy)

    async def _traced_here(self, request_id: str, prompt: list[int], params: SamplingParams,
                           cache_salt: str, policy: str | None) -> AsyncIterator[Chunk]:
        rt = RequestTrace(self.metrics, request_id, "internal")
        try:
            async for chunk in self._generate(request_id, prompt, params, cache_salt, rt, policy):
                rt.first_token_sent()
                yield chunk
        except RequestError as e:
            rt.finish(e.kind, e.message)
            raise
        finally:
            rt.finish()

    async def _generate(self, request_id: str, prompt: list[int], params: SamplingParams, cache_salt: str,
                        rt: RequestTrace, policy: str | None = None) -> AsyncIterator[Chunk]:
        route = rt.child("router.route")
        try:
            seed = Namespace(self.source.fingerprint, self.tokenizer.fingerprint, "", cache_salt).seed
            keys = block_keys(seed, prompt, self.cfg.block_size)
            matched = await self.matched_blocks(keys, route, rt.attrs)
            prefills, decodes = self.registry.alive("prefill"), self.registry.alive("decode")
            work = worker_pb2.WorkRequest(request_id=request_id, prompt_token_ids=prompt,
                                          sampling=sampling_to_proto(params), cache_salt=cache_salt,
                                          pool_blocks=matched.get(POOL, 0))
            route.set_attribute("kvmesh.pool_blocks", matched.get(POOL, 0))
            both = self.registry.alive("both") if not (prefills and decodes) else []
            if prefills and decodes:
                prefill = self._choose(policy, "prefill", prefills, matched, prompt, route)
                decode = choose_decode(decodes)
                if route.is_recording():
                    route.set_attributes(route_attributes("decode", decodes, {}, decode))
                stream = self._disaggregated(work, prefill, decode, rt)
            elif both:
                inst = self._choose(policy, "both", both, matched, prompt, route)
                stream = self._local(work, inst, rt)
            else:
                route.set_status(StatusCode.ERROR, "no engine instances are up")
                raise RequestError("unavailable", "no engine instances are up (need a prefill and a decode "
                                                  "instance, or one with role both)")
        finally:
            route.end()
        completion = 0
        async for chunk, cached in stream:
            rt.chunk_arrived()
            completion += len(chunk.token_ids)
            if chunk.finished:
                chunk.usage = Usage(len(prompt), completion, await cached())
                rt.usage(len(prompt), completion, chunk.usage.cached_tokens)
            yield chunk

    async def _local(self, work: worker_pb2.WorkRequest, inst: Instance, rt: RequestTrace):
        done = self.registry.dispatched(inst, len(work.prompt_token_ids))
        dispatch = rt.child("router.dispatch", SpanKind.CLIENT, **{"kvmesh.decode_instance": inst.id})
        call = worker_pb2_grpc.DecodeStub(self._channel(inst.beat.grpc_address)).Decode(
            worker_pb2.DecodeRequest(work=work, prefill_locally=True), metadata=tracing.grpc_metadata(dispatch),
            timeout=self.cfg.request_timeout_s)
        cached = 0

        async def cached_tokens() -> int:
            return cached

        try:
            async for msg, first in _chunks(call, inst):
                if first:
                    cached = msg.cached_tokens
                yield _chunk(msg), cached_tokens
        finally:
            done()
            dispatch.end()

    async def _disaggregated(self, work: worker_pb2.WorkRequest, prefill: Instance, decode: Instance,
                             rt: RequestTrace):
        prefill_done = self.registry.dispatched(prefill, len(work.prompt_token_ids))
        decode_done = self.registry.dispatched(decode)
        dispatch = rt.child("router.dispatch", SpanKind.CLIENT, **{"kvmesh.prefill_instance": prefill.id,
                                                                   "kvmesh.decode_instance": decode.id})
        md = tracing.grpc_metadata(dispatch)
        call = worker_pb2_grpc.DecodeStub(self._channel(decode.beat.grpc_address)).Decode(
            worker_pb2.DecodeRequest(work=work, kv_timeout_s=self.cfg.kv_timeout_s), metadata=md,
            timeout=self.cfg.request_timeout_s)
        prefill_call = asyncio.ensure_future(
            worker_pb2_grpc.PrefillStub(self._channel(prefill.beat.grpc_address)).Prefill(
                worker_pb2.PrefillRequest(work=work, decode_instance=decode.id,
                                          decode_transfer_address=decode.beat.transfer_address), metadata=md,
                timeout=self.cfg.request_timeout_s))
        prefill_call.add_done_callback(
            lambda f: _log_prefill_failure(f, work.request_id, prefill.id, rt.trace_id))
        prefill_call.add_done_callback(lambda _: prefill_done())
        decode_cached, fallback = 0, False

        async def cached_tokens() -> int:
            """What prefill reused; after a decode fallback, what decode reused."""
            if fallback:
                return decode_cached
            done, _ = await asyncio.wait([prefill_call], timeout=1.0)
            return prefill_call.result().cached_tokens if done and not prefill_call.exception() else 0

        try:
            async for msg, first in _chunks(call, decode):
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


async def _chunks(call, inst: Instance):
    first = True
    try:
        async for msg in call:
            yield msg, first
            first = False
    except grpc.aio.AioRpcError as e:
        if e.code() == grpc.StatusCode.INVALID_ARGUMENT:
            raise RequestError("invalid", e.details() or "invalid request") from None
        if e.code() == grpc.StatusCode.CANCELLED:
            raise
        raise RequestError("unavailable", f"instance {inst.id} failed: {e.code().name}: {e.details()}") from None
    finally:
        call.cancel()


def _chunk(msg: worker_pb2.DecodeChunk) -> Chunk:
    return Chunk(list(msg.token_ids), msg.text, msg.finished, msg.finish_reason)


def _log_prefill_failure(fut: asyncio.Future, request_id: str, instance: str, trace_id: str) -> None:
    if not fut.cancelled() and fut.exception() is not None:
        log.warning("request %s (trace %s): prefill on %s failed: %s", request_id, trace_id, instance,
                    fut.exception())


def _model_name(source: str | None, hf_dir: Path) -> str:
    if source is None:
        return "SmolLM2-135M-Instruct"
    return Path(source).stem if Path(source).is_file() else Path(source).name

