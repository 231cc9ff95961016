"""What crosses the engine seam, torch-free: a request as a service hands it to an engine, its outputs, the KV it
exports (prefill's push, decode's write-back) and the KV it imports (a verified push), the engine's load.

KV travels as bytes in the engine's wire layout (``KVLayout``: whole blocks ``[layers, 2, block_size, heads, dim]``
one after another, or each block's slice of a layer group), so a service moves it without knowing which framework
computed it; the engine turns its own memory into these bytes and back (``kvmesh.engines.Engine``).
"""

from __future__ import annotations

import enum
import sys
from array import array
from collections.abc import Iterable
from dataclasses import dataclass

from kvmesh.contracts.ids import BlockKey
from kvmesh.contracts.layout import KVLayout
from kvmesh.contracts.sampling import SamplingParams, sampling_from_proto
from kvmesh.contracts.slo import NO_SLO, SLO, slo_from_proto
from kvmesh.proto.v1 import common_pb2, worker_pb2


@dataclass(frozen=True)
class RetentionRange:
    """TensorRT-LLM-style retention: blocks overlapping ``[start, end)`` tokens keep ``priority`` for
    ``duration_s`` seconds (e.g. a system prompt outlives chat turns)."""

    start: int
    end: int
    priority: int
    duration_s: float = float("inf")


def retention_to_proto(ranges: tuple[RetentionRange, ...]) -> list[common_pb2.Retention]:
    return [common_pb2.Retention(start=r.start, end=r.end, priority=r.priority,
                                 ttl_s=0.0 if r.duration_s == float("inf") else r.duration_s) for r in ranges]


def retention_from_proto(ranges: Iterable[common_pb2.Retention]) -> tuple[RetentionRange, ...]:
    """ValueError for a range that is empty or backwards, or a negative TTL (0: forever)."""
    out = []
    for r in ranges:
        if r.end <= r.start or r.ttl_s < 0:
            raise ValueError(f"retention [{r.start}, {r.end}) for {r.ttl_s} s: a range needs start < end and a "
                             "TTL >= 0 (0 = forever)")
        out.append(RetentionRange(r.start, r.end, r.priority, r.ttl_s or float("inf")))
    return tuple(out)


class ExportPieces(enum.StrEnum):
    """How a request's KV leaves the engine while it is computed."""

    AT_END = "at_end"                  # one piece when the request finishes (decode's write-back)
    BY_CHUNK = "by_chunk"              # each prefill chunk's new full blocks after its forward pass, the rest last
    BY_LAYER_GROUP = "by_layer_group"  # each chunk's blocks layer group by layer group, during its forward pass


@dataclass(frozen=True)
class ExportPlan:
    """Which of a request's blocks are read out, and in which pieces: blocks ``first_block ..`` (the receiver
    holds the ones before), as ``pieces`` says (``layer_groups``: how many groups, for ``BY_LAYER_GROUP``)."""

    pieces: ExportPieces = ExportPieces.AT_END
    first_block: int = 0
    layer_groups: int = 1

    def __post_init__(self) -> None:
        if self.first_block < 0 or self.layer_groups < 1:
            raise ValueError(f"export plan: first_block {self.first_block} must be >= 0 and layer_groups "
                             f"{self.layer_groups} >= 1")


