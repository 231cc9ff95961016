"""Bus messages (``kv.events`` batches, ``kv.ready``, heartbeats, routers' load, session signals, cluster copies) and
their wire format: versioned JSON, one frozen dataclass per message type.

Every message is a JSON object with ``"v"`` (format version) and ``"type"``. A reader rejects an unknown version
or type with ``CodecError`` and ignores fields it does not know, so a writer may add fields without a version bump.
Block keys travel as JSON integers: exact for all 64 bits in Python (never through floats).
"""

from __future__ import annotations

import dataclasses
import hashlib
import hmac
import json
import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any, ClassVar, TypeVar

from kvmesh.contracts.engine import AHEAD_EDGES_S, UNMEASURED, EngineLoad, Speed, TokenLogprobs
from kvmesh.contracts.events import AllBlocksCleared, BlockRemoved, BlockStored, KVEvent
from kvmesh.contracts.ids import BlockKey, InstanceId, RequestId, Role, TransferId, choices, part_transfer_id
from kvmesh.contracts.layout import KVLayout
from kvmesh.contracts.sampling import LOGITS, PROMPT_LOGPROBS, SPECIAL_TOKENS
from kvmesh.contracts.sessions import SessionEvent

VERSION = 1
_KEY_LIMIT = 1 << 64


class CodecError(ValueError):
    """A message that cannot be decoded (or encoded): bad JSON, unknown version or type, missing or bad field."""


# -- field checks, shared by encode and decode ----------------------------------------------------------------

def _get(d: dict[str, Any], name: str, *types: type) -> Any:
    if name not in d:
        raise CodecError(f"missing field {name!r}")
    value = d[name]
    if not isinstance(value, types) or (isinstance(value, bool) and bool not in types):
        expected = " or ".join("null" if t is type(None) else t.__name__ for t in types)
        raise CodecError(f"field {name!r} must be {expected}, got {type(value).__name__}")
    return value


def _key(value: Any) -> BlockKey:
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value < _KEY_LIMIT:
        raise CodecError(f"block key {value!r} is not an unsigned 64-bit integer")
    return BlockKey(value)


def _keys(values: Iterable[Any]) -> list[BlockKey]:
    return [_key(v) for v in values]


def _strs(values: Iterable[Any], name: str) -> tuple[str, ...]:
    out = tuple(values)
    if not all(isinstance(v, str) for v in out):
        raise CodecError(f"field {name!r} must hold only strings")
    return out


def _logprobs(value: Any) -> TokenLogprobs | None:
    """A token's logprobs: ``{"token_id", "logprob", "top": [[id, logprob], ...]}``, or null."""
    if value is None:
        return None
    try:
        if not isinstance(value, dict):
            raise CodecError("must be an object or null")
        top = _get(value, "top", list)
        if not all(isinstance(p, list) and len(p) == 2 and type(p[0]) is int and isinstance(p[1], (int, float))
                   and not isinstance(p[1], bool) for p in top):
            raise CodecError("'top' must be a list of [token id, logprob]")
        return TokenLogprobs(_get(value, "token_id", int), float(_get(value, "logprob", int, float)),
                             tuple((p[0], float(p[1])) for p in top))
    except CodecError as e:
        raise CodecError(f"field 'first_logprobs': {e}") from None


def _logprobs_to_json(lp: TokenLogprobs | None) -> dict[str, Any] | None:
    return None if lp is None else {"token_id": lp.token_id, "logprob": lp.logprob,
                                    "top": [[t, v] for t, v in lp.top]}


def _layout(d: dict[str, Any]) -> KVLayout | None:
    try:
        return KVLayout.from_dict(d) if d else None
    except (TypeError, ValueError) as e:
        raise CodecError(f"field 'layout': {e}") from None


# -- KV events inside a batch ----------------------------------------------------------------------------------

