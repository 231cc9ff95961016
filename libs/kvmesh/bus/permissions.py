"""Who may publish and subscribe what on NATS: one nats-server user per mesh identity, limited to its own subjects.

nats-server maps a client's verified mesh certificate to a user (``tls { verify_and_map: true }``): the user whose
name is the certificate's URI SAN, ``spiffe://kvmesh/<role>/<instance>`` (``kvmesh.identity``). So the identity on
the bus is the one kvmesh already issues for gRPC and transfers: no password to hand out, and a process cannot
claim a user it holds no key for. A certificate that names no user, or no certificate, is refused at connect.

What each role may do (``permissions``; ``<i>`` is the holder's own instance; subjects under ``kvmesh.<cluster>.``):

- prefill: publishes ``heartbeat.prefill.<i>``, ``kv.events.<i>``, ``kv.quarantine`` (the canary's divergences) and
  ``kv.ready.*`` (to any decode); subscribes
  ``kv.snapshot.<i>``, ``kv.copies.<i>``, ``sessions`` and ``cache.shard.*`` (the shards' beats);
- decode: publishes ``heartbeat.decode.<i>``, ``kv.events.<i>`` and ``kv.quarantine``; subscribes what prefill does and
  ``kv.ready.<i>``, its own only;
- both: what prefill and decode may;
- router: publishes ``router.load.*`` (under its router id, which is not its certificate's instance),
  ``sessions``, ``router.sessions`` (where each session's request went, for the other replicas) and ``kv.ready.*``
  (a failed prefill: decode computes the prompt itself); subscribes ``heartbeat.>``, ``router.load.*``,
  ``kv.events.>`` and ``pool.events`` (hit attribution: where blocks went), ``sessions`` and ``router.sessions``
  (the other replicas' pauses, ends and placements), ``cache.shard.*`` (the shards' beats);
- cachesvc: publishes ``kv.snapshot.*`` (requests), ``kv.copies.*``, ``pool.events`` (what its tiers stored and
  removed), ``cache.shard.*`` (its beat, as its shard) and its durable consumer's API and acks;
  subscribes ``heartbeat.>``, ``sessions`` and ``kv.quarantine`` (it stops serving those blocks);
- admin (an operator's tool): subscribes ``heartbeat.>`` and ``router.load.*``, publishes nothing;
- client: nothing.

Where every replica of a role holds its role's one certificate (compose's ``mesh-certs`` step, Kubernetes' Secret
``kvmesh-tls-<role>``), its user speaks for any instance of its role (``any_instance``): ``<i>`` above is ``*``, so a
role still cannot beat as another role or read another role's subjects, but one replica can beat as another of its
role (receivers drop a message whose sender differs from its subject's, ``kvmesh.bus.bus.from_its_sender``).

Every user subscribes to its own inbox only, ``_INBOX.<role>.<instance>.>`` (``inbox_prefix``: ``kvmesh.tls``
connects with it), so no one reads another's replies. Engines answer snapshot requests on the asker's inbox through
``allow_responses`` (only requests they received), and may look up and create the KV events stream but not change
it; cachesvc also updates it. Subjects are exact for the cluster given (``kvmesh.<cluster>.``).
"""

from __future__ import annotations

import argparse
import json
import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

from kvmesh.bus.subjects import Subjects
from kvmesh.contracts.ids import subject_token
from kvmesh.identity import SPIFFE_PREFIX, Identity, MeshRole

SNAPSHOT_CHUNKS = 10_000  # answers one snapshot request may take (a chunk fills the server's max payload)
RESPONSES_S = 60  # how long a request's reply subject stays open to the one who received it
CALLOUT_IDENTITY = Identity(MeshRole.CLIENT, "nats-auth")  # the auth callout service's own (kvmesh.bus.auth_callout)


@dataclass(frozen=True)
class Permissions:
    publish: tuple[str, ...] = ()
    subscribe: tuple[str, ...] = ()
    responses: bool = False  # may answer requests it received, on their reply subjects


def inbox_prefix(identity: Identity) -> str:
    """The inbox a holder of ``identity`` connects with, the only one it may subscribe to."""
    return f"_INBOX.{identity.role}.{identity.instance}"


