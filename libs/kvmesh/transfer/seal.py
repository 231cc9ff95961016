"""A sealed payload: a ``tcp`` push's bytes under TLS, encrypted and authenticated outside the TLS records.

Under TLS the payload went through Python's memory BIOs: the ciphertext copied into the incoming BIO, a ``bytes``
object per read, decrypted 16 KiB record by record, then copied again. Those copies, not the cipher, held a TLS push
to about half its plain-text GB/s. From header version 3 (:mod:`kvmesh.transfer.header`) a sender on a TLS
connection seals the payload instead: the header (TLS-protected, like the reply) carries a fresh 256-bit key for
this push alone and the chunk size; the payload follows on the same socket, outside TLS, as chunks of AES-256-GCM
(``chunk`` plaintext bytes each, the last one shorter, each followed by its 16-byte tag), sealed with
``cryptography``'s AESGCM straight from the sender's buffer and opened straight into the receiver's.

What it guarantees, and why:

- Confidentiality and integrity as TLS's: the key is only ever inside the TLS connection (mutually authenticated
  with mesh certificates), AES-256-GCM is TLS 1.3's own cipher, a chunk that fails its tag is never taken.
- Nonces never repeat under a key: a key seals one push (made with ``os.urandom`` per push), and a chunk's nonce
  is its index.
- No reordering, truncation or splicing: the index is in each chunk's nonce and, with a flag for the last chunk,
  in its associated data; the chunk count follows from the payload size in the header; chunks of another push do
  not open under this push's key.
- Replayed pushes fail as replayed TLS records would: a replayed payload without its header has no key, and the
  header cannot be replayed into another TLS connection.

Framing rules both ends keep: the sender flushes the header's TLS records before the first sealed byte; the receiver
reads TLS record by record until the header is complete (:class:`~kvmesh.transfer.conn.TlsConn`), so no sealed byte
ever enters the TLS layer; the reply is TLS again.
"""

from __future__ import annotations

import base64
import binascii
import os
import struct
from dataclasses import dataclass, field
from typing import Any

from cryptography.hazmat.primitives.ciphers.aead import AESGCM

AEAD = "AES-256-GCM"
KEY_BYTES = 32
TAG = 16                 # bytes after each sealed chunk
CHUNK = 256 << 10        # what this build seals per chunk at most ...
SPLIT = 4                # ... and at least in this many chunks, down to
SMALLEST = 64 << 10      # this size (a payload's first chunk is sealed before a byte is sent, its last opened
                         # after every byte arrived: small chunks overlap sender and receiver on one payload)
MIN_CHUNK = 16 << 10     # what a receiver accepts (bounds its per-chunk overhead ...)
MAX_CHUNK = 4 << 20      # (... and the staging memory it keeps per connection)
_NONCE = struct.Struct(">4xQ")  # 12 bytes: the chunk's index
_AAD = struct.Struct(">8sQ?")   # a label, the chunk's index, whether it is the last
_LABEL = b"kvmt-sl1"


@dataclass(frozen=True)
class Seal:
    """How one push's payload is sealed: its key (never printed) and chunk size."""

    key: bytes = field(repr=False)
    chunk: int = CHUNK

    @classmethod
    def new(cls, nbytes: int) -> Seal:
        """A seal for one push of ``nbytes``: a fresh random key, and chunks of a power of two from ``SMALLEST``
        to ``CHUNK``, ``SPLIT`` or more of them where that size allows."""
        chunk = 1 << max(0, (nbytes // SPLIT).bit_length() - 1)
        return cls(os.urandom(KEY_BYTES), max(SMALLEST, min(CHUNK, chunk)))

    def chunks(self, nbytes: int) -> int:
        """How many chunks a payload of ``nbytes`` is sealed in."""
        return -(-nbytes // self.chunk)

    def sealed_nbytes(self, nbytes: int) -> int:
        """Bytes a payload of ``nbytes`` takes on the wire, tags included."""
        return nbytes + TAG * self.chunks(nbytes)

    def aead(self) -> AESGCM:
        return AESGCM(self.key)

    @staticmethod
    def nonce(index: int) -> bytes:
        return _NONCE.pack(index)

    @staticmethod
    def aad(index: int, last: bool) -> bytes:
        return _AAD.pack(_LABEL, index, last)

    def to_doc(self) -> dict[str, Any]:
        return {"aead": AEAD, "key": base64.b64encode(self.key).decode(), "chunk": self.chunk}

    @classmethod
    def from_doc(cls, doc: object) -> Seal:
        """The seal a header names; TypeError / ValueError saying what is wrong."""
        if not isinstance(doc, dict):
            raise TypeError("field 'seal' must be an object")
        if doc.get("aead") != AEAD:
            raise ValueError(f"seal.aead {doc.get('aead')!r} is not {AEAD!r}, the one this receiver opens")
        chunk, key = doc.get("chunk"), doc.get("key")
        if type(chunk) is not int or not MIN_CHUNK <= chunk <= MAX_CHUNK:
            raise ValueError(f"seal.chunk {chunk!r} is not a byte count from {MIN_CHUNK} to {MAX_CHUNK}")
        try:
            raw = base64.b64decode(key, validate=True) if isinstance(key, str) else b""
        except binascii.Error:
            raw = b""
        if len(raw) != KEY_BYTES:
            raise ValueError(f"seal.key must be {KEY_BYTES} bytes in base64")
        return cls(raw, chunk)