def _event_to_json(e: KVEvent) -> dict[str, Any]:
    if isinstance(e, BlockStored):
        return {"type": "block_stored", "block_keys": _keys(e.block_keys),
                "parent_key": None if e.parent_key is None else _key(e.parent_key),
                "token_count": e.token_count, "tier": e.tier, "lora": e.lora,
                "extra_keys": list(_strs(e.extra_keys, "extra_keys"))}
    if isinstance(e, BlockRemoved):
        out = {"type": "block_removed", "block_keys": _keys(e.block_keys), "tier": e.tier}
        return out | {"reason": e.reason} if e.reason else out
    if isinstance(e, AllBlocksCleared):
        return {"type": "all_blocks_cleared"}
    raise CodecError(f"not a KV event: {e!r}")


def _event_from_json(d: Any) -> KVEvent:
    if not isinstance(d, dict):
        raise CodecError("each event must be a JSON object")
    kind = _get(d, "type", str)
    if kind == "block_stored":
        parent = _get(d, "parent_key", int, type(None))
        return BlockStored(block_keys=tuple(_keys(_get(d, "block_keys", list))),
                           parent_key=None if parent is None else _key(parent),
                           token_count=_get(d, "token_count", int), tier=_get(d, "tier", str),
                           lora=_get(d, "lora", str, type(None)) if "lora" in d else None,
                           extra_keys=_strs(d.get("extra_keys", []), "extra_keys"))
    if kind == "block_removed":
        return BlockRemoved(block_keys=tuple(_keys(_get(d, "block_keys", list))), tier=_get(d, "tier", str),
                            reason=_get(d, "reason", str) if "reason" in d else "")
    if kind == "all_blocks_cleared":
        return AllBlocksCleared()
    raise CodecError(f"unknown KV event type {kind!r}")


# -- messages ----------------------------------------------------------------------------------------------------

def _dump(kind: str, body: dict[str, Any]) -> bytes:
    try:
        return json.dumps({"v": VERSION, "type": kind, **body}, separators=(",", ":"), allow_nan=False).encode()
    except (TypeError, ValueError) as e:
        raise CodecError(f"cannot encode {kind}: {e}") from e


@dataclass(frozen=True)
class KVEventBatch:
    """One instance's KV events, numbered: ``seq`` grows by one per batch, so a gap means lost events."""

    TYPE: ClassVar[str] = "kv_event_batch"
    instance_id: InstanceId
    seq: int
    ts: float
    events: tuple[KVEvent, ...]

    def encode(self) -> bytes:
        return _dump(self.TYPE, {"instance_id": self.instance_id, "seq": self.seq, "ts": self.ts,
                                 "events": [_event_to_json(e) for e in self.events]})

    @classmethod
    def decode(cls, data: bytes) -> KVEventBatch:
        return _expect(cls, decode(data))

    @classmethod
    def _from_json(cls, d: dict[str, Any]) -> KVEventBatch:
        return cls(instance_id=InstanceId(_get(d, "instance_id", str)), seq=_get(d, "seq", int),
                   ts=float(_get(d, "ts", int, float)),
                   events=tuple(_event_from_json(e) for e in _get(d, "events", list)))