def permissions(identity: Identity, subjects: Subjects, any_instance: bool = False) -> Permissions:
    """What the holder of ``identity`` may do; ``any_instance``: the role's certificate, held by every replica."""
    role, p = identity.role, subjects.prefix
    i = "*" if any_instance else subject_token(identity.instance, "instance")
    inbox = f"{inbox_prefix(identity)}.>"
    stream = subjects.events_stream
    find_stream = (f"$JS.API.STREAM.INFO.{stream}", f"$JS.API.STREAM.CREATE.{stream}")
    if role.is_engine:
        publish = [f"{p}heartbeat.{role}.{i}", f"{p}kv.events.{i}", subjects.kv_quarantine, *find_stream]
        subscribe = [f"{p}kv.snapshot.{i}", f"{p}kv.copies.{i}", subjects.sessions, subjects.cachesvc_shards_all,
                     inbox]
        if role in (MeshRole.PREFILL, MeshRole.BOTH):
            publish.append(f"{p}kv.ready.*")
        if role in (MeshRole.DECODE, MeshRole.BOTH):
            subscribe.append(f"{p}kv.ready.{i}")
        return Permissions(tuple(publish), tuple(subscribe), responses=True)
    if role == MeshRole.ROUTER:
        # a router's load goes out under its router id (KVMESH_ROUTER_ID, by default host and pid), not its
        # certificate's instance; receivers still match each load to the id its subject names
        return Permissions((subjects.router_load_all, subjects.sessions, subjects.router_sessions, f"{p}kv.ready.*"),
                           (subjects.heartbeats_all, subjects.router_load_all, subjects.kv_events_all,
                            subjects.pool_events, subjects.sessions, subjects.router_sessions,
                            subjects.cachesvc_shards_all, inbox))
    if role == MeshRole.CACHESVC:
        consumer = "$JS.API.CONSUMER"  # CREATE / INFO / DELETE.<stream>.<durable>, DURABLE.CREATE / MSG.NEXT
        return Permissions((f"{p}kv.snapshot.*", f"{p}kv.copies.*", subjects.pool_events,
                            subjects.cachesvc_shards_all, *find_stream,
                            f"$JS.API.STREAM.UPDATE.{stream}",
                            f"{consumer}.*.{stream}", f"{consumer}.*.{stream}.>", f"{consumer}.*.*.{stream}.>",
                            f"$JS.ACK.{stream}.>"),
                           (subjects.heartbeats_all, subjects.sessions, subjects.kv_quarantine, inbox))
    if role == MeshRole.ADMIN:
        return Permissions((), (subjects.heartbeats_all, subjects.router_load_all, inbox))
    return Permissions()


def user(identity: Identity, subjects: Subjects, any_instance: bool = False) -> dict[str, object]:
    """One nats-server user: named by the identity's URI (what ``verify_and_map`` matches), its permissions."""
    perms = permissions(identity, subjects, any_instance)
    out: dict[str, object] = {"publish": {"allow": list(perms.publish)},
                              "subscribe": {"allow": list(perms.subscribe)}}
    if perms.responses:
        out["allow_responses"] = {"max": SNAPSHOT_CHUNKS, "expires": f"{RESPONSES_S}s"}
    return {"user": identity.uri, "permissions": out}


def callout_user(identity: Identity) -> dict[str, object]:
    """The auth callout service's own user (``kvmesh.bus.auth_callout``): it may only answer the server's
    authorization requests."""
    return {"user": identity.uri,
            "permissions": {"publish": {"deny": [">"]},
                            "subscribe": {"allow": ["$SYS.REQ.USER.AUTH", f"{inbox_prefix(identity)}.>"]},
                            "allow_responses": {"max": 1, "expires": "10s"}}}


