"""A real stack for end-to-end tests: nats-server, cachesvc, engine processes and the router, on loopback."""

from __future__ import annotations

import pytest

from app.launcher import Stack, StackOptions


def start_stack(tmp_path_factory, name: str, **kw) -> Stack:
    opts = StackOptions.local(name, **kw)
    stack = Stack(tmp_path_factory.mktemp(name), opts)
    stack.start(timeout_s=240)
    return stack


@pytest.fixture(scope="session")
def mesh(tmp_path_factory):
    """1 prefill + 1 decode, the real default model."""
    stack = start_stack(tmp_path_factory, "e2e")
    yield stack
    stack.stop()
