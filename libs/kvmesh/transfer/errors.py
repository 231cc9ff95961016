"""What a transfer can fail with, besides the ``ConnectionError`` family and ``asyncio.TimeoutError``."""

from __future__ import annotations


class TransferRejected(Exception):
    """The receiver refused a transfer (layout or checksum mismatch, over capacity, malformed header...).
    ``reason`` is the receiver's own words; the blocks were never handed to anyone as data."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason
