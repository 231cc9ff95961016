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

from kvmesh.bus import Bus, Heartbeat, Subjects
from kvmesh.convert import sampling_to_proto
from kvmesh.engine.loader import resolve_model
from kvmesh.engine.sequence import SamplingParams
from kvmesh.engine.tokenizer import Tokenizer
from kvmesh.keys import Namespace, block_keys
from kvmesh.proto.v1 import cache_pb2, cache_pb2_grpc, worker_pb2, worker_pb2_grpc
from services.router.config import RouterConfig
from services.router.policy import prefix_then_load
from services.router.registry import Instance, Registry

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

    async def start(self) -> None:
        loop = asyncio.get_running_loop()
        self.source = await loop.run_in_executor(None, resolve_model, self.cfg.model)
        self.tokenizer = await loop.run_in_executor(None, Tokenizer.from_dir, self.source.hf_dir)
        self.max_model_len = self.source.config.max_position_embeddings
        self.model_id = self.cfg.model_name or _model_name(self.cfg.model, self.source.hf_dir)
        self.registry = Registry(self.cfg.instance_timeout_s, self.cfg.block_size, self.source.fingerprint)
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
    async def matched_blocks(self, keys: list[int]) -> dict[str, int]:
        """Per instance, the longest run of leading blocks it holds in any tier."""
        if self.cache is None or not keys:
            return {}
        try:
            resp = await self.cache.MatchPrefix(cache_pb2.MatchPrefixRequest(block_keys=keys),
                                                timeout=self.cfg.match_timeout_s)
        except grpc.aio.AioRpcError as e:
            log.warning("MatchPrefix failed (%s); routing by load only", e.code().name)
            return {}
        best: dict[str, int] = {}
        for m in resp.matches:
            best[m.instance_id] = max(best.get(m.instance_id, 0), m.num_blocks)
        return best

    async def generate(self, request_id: str, prompt: list[int], params: SamplingParams,
                       cache_salt: str = "") -> AsyncIterator[Chunk]:
        seed = Namespace(self.source.fingerprint, self.tokenizer.fingerprint, "", cache_salt).seed
        matched = await self.matched_blocks(block_keys(seed, prompt, self.cfg.block_size))
        prefills, decodes = self.registry.alive("prefill"), self.registry.alive("decode")
        work = worker_pb2.WorkRequest(request_id=request_id, prompt_token_ids=prompt,
                                      sampling=sampling_to_proto(params), cache_salt=cache_salt,
                                      pool_blocks=matched.get(POOL, 0))
        if prefills and decodes:
            stream = self._disaggregated(work, prefix_then_load(prefills, matched),
                                         prefix_then_load(decodes, matched))
        elif both := self.registry.alive("both"):
            stream = self._local(work, prefix_then_load(both, matched))
        else:
            raise RequestError("unavailable", "no engine instances are up (need a prefill and a decode "
                                              "instance, or one with role both)")
        completion = 0
        async for chunk, cached in stream:
            completion += len(chunk.token_ids)
            if chunk.finished:
                chunk.usage = Usage(len(prompt), completion, await cached())
            yield chunk

    async def _local(self, work: worker_pb2.WorkRequest, inst: Instance):
        self.registry.note_dispatch(inst)
        call = worker_pb2_grpc.DecodeStub(self._channel(inst.beat.grpc_address)).Decode(
            worker_pb2.DecodeRequest(work=work, prefill_locally=True))
        cached = 0

        async def cached_tokens() -> int:
            return cached

        async for msg, first in _chunks(call, inst):
            if first:
                cached = msg.cached_tokens
            yield _chunk(msg), cached_tokens

    async def _disaggregated(self, work: worker_pb2.WorkRequest, prefill: Instance, decode: Instance):
        self.registry.note_dispatch(prefill)
        self.registry.note_dispatch(decode)
        call = worker_pb2_grpc.DecodeStub(self._channel(decode.beat.grpc_address)).Decode(
            worker_pb2.DecodeRequest(work=work, kv_timeout_s=self.cfg.kv_timeout_s))
        prefill_call = asyncio.ensure_future(
            worker_pb2_grpc.PrefillStub(self._channel(prefill.beat.grpc_address)).Prefill(
                worker_pb2.PrefillRequest(work=work, decode_instance=decode.id,
                                          decode_transfer_address=decode.beat.transfer_address)))
        prefill_call.add_done_callback(lambda f: _log_prefill_failure(f, work.request_id, prefill.id))
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
                yield _chunk(msg), cached_tokens
        finally:
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


def _log_prefill_failure(fut: asyncio.Future, request_id: str, instance: str) -> None:
    if not fut.cancelled() and fut.exception() is not None:
        log.warning("request %s: prefill on %s failed: %s", request_id, instance, fut.exception())


def _model_name(source: str | None, hf_dir: Path) -> str:
    if source is None:
        return "SmolLM2-135M-Instruct"
    return Path(source).stem if Path(source).is_file() else Path(source).name
