"""What the client hands back: frozen dataclasses built from the protocol messages."""

from __future__ import annotations

import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from kvmesh.contracts.engine import TokenLogprobs, logprobs_from_proto
from kvmesh.proto.v1 import api_pb2, common_pb2


@dataclass(frozen=True)
class Usage:
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int              # prompt tokens whose KV was reused instead of computed

    @classmethod
    def from_pb(cls, u: common_pb2.Usage) -> Usage:
        return cls(u.prompt_tokens, u.completion_tokens, u.cached_tokens)


@dataclass(frozen=True)
class ToolCall:
    """A function call the model made: ``arguments`` is a JSON object as text (OpenAI's form)."""

    id: str
    name: str
    arguments: str

    def wire(self) -> dict[str, Any]:
        """The call as an assistant message's ``tool_calls`` entry (OpenAI's shape)."""
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}


@dataclass(frozen=True)
class GenerateChunk:
    request_id: str
    token_ids: tuple[int, ...]
    text: str
    finished: bool
    finish_reason: str              # stop | length | abort; "" until finished
    usage: Usage | None             # on the last chunk
    logprobs: tuple[TokenLogprobs, ...] = ()  # one per token, when the request asked for logprobs
    # with messages: pieces of calls (a call's first has its id and name; a piece without an id continues the
    # call before it), and the thinking apart from ``text`` (the router's reasoning_parser)
    tool_calls: tuple[ToolCall, ...] = ()
    reasoning: str = ""
    # on the first chunk, when the request set prompt_logprobs: one per prompt token after the first
    prompt_logprobs: tuple[TokenLogprobs, ...] = ()

    @classmethod
    def from_pb(cls, c: api_pb2.GenerateChunk) -> GenerateChunk:
        return cls(c.request_id, tuple(c.token_ids), c.text, c.finished, c.finish_reason,
                   Usage.from_pb(c.usage) if c.HasField("usage") else None,
                   tuple(logprobs_from_proto(lp) for lp in c.logprobs),
                   tuple(ToolCall(t.id, t.name, t.arguments) for t in c.tool_calls), c.reasoning,
                   tuple(logprobs_from_proto(lp) for lp in c.prompt_logprobs))


@dataclass(frozen=True)
class Completion:
    """A whole answer. ``ttft_s`` / ``itl_s`` are measured by the client: from the start of the call to the
    first chunk with tokens, and between later chunks with tokens (None / empty for the unary ``chat``, which
    has no stream). ``metadata`` is the server's trailing metadata; ``trace_id`` is its ``traceparent``'s."""

    text: str
    token_ids: list[int]
    finish_reason: str
    usage: Usage | None
    request_id: str
    trace_id: str = ""
    ttft_s: float | None = None
    itl_s: list[float] = field(default_factory=list)
    latency_s: float = 0.0
    metadata: dict[str, str] = field(default_factory=dict)
    logprobs: list[TokenLogprobs] = field(default_factory=list)  # one per token, when asked for
    tool_calls: list[ToolCall] = field(default_factory=list)     # the calls, when the chat offered tools
    reasoning: str = ""  # a reasoning model's thinking, when the router splits it out (reasoning_parser)
    # one per prompt token after the first (its logprob, rank and the most likely there), when asked for
    prompt_logprobs: list[TokenLogprobs] = field(default_factory=list)

    def message(self) -> dict[str, Any]:
        """The answer as the assistant's message, to send back in the conversation's next request."""
        out: dict[str, Any] = {"role": "assistant", "content": self.text}
        if self.tool_calls:
            out["tool_calls"] = [c.wire() for c in self.tool_calls]
        if self.reasoning:
            out["reasoning"] = self.reasoning
        return out


