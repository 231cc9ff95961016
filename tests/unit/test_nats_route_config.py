"""The routes block kvmesh.bus.permissions writes for a NATS cluster: by certificate only (``--route-tls``), or by
identity too (``--route-identity`` with ``--route-listen``: nats-server's ``--cluster`` flag would clear the route
user, so the listen address must be in the file), with the routes and the cluster's name there too; and a cluster
node's file of its own (``--include``: the one-node file, then the cluster block), as components/nats-cluster ships
it. ``tests/netns/test_nats_route_tls.py`` runs them live."""

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


ROUTES = ["nats://nats-0.nats-headless:6222", "nats://nats-1.nats-headless:6222", "nats://nats-2.nats-headless:6222"]


def test_the_routes_and_the_cluster_name_can_be_in_the_file_in_place_of_flags(tmp_path: Path) -> None:
    block = cluster_block(permissions.write_config(tmp_path / "a.conf", OP, Subjects("c"), "c", "k", "ca",
                                                   route_identity=NATS, route_listen="0.0.0.0:6222",
                                                   routes=ROUTES, cluster_name="kvmesh"))
    assert (block["name"], block["listen"], block["routes"]) == ("kvmesh", "0.0.0.0:6222", ROUTES)
    assert block["authorization"] == {"user": "spiffe://kvmesh/client/nats"} and block["tls"]["verify_and_map"]
    assert "cluster" not in json.loads(permissions.write_config(tmp_path / "b.conf", OP, Subjects("c"), "c", "k",
                                                                 "ca").read_text())


def test_a_cluster_nodes_file_includes_the_one_node_file_then_routes_by_identity(tmp_path: Path) -> None:
    """What components/nats-cluster ships: the one-node nats.conf of components/tls (or nats-auth-callout) by a
    relative include, then the whole cluster by identity, so the node needs no --cluster, --routes or
    --cluster_name flag."""
    path = permissions.write_cluster_config(tmp_path / "cluster.conf", "../nats/nats.conf", "c", "k", "ca", NATS,
                                            "0.0.0.0:6222", ROUTES, "kvmesh")
    lines = [line for line in path.read_text().splitlines() if line and not line.startswith("#")]
    assert lines[0] == 'include "../nats/nats.conf"' and lines[1] == "cluster: {"
    assert json.loads("\n".join(lines[1:]).removeprefix("cluster: ")) == {
        "name": "kvmesh", "listen": "0.0.0.0:6222", "routes": ROUTES,
        "tls": {"cert_file": "c", "key_file": "k", "ca_file": "ca", "verify_and_map": True},
        "authorization": {"user": "spiffe://kvmesh/client/nats"}}
    with pytest.raises(ValueError, match="relative to the including file"):
        permissions.write_cluster_config(tmp_path / "x.conf", "/etc/nats.conf", "c", "k", "ca", NATS, "0.0.0.0:6222")


def test_the_command_writes_a_cluster_nodes_file_with_include_and_refuses_users_there(tmp_path: Path) -> None:
    common = ["--cert", "c", "--key", "k", "--ca", "ca", "--include", "../nats/nats.conf"]
    route = ["--route-identity", "client/nats", "--route-listen", "0.0.0.0:6222"]
    permissions.main([str(tmp_path / "cli.conf"), *common, *route, "--routes", ",".join(ROUTES),
                      "--cluster-name", "kvmesh"])
    expected = permissions.write_cluster_config(tmp_path / "fn.conf", "../nats/nats.conf", "c", "k", "ca", NATS,
                                                "0.0.0.0:6222", ROUTES, "kvmesh")
    assert (tmp_path / "cli.conf").read_text() == expected.read_text()
    for wrong in (["admin/op", *route], ["--any-instance", *route], ["--route-tls", *route], []):
        with pytest.raises(SystemExit):
            permissions.main([str(tmp_path / "bad.conf"), *common, *wrong])
    assert not (tmp_path / "bad.conf").exists()
