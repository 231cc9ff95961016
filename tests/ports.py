"""Ports for tests, without picking a "free" port to bind later (another process can take it in between).

Servers under test bind port 0 and report what they bound (``kvmesh.ready``). A test that needs an address where
nothing answers, or a port that is taken, binds a socket itself and keeps it for as long as it needs it."""

from __future__ import annotations

import socket
from collections.abc import Iterator
from contextlib import contextmanager


@contextmanager
def refusing_port(host: str = "127.0.0.1") -> Iterator[int]:
    """A port that refuses connections while the block runs: bound here (no one else can take it), never
    listening."""
    with socket.socket() as s:
        s.bind((host, 0))
        yield s.getsockname()[1]


@contextmanager
def taken_port(host: str = "127.0.0.1") -> Iterator[int]:
    """A port in use while the block runs: bound and listening here, to test that a server given it fails."""
    with socket.create_server((host, 0)) as s:
        yield s.getsockname()[1]


def guess_free_port(host: str = "127.0.0.1") -> int:
    """Only for an external program that cannot bind port 0 and report what it bound (mooncake_master, whose
    ``-rpc_port=0`` means 50051; the compose stack on the host network): a port free a moment ago, which another
    process can take before the program binds it. Callers must detect that bind failure and retry with another
    guess."""
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]