@dataclass(frozen=True)
class KVReady:
    """Prefill pushed a request's KV to ``decode_instance`` (or failed: ``ok=False``, so decode falls back)."""

    TYPE: ClassVar[str] = "kv_ready"
    request_id: RequestId
    decode_instance: InstanceId
    transfer_id: TransferId
    block_keys: tuple[BlockKey, ...]
    num_tokens: int
    first_token: int
    layout: KVLayout | None  # None only where no KV moved (a failure, or the router's own notice)
    prefill_instance: InstanceId
    ok: bool = True
    error: str = ""
    first_block: int = 0  # the pushed blocks are the prompt's blocks from this index on (decode holds the rest)
    parts: int = 1  # pushed as this many transfers, ``part_transfer_id(transfer_id, 0..parts-1)``, in block order
    first_logprobs: TokenLogprobs | None = None  # ``first_token``'s, when the request asked for logprobs
    # HMAC-SHA256 (hex) of the message without it, keyed by the push's capability (the token decode issued for this
    # request, which only the router and the chosen prefill hold): decode drops a kv.ready it does not verify
    mac: str = ""

    def part_ids(self) -> tuple[TransferId, ...]:
        return tuple(part_transfer_id(self.transfer_id, i) for i in range(self.parts))

    def signed(self, push_token: str) -> KVReady:
        """This message with its MAC under ``push_token``."""
        return dataclasses.replace(self, mac=self._mac(push_token))

    def verify(self, push_token: str) -> bool:
        """Whether the MAC is this message's under ``push_token`` (constant time)."""
        return bool(self.mac) and bool(push_token) and hmac.compare_digest(self.mac, self._mac(push_token))

    def _mac(self, push_token: str) -> str:
        body = dataclasses.replace(self, mac="").encode()
        return hmac.new(push_token.encode(), body, hashlib.sha256).hexdigest()

    def encode(self) -> bytes:
        return _dump(self.TYPE, {"request_id": self.request_id, "decode_instance": self.decode_instance,
                                 "first_block": self.first_block, "parts": self.parts,
                                 "transfer_id": self.transfer_id, "block_keys": _keys(self.block_keys),
                                 "num_tokens": self.num_tokens, "first_token": self.first_token,
                                 "layout": {} if self.layout is None else self.layout.to_dict(),
                                 "prefill_instance": self.prefill_instance,
                                 "ok": self.ok, "error": self.error,
                                 "first_logprobs": _logprobs_to_json(self.first_logprobs),
                                 **({"mac": self.mac} if self.mac else {})})

    @classmethod
    def decode(cls, data: bytes) -> KVReady:
        return _expect(cls, decode(data))

    @classmethod
    def _from_json(cls, d: dict[str, Any]) -> KVReady:
        if "parts" in d and _get(d, "parts", int) < 1:
            raise CodecError(f"field 'parts' must be at least 1, got {d['parts']}")
        return cls(request_id=RequestId(_get(d, "request_id", str)),
                   decode_instance=InstanceId(_get(d, "decode_instance", str)),
                   transfer_id=TransferId(_get(d, "transfer_id", str)),
                   block_keys=tuple(_keys(_get(d, "block_keys", list))),
                   num_tokens=_get(d, "num_tokens", int), first_token=_get(d, "first_token", int),
                   layout=_layout(_get(d, "layout", dict)),
                   prefill_instance=InstanceId(_get(d, "prefill_instance", str)),
                   ok=_get(d, "ok", bool) if "ok" in d else True,
                   error=_get(d, "error", str) if "error" in d else "",
                   first_block=_get(d, "first_block", int) if "first_block" in d else 0,
                   parts=_get(d, "parts", int) if "parts" in d else 1,
                   first_logprobs=_logprobs(d.get("first_logprobs")),
                   mac=_get(d, "mac", str) if "mac" in d else "")


# ``InstanceLoad.ahead_tokens`` on the wire: one key per edge, named by it, so a reader whose edges differ reads none
AHEAD_KEYS = tuple(f"ahead_tokens_{round(e * 1000)}ms" for e in AHEAD_EDGES_S)