class CompletionBuilder:
    """Collects the chunks of one stream into a ``Completion``, timing them as they arrive. Create it just
    before the call starts."""

    def __init__(self) -> None:
        self._start = time.perf_counter()
        self._last: float | None = None
        self.ttft_s: float | None = None
        self.itl_s: list[float] = []
        self.text: list[str] = []
        self.token_ids: list[int] = []
        self.logprobs: list[TokenLogprobs] = []
        self.request_id = ""
        self.finish_reason = ""
        self.usage: Usage | None = None
        self.reasoning: list[str] = []
        self.calls: list[ToolCall] = []
        self.prompt_logprobs: list[TokenLogprobs] = []

    def add(self, chunk: GenerateChunk) -> None:
        if chunk.token_ids:
            now = time.perf_counter()
            if self._last is None:
                self.ttft_s = now - self._start
            else:
                self.itl_s.append(now - self._last)
            self._last = now
        self.text.append(chunk.text)
        self.reasoning.append(chunk.reasoning)
        for c in chunk.tool_calls:
            if c.id or not self.calls:
                self.calls.append(c)
            else:  # more of the call before it (a named function's arguments)
                last = self.calls[-1]
                self.calls[-1] = ToolCall(last.id, last.name, last.arguments + c.arguments)
        self.token_ids.extend(chunk.token_ids)
        self.logprobs.extend(chunk.logprobs)
        self.prompt_logprobs = self.prompt_logprobs or list(chunk.prompt_logprobs)
        self.request_id = self.request_id or chunk.request_id
        self.finish_reason = chunk.finish_reason or self.finish_reason
        self.usage = chunk.usage or self.usage

    def build(self, trailing: Mapping[str, str]) -> Completion:
        return Completion("".join(self.text), self.token_ids, self.finish_reason, self.usage,
                          self.request_id or trailing.get("x-request-id", ""), trace_id(trailing),
                          self.ttft_s, self.itl_s, time.perf_counter() - self._start, dict(trailing),
                          self.logprobs, self.calls, "".join(self.reasoning), self.prompt_logprobs)


def completion_from_chat(r: api_pb2.ChatResponse, trailing: Mapping[str, str],
                         latency_s: float) -> Completion:
    usage = Usage.from_pb(r.usage) if r.HasField("usage") else None
    return Completion(r.text, list(r.token_ids), r.finish_reason, usage,
                      r.request_id or trailing.get("x-request-id", ""), trace_id(trailing),
                      latency_s=latency_s, metadata=dict(trailing),
                      logprobs=[logprobs_from_proto(lp) for lp in r.logprobs],
                      tool_calls=[ToolCall(c.id, c.name, c.arguments) for c in r.tool_calls], reasoning=r.reasoning,
                      prompt_logprobs=[logprobs_from_proto(lp) for lp in r.prompt_logprobs])


@dataclass(frozen=True)
class ModelInfo:
    id: str
    fingerprint: str
    max_model_len: int
    parent: str = ""  # a LoRA adapter: the base model it runs on


@dataclass(frozen=True)
class InstanceInfo:
    instance_id: str
    role: str
    grpc_address: str
    age_s: float                    # since its last heartbeat
    load: dict[str, float]


@dataclass(frozen=True)
class HealthInfo:
    ok: bool                        # at least one instance can prefill and one can decode
    instances: list[InstanceInfo]

    @classmethod
    def from_pb(cls, h: api_pb2.HealthResponse) -> HealthInfo:
        return cls(h.ok, [InstanceInfo(i.instance_id, i.role, i.grpc_address, i.age_s, dict(i.load))
                          for i in h.instances])


def models_from_pb(r: api_pb2.ListModelsResponse) -> list[ModelInfo]:
    return [ModelInfo(m.id, m.fingerprint, m.max_model_len, m.parent) for m in r.models]


def metadata_dict(metadata: object) -> dict[str, str]:
    """gRPC metadata (key/value pairs, or None) as a dict of its text entries."""
    return {k: v for k, v in (metadata or ()) if isinstance(v, str)}  # type: ignore[attr-defined]


def trace_id(metadata: Mapping[str, str]) -> str:
    """The trace id of a W3C ``traceparent`` (``00-<trace id>-<span id>-<flags>``) in ``metadata``, or ""."""
    parts = metadata.get("traceparent", "").split("-")
    return parts[1] if len(parts) == 4 and len(parts[1]) == 32 else ""