def write_config(path: Path, identities: Iterable[Identity], subjects: Subjects, cert: str, key: str, ca: str,
                 any_instance: bool = False, settings: str = "", auth_callout: str = "",
                 callout_identity: Identity | None = None, route_tls: bool = False,
                 route_identity: Identity | None = None, route_listen: str = "", routes: Sequence[str] = (),
                 cluster_name: str = "") -> Path:
    """A nats-server configuration: mutual TLS with the mesh CA, each certificate mapped to its user, one user per
    identity (``any_instance``: each speaks for every replica of its role). Without ``settings`` it is JSON (valid
    nats-server configuration) and listen address, JetStream and store come as flags; ``settings`` (configuration
    text: listen, JetStream, max_payload, with no ``tls`` or ``authorization`` of its own) is written first.

    ``auth_callout`` (the issuer's public account nkey): every certificate not listed in ``identities`` is
    authorised by the auth callout service holding ``callout_identity`` (``kvmesh.bus.auth_callout``), which gives
    each identity its own instance's permissions; ``identities`` may then be empty.

    ``route_tls``: the routes between the servers of a NATS cluster are mutual TLS with the mesh CA too (a server
    without a certificate the mesh CA signed cannot join), by certificate only: any mesh certificate passes the
    route handshake, so a NetworkPolicy must keep non-NATS pods off the route port. Where and to whom a server
    routes are then its flags (``--cluster``, ``--routes``) or ``routes`` below; a lone server ignores the block.

    ``route_identity`` (with ``route_listen``, the ``host:port`` routes are accepted on): routes by identity too,
    every server's route certificate must name ``route_identity`` in its URI SAN (``verify_and_map`` against the
    cluster's one user), so a certificate the mesh CA gave anything else is refused. The listen address is in the
    file because nats-server's ``--cluster`` flag clears the cluster's user (its ``overrideCluster``: a flag URL
    without a user and password resets both), which refuses every route: start such a server without
    ``--cluster``. ``routes`` (the servers' route URLs, ``nats://host:port``; its own may be among them: a server
    skips itself) and ``cluster_name`` put the rest of the cluster in the file too, in place of ``--routes`` and
    ``--cluster_name``. A lone server with a route listen address does not start JetStream ("JetStream cluster
    requires configured routes"): keep one-node and cluster configurations apart (``write_cluster_config``)."""
    users = [user(who, subjects, any_instance) for who in identities]
    authorization: dict[str, object] = {"users": users}
    if auth_callout:
        caller = callout_identity or CALLOUT_IDENTITY
        users.append(callout_user(caller))
        authorization["auth_callout"] = {"issuer": auth_callout, "auth_users": [caller.uri]}
    config: dict[str, object] = {"tls": {"cert_file": cert, "key_file": key, "ca_file": ca, "verify_and_map": True},
                                 "authorization": authorization}
    cluster = cluster_block(cert, key, ca, route_tls, route_identity, route_listen, routes, cluster_name)
    if cluster:
        config["cluster"] = cluster
    if not settings:
        path.write_text(_variables(json.dumps(config, indent=2), auth_callout) + "\n")
        return path
    blocks = "".join(f"{name}: {json.dumps(value, indent=2)}\n" for name, value in config.items())
    path.write_text(f"{settings.rstrip()}\n\n# written by kvmesh.bus.permissions\n{_variables(blocks, auth_callout)}")
    return path


def cluster_block(cert: str, key: str, ca: str, route_tls: bool = False, route_identity: Identity | None = None,
                  route_listen: str = "", routes: Sequence[str] = (), cluster_name: str = "") -> dict[str, object]:
    """nats-server's ``cluster`` block (``write_config``'s arguments of the same names), empty where there is none."""
    block: dict[str, object] = {}
    if cluster_name:
        block["name"] = cluster_name
    if route_identity is not None:
        if not route_listen:
            raise ValueError("routes by identity need route_listen: nats-server's --cluster flag clears the user")
        block["listen"] = route_listen
    if routes:
        block["routes"] = list(routes)
    if route_identity is not None:
        block["tls"] = {"cert_file": cert, "key_file": key, "ca_file": ca, "verify_and_map": True}
        block["authorization"] = {"user": route_identity.uri}
    elif route_tls:
        block["tls"] = {"cert_file": cert, "key_file": key, "ca_file": ca, "verify": True}
    return block


def write_cluster_config(path: Path, include: str, cert: str, key: str, ca: str, route_identity: Identity,
                         route_listen: str, routes: Sequence[str] = (), cluster_name: str = "") -> Path:
    """A NATS cluster node's configuration: the one-node configuration ``include`` (one ``write_config`` wrote:
    listen, JetStream, client TLS and users; a path relative to this file's directory, as nats-server resolves
    it), then the cluster, routes by identity (``write_config``'s ``route_identity``), with where the node accepts
    routes, the routes it dials and the cluster's name. Its ``cluster`` block replaces any the included file has.
    Start the node with this file and without ``--cluster``, ``--routes`` or ``--cluster_name``: the one-node file
    stays as it is for a lone server (which a route listen address would keep from starting JetStream)."""
    if not include or Path(include).is_absolute():
        raise ValueError(f"include {include!r}: nats-server reads an include relative to the including file")
    block = cluster_block(cert, key, ca, route_identity=route_identity, route_listen=route_listen, routes=routes,
                          cluster_name=cluster_name)
    path.write_text(f"# written by kvmesh.bus.permissions: a NATS cluster node's configuration, {include} then "
                    f"routes by identity\ninclude {json.dumps(include)}\n\ncluster: {json.dumps(block, indent=2)}\n")
    return path


def _variables(text: str, issuer: str) -> str:
    """An issuer given as ``$NAME`` is nats-server's reference to its environment variable: written unquoted (a
    deployment whose issuer key is made at install time, not when this file is)."""
    if re.fullmatch(r"\$[A-Za-z_][A-Za-z0-9_]*", issuer):
        return text.replace(json.dumps(issuer), issuer)
    return text