@dataclass(frozen=True)
class InstanceLoad:
    """How loaded an instance is and what it measured of itself, as its heartbeat says. On the wire a flat JSON
    object of numbers (``to_dict``); a reader ignores keys it does not know and leaves a known one whose value is
    not a finite number >= 0 at its default, so the instances of another version still route (a bad speed is
    the configured speed, as if the instance had not measured one)."""

    running: int = 0
    waiting: int = 0
    free_blocks: int = 0
    total_blocks: int = 0
    cached_blocks: int = 0
    host_blocks: int = 0
    waiting_tokens: int = 0
    steps: int = 0                     # forward steps run so far (progress, whether or not a token left)
    kv_fallbacks: int = 0              # pushes it recomputed instead of importing
    kv_block_bytes: int = 0            # one block as its engine stores it (0: not said)
    lora_load_s: float | None = None   # its measured time to load an adapter (None: not measured)
    speed: Speed = UNMEASURED
    ahead_tokens: tuple[int, ...] = ()  # least work first: the queue a new prompt waits for (EngineLoad's)

    COUNTS: ClassVar[tuple[str, ...]] = ("running", "waiting", "free_blocks", "total_blocks", "cached_blocks",
                                         "host_blocks", "waiting_tokens", "steps", "kv_fallbacks",
                                         "kv_block_bytes")
    SPEEDS: ClassVar[tuple[str, ...]] = tuple(f.name for f in dataclasses.fields(Speed))

    @classmethod
    def of(cls, load: EngineLoad, speed: Speed, *, kv_fallbacks: int = 0, kv_block_bytes: int = 0,
           lora_load_s: float | None = None) -> InstanceLoad:
        """An engine's load and speed, with what its instance adds."""
        return cls(**dataclasses.asdict(load), kv_fallbacks=kv_fallbacks, kv_block_bytes=kv_block_bytes,
                   lora_load_s=lora_load_s, speed=speed)

    def to_dict(self) -> dict[str, float]:
        out: dict[str, float] = {name: getattr(self, name) for name in self.COUNTS}
        if self.lora_load_s is not None:
            out["lora_load_s"] = self.lora_load_s
        out.update({k: v for k, v in dataclasses.asdict(self.speed).items() if v is not None})
        if len(self.ahead_tokens) == len(AHEAD_KEYS):
            out.update(zip(AHEAD_KEYS, self.ahead_tokens, strict=True))
        return out

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> InstanceLoad:
        numbers = {k: float(v) for k, v in d.items() if isinstance(v, (int, float)) and not isinstance(v, bool)
                   and math.isfinite(v) and v >= 0}
        ahead = tuple(int(numbers[k]) for k in AHEAD_KEYS) if all(k in numbers for k in AHEAD_KEYS) else ()
        return cls(**{k: int(numbers[k]) for k in cls.COUNTS if k in numbers},
                   lora_load_s=numbers.get("lora_load_s"),
                   speed=Speed(**{k: numbers[k] for k in cls.SPEEDS if k in numbers}), ahead_tokens=ahead)


PACKED_PROMPT = "packed_prompt"  # an instance reads ``WorkRequest.prompt_packed``
# what this build's instances do beyond what every build does (``Heartbeat.features``): the requests' fields they
# apply (``SamplingParams.features``) and the wire forms they read
FEATURES = (LOGITS, PROMPT_LOGPROBS, PACKED_PROMPT, SPECIAL_TOKENS)


