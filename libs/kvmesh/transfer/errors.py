"""What a transfer can fail with, besides the ``ConnectionError`` family and ``asyncio.TimeoutError``."""

from __future__ import annotations

import enum


class Refusal(enum.StrEnum):
    """Why a receiver refused a transfer: a small fixed set, the label its metric counts by (the reason's words
    go to the log and back to the sender)."""

    UNSOLICITED = "unsolicited"  # no push was asked for under this transfer id (no capability covers it)
    BAD_TOKEN = "bad_token"      # a token other than the one the receiver issued for it (or none)
    EXPIRED = "expired"          # its capability's deadline passed, or the transfer it was issued for ended
    BLOCKS = "blocks"            # blocks outside the ones granted (or reserved) for it
    TLS = "tls"                  # TLS on one end of the connection only
    VERSION = "version"          # a header version this receiver does not speak
    MALFORMED = "malformed"      # not a kvmesh transfer frame, or a header that does not parse or add up
    BACKEND = "backend"          # a backend the receiver does not serve, or a source it cannot read
    LAYOUT = "layout"            # a layout other than the receiver's
    CHECKSUM = "checksum"        # bytes that do not hash to the header's checksums
    CAPACITY = "capacity"        # it would exceed the receive buffer
    DUPLICATE = "duplicate"      # a transfer id (or blocks and layers) received before
    DISCARDED = "discarded"      # the receiver gave up on it
    CONNECTIONS = "connections"  # a connection over the endpoint's caps (per peer, in all): closed unread
    IDLE = "idle"                # a connection that sent no frame within the idle timeout: closed
    OTHER = "other"              # a sender's view of a reason it does not know


class TransferRejected(Exception):
    """The receiver refused a transfer (no capability, layout or checksum mismatch, over capacity, malformed
    header...). ``reason`` is the receiver's own words, ``kind`` their label; the blocks were never handed to
    anyone as data."""

    def __init__(self, reason: str, kind: Refusal = Refusal.OTHER) -> None:
        super().__init__(reason)
        self.reason = reason
        self.kind = kind
