"""The transfer header: what a pushed payload claims to be, and the checks a receiver runs on it.

The header is JSON (it is small; the payload never is). 64-bit values (block keys, xxh3_64 checksums) travel
as 16-digit hex strings so any JSON reader keeps them exact. ``source`` is the backend's own descriptor of
where the bytes are (empty for ``tcp``: they follow the header on the same connection).

A payload holds whole blocks, or (``layers``) each block's slice of a range of layers: a part of a KV hand-off
pushed layer group by layer group. Checksums are then over each block's slice. ``first_block`` places the
payload in the sender's sequence of blocks (a hand-off's parts; 0 for anything else). ``token`` is the push
capability the receiver issued for it (:mod:`kvmesh.transfer.grants`); version 2 of the header is the first
that carries one. ``seal`` (version 3): the key and chunk size of a ``tcp`` payload sent sealed outside TLS
(:mod:`kvmesh.transfer.seal`); a sender writes it only on a TLS connection.

Versions are negotiated, and this module is the one place that knows them. Each end speaks a range
(:class:`Versions`, :class:`HeaderCodec.speaks`); a receiver advertises its range where it hands out the push's
capability (beside the token: decode's Decode call metadata, ``GetBlocksRequest``, ``GrantPutResponse``), the
sender writes the highest version both speak (:func:`negotiate`), and the receiver reads any version in its range
and refuses the rest naming both ranges. A receiver that advertises nothing (a build before negotiation) speaks
2 only (:data:`UNSAID`). A later version adds its fields in a :class:`HeaderCodec` subclass.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any, NamedTuple, TypeVar

import xxhash

from kvmesh.contracts.ids import BlockKey, TransferId
from kvmesh.contracts.layout import KVLayout
from kvmesh.transfer.errors import Refusal, TransferRejected
from kvmesh.transfer.seal import Seal

# A header's size is what its blocks add (each block's key and checksum: two quoted 16-digit hex strings and their
# commas, 38 bytes) on top of the rest. The rest of the largest header a sender can write (a 1024-character
# transfer id, a mooncake source, layers) measures 1.5 KiB; HEADER_BASE keeps a margin over it.
HEADER_BASE = 4096
HEADER_PER_BLOCK = 38
MAX_BLOCKS = 32768  # blocks in one push at most: a 512k-token sequence of 16-token blocks
MAX_TRANSFER_ID = 1024  # characters (a hand-off's: a request id of at most 128, an instance id, a part number)
T = TypeVar("T")


@dataclass(frozen=True)
class TransferHeader:
    transfer_id: TransferId
    backend: str  # a TransferBackend's value; checked by the receiver, which may not serve it
    layout: KVLayout
    block_keys: tuple[BlockKey, ...]
    num_tokens: int
    checksums: tuple[int, ...]  # xxh3_64 of each block's raw bytes, in order
    source: dict[str, Any] = field(default_factory=dict)
    layers: tuple[int, int] | None = None  # (first, end): each block's slice of these layers; None: all
    first_block: int = 0  # where the payload's first block sits in the sender's sequence
    token: str = ""  # the push capability its receiver issued
    seal: Seal | None = None  # the payload follows sealed (version 3, a TLS connection, tcp): kvmesh.transfer.seal

    @property
    def num_blocks(self) -> int:
        return len(self.checksums)

    @property
    def block_nbytes(self) -> int:
        """Bytes of each block of the payload (a slice of the layout's block when ``layers`` is set)."""
        return self.layout.layers_nbytes(self.layers)

    @property
    def nbytes(self) -> int:
        return self.num_blocks * self.block_nbytes


class Versions(NamedTuple):
    """The header versions one end speaks, ``low`` to ``high``. Travels as ``"<low>-<high>"``."""

    low: int
    high: int

    def __str__(self) -> str:
        return f"{self.low}-{self.high}"

    def speaks(self, version: int) -> bool:
        return self.low <= version <= self.high


SPOKEN = Versions(2, 3)  # this build's (2: the first that carries the push capability, ``token``; 3: ``seal``)
SEALED = 3  # the first version whose payload may be sealed
UNSAID = Versions(2, 2)  # a receiver that advertises nothing: the builds before negotiation spoke 2 only


def parse_versions(text: str) -> Versions:
    """A peer's advertised range (``"2-3"``); empty (a build before negotiation, or a router of one between
    us) is :data:`UNSAID`. ValueError when it is no range."""
    if not text:
        return UNSAID
    low, sep, high = text.partition("-")
    if not sep or not low.isdigit() or not high.isdigit() or int(low) > int(high):
        raise ValueError(f"transfer header versions {text!r} are not '<low>-<high>' (e.g. '2-3')")
    return Versions(int(low), int(high))


def negotiate(ours: Versions, theirs: Versions) -> int:
    """The highest header version both ends speak; refused (``version``) naming both ranges when none."""
    high = min(ours.high, theirs.high)
    if high < max(ours.low, theirs.low):
        older = "this sender" if theirs.low > ours.high else "the receiver"
        raise TransferRejected(f"no transfer header version in common: this sender speaks {ours}, the receiver "
                               f"{theirs}; upgrade {older} (docs/deploy.md, Upgrades)", Refusal.VERSION)
    return high


class HeaderCodec:
    """How one build writes and reads headers: the versions it speaks, and each version's fields. A later
    version subclasses it: widen ``speaks``, add the new fields in :meth:`to_doc` and read them in
    :meth:`from_doc`, both given the version in hand (a receiver of an older version never sees them)."""

    speaks: Versions = SPOKEN

    def encode(self, header: TransferHeader, version: int) -> bytes:
        """``header`` as ``version`` (one both ends speak: :func:`negotiate`); it names the sender's range,
        which older receivers ignore, so a refusal can say both."""
        if not self.speaks.speaks(version):
            raise ValueError(f"header version {version} is not one this sender speaks ({self.speaks})")
        doc = {"v": version, "speaks": str(self.speaks)} | self.to_doc(header, version)
        return json.dumps(doc, separators=(",", ":")).encode()

    def decode(self, raw: bytes) -> TransferHeader:
        """Parse and sanity-check a header; raises :class:`TransferRejected` saying what is wrong."""
        try:
            doc = json.loads(raw)
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            raise TransferRejected(f"malformed header: not JSON ({e})", Refusal.MALFORMED) from None
        if not isinstance(doc, dict):
            raise TransferRejected("malformed header: not a JSON object", Refusal.MALFORMED)
        version = doc.get("v")
        if type(version) is not int or not self.speaks.speaks(version):
            raise self._unspoken(version, doc.get("speaks"))
        try:
            header = self.from_doc(doc, version)
            _check_counts(header, _typed(doc, "nbytes", int))
        except (TypeError, ValueError) as e:
            raise TransferRejected(f"malformed header: {e}", Refusal.MALFORMED) from None
        return header

    def to_doc(self, header: TransferHeader, version: int) -> dict[str, Any]:
        """The fields of ``version`` (2: all but ``seal``; 3: ``seal`` too, when the payload is sealed)."""
        doc = {
            "transfer_id": header.transfer_id,
            "backend": header.backend,
            "layout": header.layout.to_dict(),
            "block_keys": [f"{k:016x}" for k in header.block_keys],
            "num_tokens": header.num_tokens,
            "checksums": [f"{c:016x}" for c in header.checksums],
            "nbytes": header.nbytes,
            "source": header.source,
            "first_block": header.first_block,
            "token": header.token,
        }
        if header.layers is not None:
            doc["layers"] = list(header.layers)
        if header.seal is not None:
            if version < SEALED:
                raise ValueError(f"a sealed payload needs header version {SEALED} or later, not {version}")
            doc["seal"] = header.seal.to_doc()
        return doc

    def from_doc(self, doc: dict[str, Any], version: int) -> TransferHeader:
        """The header of a ``version`` document (one :attr:`speaks`); TypeError / ValueError when a field is
        missing or wrong."""
        return TransferHeader(
            transfer_id=TransferId(_typed(doc, "transfer_id", str)),
            backend=_typed(doc, "backend", str),
            layout=KVLayout.from_dict(_typed(doc, "layout", dict)),
            block_keys=tuple(map(BlockKey, _hex64s(_typed(doc, "block_keys", list)))),
            num_tokens=_typed(doc, "num_tokens", int),
            checksums=_hex64s(_typed(doc, "checksums", list)),
            source=_typed(doc, "source", dict),
            layers=_layers(doc),
            first_block=_typed(doc, "first_block", int) if "first_block" in doc else 0,
            token=_typed(doc, "token", str),
            seal=_seal(doc) if version >= SEALED else None,
        )

    def _unspoken(self, version: object, theirs: object) -> TransferRejected:
        """The refusal of a header in a version outside :attr:`speaks`, naming both ranges (a sender before
        negotiation names none: it speaks the version it sent)."""
        try:
            sender = str(parse_versions(theirs)) if isinstance(theirs, str) and theirs else repr(version)
        except ValueError:
            sender = repr(version)
        if type(version) is int and version < self.speaks.low:
            what = "upgrade the sender" + (", to one that carries the push capability its receiver issued"
                                           if version < 2 else "")
        else:
            what = "a sender keeps to the range its receiver advertised with the push's capability"
        return TransferRejected(f"unsupported header version {version!r} (the sender speaks {sender}); this "
                                f"receiver speaks {self.speaks}: {what}", Refusal.VERSION)


CODEC = HeaderCodec()  # this build's


def encode_header(header: TransferHeader, version: int = SPOKEN.high) -> bytes:
    """``header`` as this build writes ``version`` (:class:`HeaderCodec`)."""
    return CODEC.encode(header, version)


def decode_header(raw: bytes) -> TransferHeader:
    """A header as this build reads it (:meth:`HeaderCodec.decode`)."""
    return CODEC.decode(raw)


def header_limit(num_blocks: int) -> int:
    """The most bytes a header describing up to ``num_blocks`` blocks takes."""
    return HEADER_BASE + HEADER_PER_BLOCK * num_blocks


MAX_HEADER_BYTES = header_limit(MAX_BLOCKS)


def block_checksums(payload: memoryview, stride: int) -> tuple[int, ...]:
    """xxh3_64 of each ``stride``-byte block of a flat byte view (one hash call per block, no copies)."""
    return tuple(xxhash.xxh3_64_intdigest(payload[i:i + stride]) for i in range(0, len(payload), stride))


def corrupt_blocks(header: TransferHeader, payload: memoryview) -> list[int]:
    """Indices of the blocks whose bytes do not hash to the header's checksum (a flat payload)."""
    return Verifier.flat(header, payload).bad()


def corrupt_landed_blocks(header: TransferHeader, views: list[memoryview]) -> list[int]:
    """Indices of the blocks whose bytes do not hash to the header's checksum, over a payload given as views
    (its bytes in wire order, the same number of views per block; e.g. landed scattered in place): each block's
    checksum is streamed over its views where they lie, no bytes gathered."""
    return Verifier(header, views).bad()


class Verifier:
    """Checks a payload's blocks against the header's checksums, block by block as its bytes arrive: a receiver
    that gets the payload in steps calls :meth:`upto` after each (the blocks complete by then are hashed while the
    next step is on its way), then :meth:`bad` for the rest and the answer. ``views``: the payload's bytes in wire
    order, the same number of views per block."""

    def __init__(self, header: TransferHeader, views: list[memoryview]) -> None:
        self.checksums, self.block_nbytes = header.checksums, header.block_nbytes
        self.views, self.per_block = views, len(views) // header.num_blocks
        self.done = 0  # blocks hashed so far
        self._bad: list[int] = []
        self._h = xxhash.xxh3_64()

    @classmethod
    def flat(cls, header: TransferHeader, payload: memoryview) -> Verifier:
        stride = header.block_nbytes
        return cls(header, [payload[i * stride:(i + 1) * stride] for i in range(header.num_blocks)])

    def upto(self, nbytes: int) -> None:
        """Hash the blocks whose bytes all lie in the payload's first ``nbytes``."""
        end, h = min(len(self.checksums), nbytes // self.block_nbytes), self._h
        for i in range(self.done, end):
            h.reset()
            for view in self.views[i * self.per_block:(i + 1) * self.per_block]:
                h.update(view)
            if h.intdigest() != self.checksums[i]:
                self._bad.append(i)
        self.done = max(self.done, end)

    def bad(self) -> list[int]:
        """Indices of the blocks whose bytes do not hash to their checksum (every block hashed)."""
        self.upto(len(self.checksums) * self.block_nbytes)
        return self._bad


def _check_counts(h: TransferHeader, nbytes: int) -> None:
    if not 0 < len(h.transfer_id) <= MAX_TRANSFER_ID:
        raise ValueError(f"transfer_id of {len(h.transfer_id)} characters (1 to {MAX_TRANSFER_ID})")
    if h.num_blocks == 0:
        raise ValueError("no blocks")
    if h.layers is not None and not 0 <= h.layers[0] < h.layers[1] <= h.layout.num_layers:
        raise ValueError(f"layers {list(h.layers)} is no range of the layout's {h.layout.num_layers} layers")
    if h.first_block < 0:
        raise ValueError(f"first_block {h.first_block} < 0")
    if nbytes != h.nbytes:
        raise ValueError(f"nbytes {nbytes} != {h.num_blocks} blocks x {h.block_nbytes} bytes")
    if len(h.block_keys) > h.num_blocks:
        raise ValueError(f"{len(h.block_keys)} block keys for {h.num_blocks} blocks")
    if not 0 < h.num_tokens <= h.num_blocks * h.layout.block_size:
        raise ValueError(f"num_tokens {h.num_tokens} does not fit {h.num_blocks} blocks of "
                         f"{h.layout.block_size}")


def _layers(doc: dict[str, Any]) -> tuple[int, int] | None:
    if "layers" not in doc:
        return None
    value = _typed(doc, "layers", list)
    if len(value) != 2 or not all(isinstance(x, int) and not isinstance(x, bool) for x in value):
        raise TypeError("field 'layers' must be [first, end], two integers")
    return value[0], value[1]


def _seal(doc: dict[str, Any]) -> Seal | None:
    if "seal" not in doc:
        return None
    if doc.get("backend") != "tcp":
        raise ValueError(f"a sealed payload travels on the connection (backend 'tcp'), not {doc.get('backend')!r}")
    return Seal.from_doc(doc["seal"])


def _typed(doc: dict[str, Any], key: str, typ: type[T]) -> T:
    value = doc.get(key)
    if not isinstance(value, typ) or (typ is int and isinstance(value, bool)):
        raise TypeError(f"field {key!r} must be {typ.__name__}, got {type(value).__name__}")
    return value


def _hex64s(items: list[Any]) -> tuple[int, ...]:
    if not all(isinstance(s, str) and len(s) == 16 for s in items):
        raise ValueError("64-bit values must be 16-digit hex strings")
    return tuple(int(s, 16) for s in items)