@dataclass(frozen=True)
class Heartbeat:
    """An instance is alive, where to reach it, how loaded it is and how fast it measured itself (``load``)."""

    TYPE: ClassVar[str] = "heartbeat"
    instance_id: InstanceId
    role: Role
    grpc_address: str
    transfer_address: str
    ts: float
    load: InstanceLoad
    model: str
    block_size: int
    # the LoRA adapters it serves: (name, generation, path); a request's block keys use name@generation
    loras: tuple[tuple[str, str, str], ...] = ()
    # what its pushed and received blocks mean (its engine converts its own memory to and from this): a prefill
    # and a decode are paired only when theirs are equal. None: an older instance that did not say
    kv_layout: KVLayout | None = None
    # the other KV dtypes it takes a hand-off in (cast on intake, ``contracts.layout.converter``)
    kv_accepts: tuple[str, ...] = ()
    # why its engine's KV cannot be converted to kv_layout ("" when it can): it is never paired for a hand-off,
    # and the router does not count on the pool for it
    kv_unconvertible: str = ""
    # it is stopping: the requests it runs finish there, no new one is sent to it (older routers ignore the field
    # and learn it when its beats stop)
    draining: bool = False
    # what it applies of a request beyond what every build does (``FEATURES``); an older instance says nothing,
    # and the router sends it no request that needs what it does not say
    features: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        try:
            object.__setattr__(self, "role", Role(self.role))  # a plain string from config is accepted
        except ValueError:
            raise CodecError(f"heartbeat role {self.role!r} is not one of {choices(Role)}") from None

    def encode(self) -> bytes:
        return _dump(self.TYPE, {"instance_id": self.instance_id, "role": self.role,
                                 "grpc_address": self.grpc_address, "transfer_address": self.transfer_address,
                                 "ts": self.ts, "load": self.load.to_dict(), "model": self.model,
                                 "block_size": self.block_size, "loras": [list(a) for a in self.loras],
                                 **({"kv_layout": self.kv_layout.to_dict()} if self.kv_layout else {}),
                                 **({"kv_accepts": list(self.kv_accepts)} if self.kv_accepts else {}),
                                 **({"kv_unconvertible": self.kv_unconvertible} if self.kv_unconvertible else {}),
                                 **({"draining": True} if self.draining else {}),
                                 **({"features": list(self.features)} if self.features else {})})

    @classmethod
    def decode(cls, data: bytes) -> Heartbeat:
        return _expect(cls, decode(data))

    @classmethod
    def _from_json(cls, d: dict[str, Any]) -> Heartbeat:
        return cls(instance_id=InstanceId(_get(d, "instance_id", str)), role=_get(d, "role", str),
                   grpc_address=_get(d, "grpc_address", str), transfer_address=_get(d, "transfer_address", str),
                   ts=float(_get(d, "ts", int, float)), load=InstanceLoad.from_dict(_get(d, "load", dict)),
                   model=_get(d, "model", str),
                   block_size=_get(d, "block_size", int), loras=_loras(d.get("loras", [])),
                   kv_layout=_layout(d["kv_layout"]) if d.get("kv_layout") else None,
                   kv_accepts=_strings(d.get("kv_accepts", []), "kv_accepts"),
                   kv_unconvertible=_get(d, "kv_unconvertible", str) if "kv_unconvertible" in d else "",
                   draining=_get(d, "draining", bool) if "draining" in d else False,
                   features=_strings(d.get("features", []), "features"))


def _strings(value: Any, name: str) -> tuple[str, ...]:
    if not isinstance(value, list) or not all(isinstance(x, str) for x in value):
        raise CodecError(f"heartbeat {name} must be a list of strings, not {value!r}")
    return tuple(value)


def _loras(value: Any) -> tuple[tuple[str, str, str], ...]:
    """A heartbeat's adapters: a list of [name, generation, path] (absent in older engines' beats)."""
    if not isinstance(value, list) or not all(isinstance(a, list) and len(a) == 3
                                              and all(isinstance(x, str) for x in a) for a in value):
        raise CodecError(f"heartbeat loras must be a list of [name, generation, path], not {value!r}")
    return tuple((a[0], a[1], a[2]) for a in value)


@dataclass(frozen=True)
class RouterLoad:
    """What one router replica has in flight on each engine instance (requests, and their prompt tokens not yet
    prefilled as far as it knows), so the other replicas count it too and do not all pick the same instance.
    Absolute counts: a lost message is repaired by the next one; ``ts``: the router's clock (epoch s)."""

    TYPE: ClassVar[str] = "router_load"
    router_id: str
    ts: float
    inflight: dict[str, int]
    inflight_tokens: dict[str, int]

    def encode(self) -> bytes:
        return _dump(self.TYPE, {"router_id": self.router_id, "ts": self.ts, "inflight": self.inflight,
                                 "inflight_tokens": self.inflight_tokens})

    @classmethod
    def decode(cls, data: bytes) -> RouterLoad:
        return _expect(cls, decode(data))

    @classmethod
    def _from_json(cls, d: dict[str, Any]) -> RouterLoad:
        return cls(router_id=_get(d, "router_id", str), ts=float(_get(d, "ts", int, float)),
                   inflight=_counts(_get(d, "inflight", dict), "inflight"),
                   inflight_tokens=_counts(_get(d, "inflight_tokens", dict), "inflight_tokens"))


