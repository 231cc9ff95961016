"""A test double of the next build's transfer header (version N+1), made from the real codec: it speaks this
build's versions and one more, and that one carries a field more (``sent_ns``: when the sender wrote it), which
a receiver of N+1 records and one of N never sees. ``Recording`` is this build's codec, noting each header it
reads, so a test can tell what arrived on the wire."""

from __future__ import annotations

import time
from typing import Any

from kvmesh.transfer.header import SPOKEN, HeaderCodec, TransferHeader, Versions

NEXT = SPOKEN.high + 1


class Recording(HeaderCodec):
    """This build's codec; ``read`` holds each header read as ``(version, its fields)``."""

    def __init__(self) -> None:
        self.read: list[tuple[int, dict[str, Any]]] = []

    def from_doc(self, doc: dict[str, Any], version: int) -> TransferHeader:
        self.read.append((version, doc))
        return super().from_doc(doc, version)


class NextCodec(Recording):
    """Version N+1: ``speaks`` one more, whose header adds ``sent_ns``; ``sent`` holds each one read."""

    speaks = Versions(SPOKEN.low, NEXT)

    def __init__(self) -> None:
        super().__init__()
        self.sent: list[int] = []

    def to_doc(self, header: TransferHeader, version: int) -> dict[str, Any]:
        doc = super().to_doc(header, version)
        return doc | {"sent_ns": time.time_ns()} if version >= NEXT else doc

    def from_doc(self, doc: dict[str, Any], version: int) -> TransferHeader:
        if version >= NEXT:
            sent = doc.get("sent_ns")
            if not isinstance(sent, int):
                raise TypeError(f"field 'sent_ns' must be int in version {NEXT}")
            self.sent.append(sent)
        return super().from_doc(doc, version)
