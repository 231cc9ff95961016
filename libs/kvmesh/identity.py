"""Mesh identity: who a peer is, read from its certificate.

Every mesh certificate names one role and one instance in a URI subject alternative name,
``spiffe://kvmesh/<role>/<instance>`` (a SPIFFE ID). A URI SAN rather than the CN or OU because: the CA's
signature covers it like any SAN; gRPC hands the verified one to servers as ``peer_spiffe_id`` (no PEM parsing
per call); it carries both names without free-text conventions; and cert-manager (``spec.uris``) and SPIRE issue
exactly this form, so bring-your-own certificates need nothing kvmesh-specific (docs/deploy.md).
"""

from __future__ import annotations

import enum
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

SPIFFE_PREFIX = "spiffe://kvmesh/"


class MeshRole(enum.StrEnum):
    """What a certificate lets its holder do inside the mesh (``kvmesh.authz`` has the table)."""

    ROUTER = "router"
    PREFILL = "prefill"
    DECODE = "decode"
    BOTH = "both"
    CACHESVC = "cachesvc"
    CLIENT = "client"   # a program holding a mesh certificate but no service role: health checks only
    ADMIN = "admin"     # an operator's tool: everything a router may do, plus reflection

    @property
    def is_engine(self) -> bool:
        return self in (MeshRole.PREFILL, MeshRole.DECODE, MeshRole.BOTH)


ROLES = frozenset(r.value for r in MeshRole)


@dataclass(frozen=True)
class Identity:
    role: MeshRole
    instance: str

    @property
    def uri(self) -> str:
        return f"{SPIFFE_PREFIX}{self.role}/{self.instance}"

    def __str__(self) -> str:
        return f"{self.role}/{self.instance}"

    @classmethod
    def parse(cls, uri: str) -> Identity:
        """``spiffe://kvmesh/<role>/<instance>``; ValueError saying what a mesh identity looks like."""
        role, _, instance = uri.removeprefix(SPIFFE_PREFIX).partition("/")
        if not uri.startswith(SPIFFE_PREFIX) or not instance or "/" in instance or role not in ROLES:
            raise ValueError(f"{uri!r} is not a kvmesh identity: the certificate needs the URI SAN "
                             f"{SPIFFE_PREFIX}<role>/<instance>, role one of {sorted(ROLES)}")
        return cls(MeshRole(role), instance)


def of_peer(auth_context: Mapping[str, Iterable[bytes]]) -> Identity | None:
    """The identity a gRPC peer's verified certificate names (``context.auth_context()``); None when the
    connection is not TLS or the certificate names none (ValueError: it names something else)."""
    uris = [u.decode() for u in auth_context.get("peer_uri", ()) if u.startswith(SPIFFE_PREFIX.encode())]
    if not uris:
        return None
    return Identity.parse(uris[0])