def _counts(value: dict[str, Any], name: str) -> dict[str, int]:
    if not all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in value.values()):
        raise CodecError(f"field {name!r} must map instance ids to counts >= 0")
    return dict(value)


@dataclass(frozen=True)
class SessionSignal:
    """What the router learnt about a session outside a request, for every cache and router (``sessions``
    subject; ``ROUTED`` goes to routers only, on ``sessions.routed``): it ended, paused (its response ended in a
    tool call, or the client said so), is back (``RESUME``), and so on (``SessionEvent``). ``session``: the
    tenant-namespaced key (``contracts.sessions.session_key``); ``instance``: where its last request ran, or
    for ``RESUME`` / ``ROUTED`` where the next one goes ("" = unknown); ``expected_s``: a pause's expected length
    as the client announced it (0: not announced; caches use the session's own cadence)."""

    TYPE: ClassVar[str] = "session_signal"
    session: str
    event: SessionEvent
    ts: float
    instance: str = ""
    expected_s: float = 0.0

    def __post_init__(self) -> None:
        try:
            object.__setattr__(self, "event", SessionEvent(self.event))
        except ValueError:
            raise CodecError(f"session event {self.event!r} is not one of {choices(SessionEvent)}") from None

    def encode(self) -> bytes:
        return _dump(self.TYPE, {"session": self.session, "event": self.event, "ts": self.ts,
                                 "instance": self.instance, "expected_s": self.expected_s})

    @classmethod
    def decode(cls, data: bytes) -> SessionSignal:
        return _expect(cls, decode(data))

    @classmethod
    def _from_json(cls, d: dict[str, Any]) -> SessionSignal:
        expected = float(_get(d, "expected_s", int, float)) if "expected_s" in d else 0.0
        if not 0 <= expected < float("inf"):
            raise CodecError(f"field 'expected_s' must be a number of seconds >= 0, not {expected!r}")
        return cls(session=_get(d, "session", str), event=_get(d, "event", str),
                   ts=float(_get(d, "ts", int, float)), instance=_get(d, "instance", str) if "instance" in d else "",
                   expected_s=expected)


@dataclass(frozen=True)
class KVCopies:
    """cachesvc to one instance (``kv.copies.<instance>``): of the blocks it holds, ``shared`` now have another
    copy in the cluster (another instance or the pool holds them) and ``sole`` no longer do, so it evicts the
    former before the last copy of anything."""

    TYPE: ClassVar[str] = "kv_copies"
    instance_id: InstanceId
    shared: tuple[BlockKey, ...] = ()
    sole: tuple[BlockKey, ...] = ()

    def encode(self) -> bytes:
        return _dump(self.TYPE, {"instance_id": self.instance_id, "shared": _keys(self.shared),
                                 "sole": _keys(self.sole)})

    @classmethod
    def decode(cls, data: bytes) -> KVCopies:
        return _expect(cls, decode(data))

    @classmethod
    def _from_json(cls, d: dict[str, Any]) -> KVCopies:
        return cls(instance_id=InstanceId(_get(d, "instance_id", str)),
                   shared=tuple(_keys(_get(d, "shared", list))), sole=tuple(_keys(_get(d, "sole", list))))


