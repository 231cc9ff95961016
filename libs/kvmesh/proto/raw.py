"""Protobuf's wire format written by hand, where building the message first would copy bytes: a length-delimited
field (a ``bytes`` field, or one entry of a repeated message) is its tag, its length as a varint, then its bytes,
and a reader takes the fields of a message in any order."""

from __future__ import annotations


def varint(n: int) -> bytes:
    """``n`` (>= 0) as a protobuf varint."""
    out = bytearray()
    while n > 0x7F:
        out.append(n & 0x7F | 0x80)
        n >>= 7
    out.append(n)
    return bytes(out)


def delimited_head(field: int, size: int) -> bytes:
    """What precedes a length-delimited field number ``field`` of ``size`` bytes."""
    return varint(field << 3 | 2) + varint(size)
