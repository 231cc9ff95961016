"""The block layout descriptor: what a block's bytes mean, and its one codec (protocol ⇄ object ⇄ JSON dict).

Every stored or transferred block carries (or references) its layout; a reader whose layout differs in any
field refuses the block. Equal byte counts prove nothing, so :func:`layout_mismatch` compares every field.
The storage dtype is a *name* with an item size here; which torch dtype a name stands for is the engine's
business (``kvmesh.engine.kv_cache.storage_dtype``).
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, fields, replace
from functools import cached_property, lru_cache
from typing import Any

from kvmesh.proto.v1 import common_pb2

DTYPE_ITEMSIZE: dict[str, int] = {"fp32": 4, "bf16": 2, "fp16": 2, "fp8": 1}  # fp8: e4m3
LAYER_MAJOR = "layer-major"  # [layer, k|v, token, head, dim] per block


def dtype_itemsize(name: str) -> int:
    """Bytes per element of a storage dtype; ValueError naming the choices for an unknown one."""
    try:
        return DTYPE_ITEMSIZE[name]
    except KeyError:
        raise ValueError(f"unknown KV dtype {name!r}; choose one of {sorted(DTYPE_ITEMSIZE)}") from None


@dataclass(frozen=True)
class KVLayout:
    """What a block's bytes mean. Two parties exchange blocks only when their layouts are equal."""

    model_fingerprint: str
    num_layers: int
    num_kv_heads: int
    head_dim: int
    block_size: int
    dtype: str = "fp32"
    layout: str = LAYER_MAJOR
    tp_rank: int = 0
    tp_size: int = 1

    @property
    def block_shape(self) -> tuple[int, ...]:
        return (self.num_layers, 2, self.block_size, self.num_kv_heads, self.head_dim)

    @property
    def itemsize(self) -> int:
        return dtype_itemsize(self.dtype)

    @cached_property
    def block_nbytes(self) -> int:
        n = self.itemsize
        for d in self.block_shape:
            n *= d
        return n

    def layers_nbytes(self, layers: tuple[int, int] | None = None) -> int:
        """Bytes of one block's slice of ``layers`` (``(first, end)``; None: all of them, ``block_nbytes``):
        a part pushed layer group by layer group holds such slices, block after block."""
        if layers is None:
            return self.block_nbytes
        return self.block_nbytes // self.num_layers * (layers[1] - layers[0])

    def check(self) -> KVLayout:
        """Itself when it can describe blocks, else a ValueError naming the bad field."""
        for name in ("model_fingerprint", "dtype", "layout"):
            if not getattr(self, name):
                raise ValueError(f"layout.{name} is required")
        for name in ("num_layers", "num_kv_heads", "head_dim", "block_size", "tp_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"layout.{name} must be >= 1, got {getattr(self, name)}")
        if not 0 <= self.tp_rank < self.tp_size:
            raise ValueError(f"layout.tp_rank must be in [0, tp_size={self.tp_size}), got {self.tp_rank}")
        dtype_itemsize(self.dtype)
        return self

    # -- the codec ---------------------------------------------------------------------------------------------

    def to_dict(self) -> dict[str, Any]:
        """Every field by name: the JSON form in transfer headers, ``kv.ready`` messages and pool manifests (a dict
        of its own each call; the fields are read once per layout: ``asdict`` cost ~20 us of every push)."""
        return dict(_items(self))

    def to_json(self) -> bytes:
        """Canonical JSON (sorted keys, no spaces): equal layouts give equal bytes, so it can name a layout."""
        return _json(self)

    @classmethod
    def from_dict(cls, doc: Any) -> KVLayout:
        """A layout from its JSON form, checked: exactly the known fields, each of its type, sane values.
        TypeError or ValueError says what is wrong."""
        if not isinstance(doc, dict):
            raise TypeError(f"a layout must be a JSON object, got {type(doc).__name__}")
        if not all(isinstance(v, (int, str)) and not isinstance(v, bool) for v in doc.values()):
            raise TypeError("layout fields must be integers and strings")
        return _checked(tuple(sorted(doc.items())))

    @classmethod
    def from_json(cls, raw: bytes | str) -> KVLayout:
        return cls.from_dict(json.loads(raw))

    def to_proto(self) -> common_pb2.BlockLayout:
        return common_pb2.BlockLayout(**self.to_dict())

    @classmethod
    def from_proto(cls, msg: common_pb2.BlockLayout) -> KVLayout:
        """A layout from its protocol message, unchecked: the reader calls :meth:`check` (or compares it with
        its own layout), so that it can say which request field was bad."""
        return cls(**{f.name: getattr(msg, f.name) for f in fields(cls)})


_FIELD_TYPES: dict[str, type] = {f.name: int if f.type in ("int", int) else str for f in fields(KVLayout)}


@lru_cache(maxsize=64)
def _items(layout: KVLayout) -> tuple[tuple[str, Any], ...]:
    return tuple(asdict(layout).items())


@lru_cache(maxsize=64)
def _json(layout: KVLayout) -> bytes:
    return json.dumps(asdict(layout), sort_keys=True, separators=(",", ":")).encode()


@lru_cache(maxsize=64)
def _checked(items: tuple[tuple[str, Any], ...]) -> KVLayout:
    """The layout named by ``items`` after checking names, types and values (memoised: every header of a
    connection, every record of a disk segment names the same few)."""
    doc = dict(items)
    if set(doc) != set(_FIELD_TYPES):
        raise ValueError(f"layout fields {sorted(doc)} != {sorted(_FIELD_TYPES)}")
    for name, value in doc.items():
        want = _FIELD_TYPES[name]
        if not isinstance(value, want) or isinstance(value, bool):
            raise TypeError(f"layout field {name!r} must be {want.__name__}")
    return KVLayout(**doc).check()


def converter(src: KVLayout, dst: KVLayout) -> str | None:
    """The explicit converter that re-lays blocks of ``src`` out as ``dst``: ``""`` when they are equal (none is
    needed), ``"cast A->B"`` when they differ in the storage dtype alone (a float cast of every element), None when
    no converter exists (another model, block size, head count, layout or TP shard: the bytes mean something
    else)."""
    if src == dst:
        return ""
    if replace(src, dtype=dst.dtype) == dst and src.dtype in DTYPE_ITEMSIZE and dst.dtype in DTYPE_ITEMSIZE:
        return f"cast {src.dtype}->{dst.dtype}"
    return None


def layout_mismatch(expected: KVLayout, got: KVLayout) -> str | None:
    """Every field that differs, as ``name got!=expected``; None when equal. Byte counts are not compared:
    they prove nothing."""
    diffs = [f"{f.name} {getattr(got, f.name)!r}!={getattr(expected, f.name)!r}"
             for f in fields(KVLayout) if getattr(got, f.name) != getattr(expected, f.name)]
    return ", ".join(diffs) or None
