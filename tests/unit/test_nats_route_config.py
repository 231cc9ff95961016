"""The routes block kvmesh.bus.permissions writes for a NATS cluster: by certificate only (``--route-tls``), or by
identity too (``--route-identity`` with ``--route-listen``: nats-server's ``--cluster`` flag would clear the route
user, so the listen address must be in the file). ``tests/netns/test_nats_route_tls.py`` runs both live."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from kvmesh.bus import permissions
from kvmesh.bus.subjects import Subjects
from kvmesh.identity import Identity, MeshRole

NATS = Identity(MeshRole.CLIENT, "nats")
OP = [Identity(MeshRole.ADMIN, "op")]


def cluster_block(path: Path) -> dict:
    return json.loads(path.read_text())["cluster"]


def test_routes_by_certificate_verify_the_mesh_ca_only(tmp_path: Path) -> None:
    block = cluster_block(permissions.write_config(tmp_path / "a.conf", OP, Subjects("c"), "c", "k", "ca",
                                                   route_tls=True))
    assert block == {"tls": {"cert_file": "c", "key_file": "k", "ca_file": "ca", "verify": True}}


def test_routes_by_identity_map_every_route_certificate_to_the_one_cluster_user(tmp_path: Path) -> None:
    block = cluster_block(permissions.write_config(tmp_path / "a.conf", OP, Subjects("c"), "c", "k", "ca",
                                                   route_identity=NATS, route_listen="0.0.0.0:6222"))
    assert block == {"listen": "0.0.0.0:6222",
                     "tls": {"cert_file": "c", "key_file": "k", "ca_file": "ca", "verify_and_map": True},
                     "authorization": {"user": "spiffe://kvmesh/client/nats"}}


def test_routes_by_identity_without_a_listen_address_are_refused_saying_why(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="--cluster flag clears the user"):
        permissions.write_config(tmp_path / "a.conf", OP, Subjects("c"), "c", "k", "ca", route_identity=NATS)
    with pytest.raises(SystemExit):
        permissions.main([str(tmp_path / "b.conf"), "admin/op", "--cert", "c", "--key", "k", "--ca", "ca",
                          "--route-identity", "client/nats"])
    permissions.main([str(tmp_path / "c.conf"), "admin/op", "--cert", "c", "--key", "k", "--ca", "ca",
                      "--route-identity", "client/nats", "--route-listen", "0.0.0.0:6222"])
    assert cluster_block(tmp_path / "c.conf")["authorization"] == {"user": "spiffe://kvmesh/client/nats"}