def main(argv: list[str] | None = None) -> None:
    """``python -m kvmesh.bus.permissions CONF --cert C --key K --ca CA ROLE/INSTANCE ...``: a nats-server
    configuration with a user per mesh identity (compose's ``mesh-certs`` step; deploy/k8s/components/tls), and
    with ``--auth-callout ISSUER`` the others authorised by ``kvmesh.bus.auth_callout``. With ``--include FILE``
    a NATS cluster node's: FILE, and routes by identity (deploy/k8s/components/nats-cluster)."""
    parser = argparse.ArgumentParser(prog="python -m kvmesh.bus.permissions", description=main.__doc__)
    parser.add_argument("conf", type=Path, help="the configuration to write")
    parser.add_argument("identities", nargs="*", metavar="ROLE/INSTANCE", help="one NATS user each")
    parser.add_argument("--cluster", default="default", help="the cluster whose subjects the users may use")
    for name, what in (("cert", "certificate"), ("key", "key"), ("ca", "the mesh CA")):
        parser.add_argument(f"--{name}", required=True, help=f"nats-server's {what}, as a path where it runs")
    parser.add_argument("--settings", type=Path, help="nats-server configuration to start from (listen, JetStream)")
    parser.add_argument("--any-instance", action="store_true",
                        help="every replica of a role holds its role's one certificate")
    parser.add_argument("--auth-callout", metavar="ISSUER", default="",
                        help="authorise every other certificate through the auth callout service "
                             "(kvmesh.bus.auth_callout) whose issuer has this public account nkey")
    parser.add_argument("--callout-identity", metavar="ROLE/INSTANCE", default=str(CALLOUT_IDENTITY),
                        help="the auth callout service's certificate (with --auth-callout)")
    parser.add_argument("--route-tls", action="store_true",
                        help="a NATS cluster's routes over mutual TLS with the mesh CA (the server's certificate)")
    parser.add_argument("--route-identity", metavar="ROLE/INSTANCE", default="",
                        help="routes by identity too: only certificates naming this one (every server's) join; "
                             "needs --route-listen, and the servers started without --cluster")
    parser.add_argument("--route-listen", metavar="HOST:PORT", default="",
                        help="where the server accepts routes (with --route-identity)")
    parser.add_argument("--routes", metavar="URL,...", default="",
                        help="the cluster's servers' route URLs (nats://host:port, its own may be one), in the file "
                             "in place of nats-server's --routes")
    parser.add_argument("--cluster-name", metavar="NAME", default="",
                        help="the NATS cluster's name (nats-server's --cluster_name; not --cluster, the kvmesh "
                             "cluster whose subjects the users may use)")
    parser.add_argument("--include", metavar="FILE", default="",
                        help="write a cluster node's file: FILE (a one-node configuration this command wrote, "
                             "relative to CONF's directory where nats-server runs) and the cluster block, routes "
                             "by identity; needs --route-identity, takes no users")
    args = parser.parse_intermixed_args(argv)  # identities may follow the options
    if args.route_identity and not args.route_listen:
        parser.error("--route-identity needs --route-listen (nats-server's --cluster flag clears the route user)")
    route_identity = Identity.parse(f"{SPIFFE_PREFIX}{args.route_identity}") if args.route_identity else None
    routes = [r.strip() for r in args.routes.split(",") if r.strip()]
    if args.include:
        if args.identities or args.auth_callout or args.settings or args.any_instance or args.route_tls:
            parser.error("--include writes the cluster block only: users, client TLS and settings are the included "
                         "file's")
        if route_identity is None:
            parser.error("--include needs --route-identity (a cluster node's file is for routes by identity)")
        write_cluster_config(args.conf, args.include, args.cert, args.key, args.ca, route_identity,
                             args.route_listen, routes, args.cluster_name)
        print(f"{args.conf}: {args.include}, and routes by identity as {route_identity.uri}")
        return
    if not args.identities and not args.auth_callout:
        parser.error("name at least one ROLE/INSTANCE, or --auth-callout")
    who = [Identity.parse(f"{SPIFFE_PREFIX}{name}") for name in args.identities]
    caller = Identity.parse(f"{SPIFFE_PREFIX}{args.callout_identity}")
    write_config(args.conf, who, Subjects(args.cluster), args.cert, args.key, args.ca, args.any_instance,
                 args.settings.read_text() if args.settings else "", args.auth_callout, caller, args.route_tls,
                 route_identity, args.route_listen, routes, args.cluster_name)
    print(f"{args.conf}: {len(who)} NATS users" + (f", the others by auth callout as {caller.uri}"
                                                     if args.auth_callout else ""))


if __name__ == "__main__":
    main()