def layer_bounds(num_layers: int, groups: int) -> tuple[int, ...]:
    """The end layer of each of ``groups`` (at most ``num_layers``) near-equal consecutive layer groups: how a
    ``BY_LAYER_GROUP`` plan splits a model's layers (every backend reads its KV out in these groups)."""
    groups = max(1, min(groups, num_layers))
    return tuple(num_layers * (g + 1) // groups for g in range(groups))


@dataclass(frozen=True)
class ExportedKV:
    """Blocks ``first_block .. first_block + num_blocks - 1`` of a request, read out: ``data`` holds their bytes
    in the layout's wire order (each block whole, or with ``layers`` = ``(first, end)`` only that slice of its
    layers). ``num_tokens``: the request's tokens whose KV is computed (from its start); ``block_keys``: the keys
    of its full blocks up to ``num_tokens``, from the first. ``final``: False for a piece read out mid-prefill
    (more follow)."""

    data: memoryview
    num_blocks: int
    first_block: int
    num_tokens: int
    block_keys: tuple[BlockKey, ...]
    final: bool = True
    layers: tuple[int, int] | None = None

    @property
    def piece_keys(self) -> tuple[BlockKey, ...]:
        """The keys of this piece's full blocks."""
        return self.block_keys[self.first_block:self.first_block + self.num_blocks]


@dataclass(frozen=True)
class KVPart:
    """A verified part of a pushed prompt's KV: blocks ``first_block ..`` (``num_blocks``), whole or their slice
    of ``layers``; ``data`` holds its bytes in wire order, or None when they landed in place (in the blocks the
    request reserved, ``ImportedKV.reservation``)."""

    first_block: int
    num_blocks: int
    layers: tuple[int, int] | None = None
    data: memoryview | None = None


@dataclass(frozen=True)
class TokenLogprobs:
    """A generated token's log-probability and the ``SamplingParams.logprobs`` most likely tokens at its position
    (``top``: ``(token id, logprob)``, most likely first), from the distribution it was sampled from: the model's,
    before temperature and the other sampling filters (as vLLM reports by default). A prompt token's
    (``SamplingParams.prompt_logprobs``) also has its ``rank`` there (1 = the most likely; 0 = not given)."""

    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()
    rank: int = 0


def logprobs_to_proto(lp: TokenLogprobs) -> common_pb2.TokenLogprobs:
    return common_pb2.TokenLogprobs(token_id=lp.token_id, logprob=lp.logprob, top_token_ids=[t for t, _ in lp.top],
                                    top_logprobs=[v for _, v in lp.top], rank=lp.rank)


def logprobs_from_proto(m: common_pb2.TokenLogprobs) -> TokenLogprobs:
    """ValueError when the top ids and their logprobs do not pair up."""
    if len(m.top_token_ids) != len(m.top_logprobs):
        raise ValueError(f"token logprobs: {len(m.top_token_ids)} top token ids but {len(m.top_logprobs)} "
                         "logprobs")
    return TokenLogprobs(m.token_id, m.logprob, tuple(zip(m.top_token_ids, m.top_logprobs, strict=True)), m.rank)


@dataclass(frozen=True)
class ImportedKV:
    """A prompt's KV computed elsewhere, verified: blocks ``first_block ..`` up to token ``num_tokens`` (the ones
    before are held here under the request's pin), every (block, layer) covered once by ``parts``, in
    ``layout``. ``reservation``: the lease of the blocks reserved for it (``Engine.reserve``) in which the
    landed parts already are; the engine adopts them without a copy and copies in the buffered parts.
    ``first_token``: the token prefill sampled after the prompt; ``first_logprobs``: its logprobs, when the
    request asked for them (prefill computed them from its logits, which decode never sees)."""

    layout: KVLayout
    num_tokens: int
    first_token: int
    first_block: int = 0
    parts: tuple[KVPart, ...] = ()
    reservation: str | None = None
    first_logprobs: TokenLogprobs | None = None


@dataclass(frozen=True)
class SessionHint:
    """The session a request belongs to: ``key`` is the tenant-namespaced id (``contracts.sessions.session_key``);
    ``end``: the client says this is the session's last request, so what it holds can go first once it
    finished. What the router alone reads (engines hear it as signals once the request finished): ``parent``, the
    key of the session this one was forked from (a sub-agent: it starts where its parent's prefix is);
    ``pause_s``, the pause the client announces after this request (a tool call of about that long; 0: none
    announced); ``retention``, what the caches do with its KV through that pause (``contracts.sessions.Retention``
    value, "" = the default); ``calls_tool``, the response is a tool call whatever its text (the request's
    ``tool_choice`` forces one), so the session pauses when it ends."""

    key: str
    end: bool = False
    parent: str = ""
    pause_s: float = 0.0
    retention: str = ""
    calls_tool: bool = False

    @classmethod
    def of(cls, key: str, end: bool = False) -> SessionHint | None:
        """A request's hint from its wire fields ("" key: it belongs to no session)."""
        return cls(key, end) if key else None


@dataclass(frozen=True)
class EngineRequest:
    """One request as a service hands it to an engine. ``export``: read its KV out as it is computed (prefill:
    a push) or when it finishes (decode: the write-back); ``imported``: its prompt's KV was pushed here, decode
    starts from it. ``session``: the session it belongs to (None: none); ``retention``: token ranges to keep
    ahead of others for a while (a TTL pin with its priority). ``slo``: its latency targets (0 = the engine's
    default), which the engine sizes its steps by; ``waited_s``: how long it had already waited when it reached
    the engine (its TTFT counts from its arrival at the mesh).

    ``generated``: the last ``generated`` tokens of ``prompt`` are this request's own output so far, streamed by
    another instance before it stopped (a migrated request, continued here). They count towards
    ``params.max_tokens``, a seeded sampler continues at their position, the grammar and the stop strings see
    them, and the text this engine emits starts after theirs: the outputs are those the first instance would
    have gone on to give. Only an engine with ``Engine.continues_requests`` accepts one."""

    request_id: str
    prompt: tuple[int, ...]
    params: SamplingParams
    cache_salt: str = ""
    lora: str = ""
    retention: tuple[RetentionRange, ...] = ()
    export: ExportPlan | None = None
    imported: ImportedKV | None = None
    generated: int = 0
    session: SessionHint | None = None
    slo: SLO = NO_SLO
    waited_s: float = 0.0

    def __post_init__(self) -> None:
        if self.generated < 0 or (self.generated and self.generated >= len(self.prompt)):
            raise ValueError(f"generated ({self.generated}) must be in [0, {len(self.prompt)}): the tokens already "
                             "generated follow at least one prompt token")
        if self.generated and self.params.prompt_logprobs is not None:
            raise ValueError("prompt_logprobs is for a request's first run: a continued request's prompt logprobs "
                             "were given where it started")


def prompt_length(work: worker_pb2.WorkRequest) -> int:
    """How many tokens ``work``'s prompt has, however it was sent."""
    return len(work.prompt_packed) // 4 if work.prompt_packed else len(work.prompt_token_ids)


def prompt_ids(work: worker_pb2.WorkRequest) -> tuple[int, ...]:
    """``work``'s prompt token ids, sent repeated or packed (``prompt_packed``: little-endian uint32). ValueError
    for both at once, or packed bytes that are not a whole number of ids."""
    packed = work.prompt_packed
    if not packed:
        return tuple(work.prompt_token_ids)
    if work.prompt_token_ids:
        raise ValueError("prompt_token_ids and prompt_packed are both set: send the prompt once, in one of them")
    if len(packed) % 4:
        raise ValueError(f"prompt_packed is {len(packed)} bytes: not a whole number of 4-byte token ids")
    ids = array("I")
    ids.frombytes(packed)
    if sys.byteorder == "big":  # pragma: no cover
        ids.byteswap()
    return tuple(ids)


def unpacked(work: worker_pb2.WorkRequest) -> worker_pb2.WorkRequest:
    """``work`` with its prompt in ``prompt_token_ids``, as an instance of a build from before ``prompt_packed``
    reads it (``work`` itself when it is there already)."""
    if not work.prompt_packed:
        return work
    out = worker_pb2.WorkRequest()
    out.CopyFrom(work)
    out.ClearField("prompt_packed")
    out.prompt_token_ids.extend(prompt_ids(work))
    return out


def engine_request_from_proto(work: worker_pb2.WorkRequest, export: ExportPlan | None = None) -> EngineRequest:
    """A work request as an engine takes it, its KV read out as ``export`` says (the service's choice, not the
    wire's). ``waited_s`` is the wire's, its wait before the service took it: the service adds its own. ValueError
    naming what is wrong: its sampling parameters, a retention range, its latency targets, or the tokens it says
    were generated already, or a prompt sent twice or cut mid-id."""
    return EngineRequest(work.request_id, prompt_ids(work), sampling_from_proto(work.sampling),
                         cache_salt=work.cache_salt, lora=work.lora_name,
                         retention=retention_from_proto(work.retention), export=export,
                         generated=work.generated_tokens, session=SessionHint.of(work.session_key, work.session_end),
                         slo=slo_from_proto(work.slo), waited_s=work.waited_s)


@dataclass(frozen=True)
class EngineOutput:
    """What one request got from one engine step: new tokens and text, or (``exported`` with no token) a piece of
    its KV read out mid-prefill. ``cached_tokens``: prompt tokens served from cache or imported."""

    request_id: str
    token_ids: tuple[int, ...]
    text: str = ""
    finished: bool = False
    finish_reason: str | None = None
    cached_tokens: int = 0
    exported: ExportedKV | None = None
    logprobs: tuple[TokenLogprobs, ...] = ()  # one per token of ``token_ids`` when the request asked for them
    # on the first output, when the request set ``prompt_logprobs``: one per prompt token after the first
    prompt_logprobs: tuple[TokenLogprobs, ...] = ()


@dataclass
class RequestTiming:
    """Where one request's time went inside the engine (``time.monotonic()`` readings; 0 = did not happen).

    Filled by the engine; read it only after the request's first output arrived (the output's delivery orders
    the writes before the read)."""

    submitted: float = 0.0     # the request was handed to the engine
    started: float = 0.0       # the engine began adding it (the wait before it: the step in flight)
    added: float = 0.0         # it was added (an imported prefix is in the paged cache by then)
    scheduled: float = 0.0     # the forward step that first admitted it began (stays 0 when imported)
    first_output: float = 0.0  # its first output left the engine
    preemptions: int = 0       # times it was preempted before its first output


AHEAD_EDGES_S = (0.25, 1.0, 4.0, 16.0)  # a new prompt's compute to its first token, at which ``ahead_tokens`` is told


@dataclass(frozen=True)
class EngineLoad:
    """A snapshot of an engine's queues and KV, for heartbeats, routing and metrics. ``ahead_tokens``: on an engine
    that orders its prompts by least work (``PrefillOrder.LEAST_WORK``), per edge of ``AHEAD_EDGES_S``, the prompt
    tokens still to compute that a new prompt with that many seconds of compute to its first token would wait for
    (it passes the rest: ``slo.tokens_ahead``); empty where prompts go in arrival order and every waiting token is
    ahead of a new one (``waiting_tokens``)."""

    running: int
    waiting: int
    free_blocks: int
    total_blocks: int
    cached_blocks: int
    host_blocks: int
    waiting_tokens: int
    steps: int = 0  # forward steps run so far: an engine that stops stepping with streams in it has stalled
    ahead_tokens: tuple[int, ...] = ()


@dataclass(frozen=True)
class Speed:
    """What an instance measured of itself, which the router's cost model prices it with (None: not measured yet,
    the router keeps its configured value): the prefill line (step time = ``prefill_overhead_s`` + tokens /
    ``prefill_tok_per_s``) and ``decode_step_s``, the decode-only step of its running batch with one more stream."""

    prefill_tok_per_s: float | None = None
    prefill_overhead_s: float | None = None
    decode_step_s: float | None = None


UNMEASURED = Speed()


@dataclass(frozen=True)
class StepCounts:
    """Forward steps of one kind so far: how many, their rows (the batch, summed), wall seconds and the engine
    thread's CPU seconds in them (wall well above CPU: the thread waited for the GIL or a core)."""

    steps: int = 0
    rows: int = 0
    seconds: float = 0.0
    cpu_seconds: float = 0.0


@dataclass(frozen=True)
class BlockStates:
    """Device blocks by state: referenced (by sequences or leases), pinned (by leases: decode's delta push),
    reserved (decode: a push landing in place)."""

    referenced: int = 0
    pinned: int = 0
    reserved: int = 0


@dataclass(frozen=True)
class SloOutcomes:
    """Finished requests with a latency target: met all of them (goodput) or missed; which target a missed one
    missed (both for some)."""

    met: int = 0
    missed: int = 0
    missed_ttft: int = 0
    missed_itl: int = 0


@dataclass(frozen=True)
class EngineStats:
    """Counters and gauges of an engine for its metrics (``kvmesh_worker_*``); a backend that cannot tell one
    leaves it at its zero (None where zero would be a claim: block states, SLO outcomes). Steps are split into
    decode-only ones and those with prompt tokens (prefill)."""

    load: EngineLoad
    speed: Speed = UNMEASURED
    host_capacity: int = 0
    blocks: BlockStates | None = None
    evicted_device: int = 0
    evicted_host: int = 0
    spilled_host: int = 0          # device -> host tier moves, in blocks
    loaded_host: int = 0           # host -> device
    preemptions: int = 0
    decode_steps: StepCounts = StepCounts()
    prefill_steps: StepCounts = StepCounts()
    prefetch_loaded: int = 0       # blocks of paused sessions warmed back before their return
    prefetch_used: int = 0         # ... then hit by the session
    prefetch_wasted: int = 0       # ... or evicted first
    sessions: int = 0              # live sessions it keeps blocks for
    slo: SloOutcomes | None = None


@dataclass(frozen=True)
class AdapterInfo:
    """A LoRA adapter an engine serves: its name, the generation its files were read at, their path, rank."""

    name: str
    generation: str
    path: str
    rank: int
