"""Random ids the router makes per request: request ids (128 bits, 32 hex digits) and dispatch nonces (64 bits),
cut from ``os.urandom`` drawn 4 KiB at a time. One system call per id released the GIL once or twice a request,
and with the tokenizer threads busy the event loop then waited up to the interpreter's switch interval (5 ms) to
get it back."""

from __future__ import annotations

import os
import threading


class RandomHex:
    """Hex digits from ``os.urandom``, ``BATCH`` bytes at a time; no digit is ever handed out twice."""

    BATCH = 4096

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._hex, self._at = "", 0

    def __call__(self, digits: int = 32) -> str:
        with self._lock:
            if self._at + digits > len(self._hex):
                self._hex, self._at = os.urandom(self.BATCH).hex(), 0
            at = self._at
            self._at += digits
            return self._hex[at:at + digits]


_random_hex = RandomHex()


def random_hex(digits: int) -> str:
    """``digits`` random hex digits (4 bits each)."""
    return _random_hex(digits)


def new_request_id() -> str:
    """128 random bits as 32 hex digits."""
    return _random_hex(32)


def nonce() -> str:
    """64 random bits as 16 hex digits."""
    return _random_hex(16)