@dataclass(frozen=True)
class KVQuarantine:
    """An instance's KV canary caught these blocks' KV diverging from a recompute (``kv.quarantine``): the pool
    never serves them again (cachesvc), whatever copy it holds. ``path``: how the bad KV was reused (local, pool,
    handoff)."""

    TYPE: ClassVar[str] = "kv_quarantine"
    instance_id: InstanceId
    block_keys: tuple[BlockKey, ...]
    path: str = ""

    def encode(self) -> bytes:
        return _dump(self.TYPE, {"instance_id": self.instance_id, "block_keys": _keys(self.block_keys),
                                 "path": self.path})

    @classmethod
    def decode(cls, data: bytes) -> KVQuarantine:
        return _expect(cls, decode(data))

    @classmethod
    def _from_json(cls, d: dict[str, Any]) -> KVQuarantine:
        return cls(instance_id=InstanceId(_get(d, "instance_id", str)),
                   block_keys=tuple(_keys(_get(d, "block_keys", list))), path=_get(d, "path", str))


@dataclass(frozen=True)
class CacheShardBeat:
    """A cachesvc's beat (``cache.shard.<shard>``), every second: which shard of how many it is, the gRPC address its
    callers dial, and the copies it keeps, so routers and instances configured to find cachesvc through the bus
    (``cachesvc_address = "nats"``) learn the shard list without being told it. ``address`` "": it binds a
    wildcard address and was given none to advertise (callers cannot use it). A ``shard`` at or past ``shards``: a
    shard leaving the cluster, which only the other shards' hand-over calls (builds before that dropped its beat)."""

    TYPE: ClassVar[str] = "cache_shard"
    shard: int
    shards: int
    address: str
    ts: float
    index_copies: int = 1
    pool_copies: int = 1

    def encode(self) -> bytes:
        return _dump(self.TYPE, {"shard": self.shard, "shards": self.shards, "address": self.address, "ts": self.ts,
                                 "index_copies": self.index_copies, "pool_copies": self.pool_copies})

    @classmethod
    def decode(cls, data: bytes) -> CacheShardBeat:
        return _expect(cls, decode(data))

    @classmethod
    def _from_json(cls, d: dict[str, Any]) -> CacheShardBeat:
        shard, shards = _get(d, "shard", int), _get(d, "shards", int)
        if shard < 0 or shards < 1:
            raise CodecError(f"shard {shard} of {shards}: not a shard of that many")
        return cls(shard=shard, shards=shards, address=_get(d, "address", str), ts=float(_get(d, "ts", int, float)),
                   index_copies=int(d.get("index_copies", 1)), pool_copies=int(d.get("pool_copies", 1)))


Message = KVEventBatch | KVReady | Heartbeat | RouterLoad | SessionSignal | KVCopies | KVQuarantine | CacheShardBeat
_TYPES: dict[str, type[Message]] = {
    t.TYPE: t for t in (KVEventBatch, KVReady, Heartbeat, RouterLoad, SessionSignal, KVCopies, KVQuarantine,
                        CacheShardBeat)}


def decode(data: bytes) -> Message:
    """Any bus message from its bytes; ``CodecError`` says why when it cannot be read."""
    try:
        d = json.loads(data)
    except (UnicodeDecodeError, ValueError) as e:
        raise CodecError(f"not JSON: {e}") from e
    if not isinstance(d, dict):
        raise CodecError("a message must be a JSON object")
    if d.get("v") != VERSION:
        raise CodecError(f"unsupported message version {d.get('v')!r} (this reader speaks v{VERSION})")
    kind = d.get("type")
    if kind not in _TYPES:
        raise CodecError(f"unknown message type {kind!r} (known: {sorted(_TYPES)})")
    try:
        return _TYPES[kind]._from_json(d)
    except CodecError as e:
        raise CodecError(f"bad {kind} message: {e}") from None
    except (TypeError, ValueError) as e:
        raise CodecError(f"bad {kind} message: {e}") from e


M = TypeVar("M", KVEventBatch, KVReady, Heartbeat, RouterLoad, SessionSignal, KVCopies, KVQuarantine, CacheShardBeat)


def _expect(cls: type[M], msg: Message) -> M:
    if not isinstance(msg, cls):
        raise CodecError(f"expected a {cls.TYPE} message, got {type(msg).TYPE}")
    return msg
