"""Distinct types for distinct identifiers, so a block key is never passed where a request id belongs.

``Role`` and ``TransferBackend`` are ``StrEnum``s: they compare equal to, format as and serialise to the same
strings that configuration files, environment variables and JSON messages carry.
"""

from __future__ import annotations

import enum
import re
from typing import NewType

BlockKey = NewType("BlockKey", int)
"""Hash of one full block *and its whole prefix* inside a namespace (an unsigned 64-bit integer)."""

NamespaceSeed = NewType("NamespaceSeed", int)
"""``key_{-1}``: what must be equal for two requests to share any block."""

RequestId = NewType("RequestId", str)
"""One client request, end to end (router, prefill, decode, traces)."""

InstanceId = NewType("InstanceId", str)
"""One engine instance (or the cache service) in the cluster: the last token of its bus subjects."""

_SUBJECT_TOKEN = re.compile(r"[^\s.*>]+")  # one NATS subject token: no dots, wildcards or whitespace
_CLUSTER = re.compile(r"[A-Za-z0-9_-]+")    # also part of a JetStream stream name, so stricter


def subject_token(value: str, what: str) -> str:
    """``value`` if it is usable as one bus subject token (an instance id, a role), else a ValueError that
    names ``what``."""
    if not isinstance(value, str) or not _SUBJECT_TOKEN.fullmatch(value):
        raise ValueError(f"{what} {value!r} is not a valid NATS subject token: "
                         "it must be non-empty, without '.', '*', '>' or whitespace")
    return value


def cluster_name(value: str) -> str:
    """``value`` if it can name a cluster (the second token of its subjects, part of its stream's name), else
    a ValueError saying what may be in it."""
    if not isinstance(value, str) or not _CLUSTER.fullmatch(value):
        raise ValueError(f"cluster name {value!r} is invalid: use only letters, digits, '_' and '-'")
    return value

TransferId = NewType("TransferId", str)
"""One push of blocks from a sender to a transfer server."""


def handoff_transfer_id(request_id: str, prefill_instance: str) -> TransferId:
    """The transfer id of a request's KV hand-off from ``prefill_instance``; its parts add ``#<n>``."""
    return TransferId(f"{request_id}@{prefill_instance}")


def handoff_prefix(request_id: str) -> str:
    """What every hand-off transfer id of ``request_id`` starts with, whichever prefill sent it."""
    return f"{request_id}@"


def part_transfer_id(transfer_id: str, part: int) -> TransferId:
    """Part ``part`` of a hand-off pushed in parts (one per prefill chunk)."""
    return TransferId(f"{transfer_id}#{part}")


PUSH_TOKEN_METADATA = "x-kvmesh-push-token"
HELD_BLOCKS_METADATA = "x-kvmesh-held-blocks"  # beside it: the prompt's leading blocks decode holds, exactly
"""The gRPC initial-metadata key under which decode hands the router a hand-off's push capability (the router
passes it on to prefill in ``PrefillRequest.push_token``)."""
TRANSFER_VERSIONS_METADATA = "x-kvmesh-transfer-versions"
"""Beside it: the transfer header versions decode's endpoint reads, ``"<low>-<high>"`` (passed on verbatim in
``PrefillRequest.push_versions``; ``kvmesh.transfer.header`` reads it)."""


class Role(enum.StrEnum):
    """What an instance does: its heartbeat says so, and the router routes by it."""

    PREFILL = "prefill"
    DECODE = "decode"
    BOTH = "both"          # one process that prefills and decodes (no PD hop)
    CACHESVC = "cachesvc"

    @property
    def is_engine(self) -> bool:
        return self is not Role.CACHESVC

    @classmethod
    def engines(cls) -> tuple[Role, ...]:
        return tuple(r for r in cls if r.is_engine)


class TransferBackend(enum.StrEnum):
    """How a pushed payload's bytes travel (the control connection is always TCP)."""

    TCP = "tcp"            # inline after the header
    SHM = "shm"            # a shared-memory segment, same host only
    MOONCAKE = "mooncake"  # Mooncake Transfer Engine, one-sided read


class EngineBackend(enum.StrEnum):
    """Which engine an instance hosts behind the seam (``kvmesh.engines``)."""

    NATIVE = "native"      # kvmesh's own (kvmesh.engine)
    VLLM = "vllm"          # vLLM's async engine in process (the kvmesh[vllm] extra)


def choices(enum_type: type[enum.StrEnum]) -> tuple[str, ...]:
    """The values of an enum, e.g. for an error message or an argparse ``choices``."""
    return tuple(m.value for m in enum_type)
