"""NATS auth callout: a bus user per instance where the instances are not known when nats-server's configuration
is written (Kubernetes Deployments, an autoscaled pool).

``kvmesh.bus.permissions`` lists one nats-server user per mesh identity, so its users must be known in advance:
``kvmesh up`` and compose issue a certificate per instance and list each; a Kubernetes pool whose pods come and go
could only list one user per role, which every replica of the role shares (one prefill could then beat as
another). With auth callout (nats-server 2.10+, NATS ADR-26) nats-server lists one user only, this service's own,
and asks this service about every other connection: nats-server has already verified the client's certificate
against the mesh CA (``tls { verify: true }``) and sends it, in a request it signs, to ``$SYS.REQ.USER.AUTH``; the
service reads the identity in the certificate's URI SAN (``spiffe://kvmesh/<role>/<instance>``,
``kvmesh.identity``), and answers with a user JWT it signs as the configured issuer (an account nkey), whose
permissions are that identity's own, instance by instance: exactly what ``kvmesh.bus.permissions.permissions``
gives a listed user. A certificate whose chain does not end at the mesh CA, that names no mesh identity, or whose
role may do nothing on the bus is refused with a reason nats-server logs.

Keys and files:

- the issuer: an account nkey seed (``keygen`` writes one and prints its public key, which nats-server's
  ``auth_callout { issuer }`` names); only this service holds the seed;
- this service's NATS user: its own mesh certificate (role ``client``, instance ``nats-auth`` by default), listed
  in nats-server's ``users`` and ``auth_callout { auth_users }``; it may only answer callouts.

``python -m kvmesh.bus.permissions CONF --auth-callout ISSUER_PUBLIC_KEY ...`` writes the nats-server side;
``python -m kvmesh.bus.auth_callout serve`` runs this side (a sidecar of nats-server in
``deploy/k8s/components/nats-auth-callout``). Requests and answers are not encrypted with xkeys: the service
talks to nats-server over the mesh's mutual TLS.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import binascii
import hashlib
import json
import logging
import os
import signal
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import nkeys
from cryptography import x509
from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey
from cryptography.hazmat.primitives.serialization import Encoding

from kvmesh.bus.permissions import RESPONSES_S, SNAPSHOT_CHUNKS, permissions
from kvmesh.bus.subjects import Subjects
from kvmesh.identity import Identity

log = logging.getLogger(__name__)

CALLOUT_SUBJECT = "$SYS.REQ.USER.AUTH"
GLOBAL_ACCOUNT = "$G"  # nats-server's account for users of a configuration without accounts
_JWT_HEADER = {"typ": "JWT", "alg": "ed25519-nkey"}
_DER = Encoding.DER


class Refused(Exception):
    """A connection this service will not authorise; the message is what nats-server logs."""


# ---- keys and JWTs -------------------------------------------------------------------------------------------
def new_issuer_seed() -> bytes:
    """A fresh account nkey seed (``SA...``): the key the user JWTs are signed with."""
    return bytes(nkeys.encode_seed(os.urandom(32), nkeys.PREFIX_BYTE_ACCOUNT))


def issuer_from_seed(seed: bytes) -> nkeys.KeyPair:
    """The account key pair of a seed; ValueError unless it is an account seed."""
    try:
        kp = nkeys.from_seed(bytearray(seed.strip()))
    except (nkeys.NkeysError, ValueError, binascii.Error) as e:
        raise ValueError(f"not an nkey seed ({type(e).__name__}); `keygen` writes one") from None
    if not public_key(kp).startswith("A"):
        raise ValueError("the issuer must be an account nkey (its public key starts with A, its seed with SA)")
    return kp


def public_key(kp: nkeys.KeyPair) -> str:
    return bytes(kp.public_key).decode()


def _b64(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode()


def _unb64(text: str) -> bytes:
    return base64.urlsafe_b64decode(text + "=" * (-len(text) % 4))


def _raw_public(nkey: str) -> bytes:
    """The 32-byte ed25519 key of a public nkey (``N...`` a server's, ``A...`` an account's); ValueError when it
    is not one (bad base32, bad checksum)."""
    try:
        raw = base64.b32decode(nkey + "=" * (-len(nkey) % 8))
    except binascii.Error:
        raise ValueError(f"{nkey[:12]}...: not a public nkey") from None
    if len(raw) != 35 or bytes(nkeys.crc16_checksum(raw[:-2])) != raw[-2:]:
        raise ValueError(f"{nkey[:12]}...: not a public nkey (length or checksum)")
    return raw[1:-2]


def encode_jwt(claims: dict[str, Any], issuer: nkeys.KeyPair) -> str:
    """``claims`` as a NATS JWT issued and signed by ``issuer``: ``iss`` and ``iat`` set here, ``jti`` the hash
    of the rest (as nats-io/jwt does)."""
    body = {**claims, "iss": public_key(issuer), "iat": int(time.time())}
    body["jti"] = base64.b32encode(hashlib.sha256(json.dumps(body, sort_keys=True).encode()).digest()).decode() \
        .rstrip("=")
    signing_input = f"{_b64(json.dumps(_JWT_HEADER).encode())}.{_b64(json.dumps(body).encode())}"
    return f"{signing_input}.{_b64(bytes(issuer.sign(signing_input.encode())))}"


def decode_jwt(token: str) -> dict[str, Any]:
    """A NATS JWT's claims, its signature checked against the key its ``iss`` names; ValueError otherwise."""
    try:
        head, body, sig = token.strip().split(".")
        header, claims = json.loads(_unb64(head)), json.loads(_unb64(body))
        signature = _unb64(sig)
    except (ValueError, binascii.Error) as e:
        raise ValueError(f"not a JWT: {e}") from None
    alg = header.get("alg") if isinstance(header, dict) else None
    if not isinstance(claims, dict) or alg != _JWT_HEADER["alg"]:
        raise ValueError(f"not a NATS JWT (alg {alg!r})")
    try:
        Ed25519PublicKey.from_public_bytes(_raw_public(str(claims.get("iss", "")))).verify(
            signature, f"{head}.{body}".encode())
    except InvalidSignature:
        raise ValueError("the JWT's signature does not match its issuer") from None
    return claims


# ---- the decision ----------------------------------------------------------------------------------------------
def identity_of(client_tls: dict[str, Any], ca_der: bytes) -> tuple[Identity, x509.Certificate]:
    """The mesh identity in a verified client chain (``nats.client_tls`` of a request), its leaf's URI SAN, and
    that leaf. The chain must end at the mesh CA (nats-server verified it against its ``ca_file``; a server that
    trusts more CAs than the mesh's still gets no user for them)."""
    chains = client_tls.get("verified_chains") or []
    if not chains:
        raise Refused("no verified client certificate: nats-server must require one (tls { verify: true }) "
                      "signed by the mesh CA")
    for chain in chains:
        try:
            certs = [x509.load_pem_x509_certificate(str(pem).encode()) for pem in chain]
        except ValueError as e:
            raise Refused(f"a certificate of the client's chain does not parse: {e}") from None
        if not certs or certs[-1].public_bytes(_DER) != ca_der:
            continue
        try:
            uris = certs[0].extensions.get_extension_for_class(x509.SubjectAlternativeName).value \
                .get_values_for_type(x509.UniformResourceIdentifier)
        except x509.ExtensionNotFound:
            uris = []
        for uri in uris:
            try:
                return Identity.parse(uri), certs[0]
            except ValueError:
                continue
        raise Refused(f"the certificate {certs[0].subject.rfc4514_string()!r} names no mesh identity "
                      "(spiffe://kvmesh/<role>/<instance> URI SAN)")
    raise Refused("the client's certificate chain does not end at the mesh CA")


@dataclass
class Callout:
    """Answers nats-server's authorization requests (``answer``) for one kvmesh cluster's subjects."""

    issuer: nkeys.KeyPair
    subjects: Subjects
    ca_der: bytes  # the mesh CA certificate, DER
    account: str = GLOBAL_ACCOUNT
    granted: dict[str, int] = field(default_factory=dict)  # by role
    refused: int = 0

    def user_claims(self, identity: Identity, user_nkey: str, expires: int = 0) -> dict[str, Any]:
        """The user JWT's claims for ``identity``: its own permissions (``kvmesh.bus.permissions``), until
        ``expires`` (Unix seconds; 0 = while connected); Refused when its role may do nothing on the bus."""
        perms = permissions(identity, self.subjects)
        if not perms.publish and not perms.subscribe:
            raise Refused(f"{identity.uri}: role {identity.role} has nothing to do on the bus")
        nats: dict[str, Any] = {"pub": {"allow": list(perms.publish)}, "sub": {"allow": list(perms.subscribe)},
                                "subs": -1, "data": -1, "payload": -1, "type": "user", "version": 2}
        if perms.responses:
            nats["resp"] = {"max": SNAPSHOT_CHUNKS, "ttl": RESPONSES_S * 10**9}  # nanoseconds
        claims: dict[str, Any] = {"sub": user_nkey, "aud": self.account, "name": identity.uri, "nats": nats}
        if expires:
            claims["exp"] = expires
        return claims

    def answer(self, request: bytes) -> bytes:
        """The signed authorization response to one request: a user JWT for the certificate's identity, or the
        reason it is refused. A request that is not nats-server's raises ValueError (nothing to answer)."""
        claims = decode_jwt(request.decode(errors="replace"))
        nats = claims.get("nats") or {}
        server, user_nkey = (nats.get("server_id") or {}).get("id", ""), nats.get("user_nkey", "")
        if not server or not user_nkey or claims.get("iss") != server:
            raise ValueError("not an authorization request signed by the nats-server it names")
        response: dict[str, Any] = {"sub": user_nkey, "aud": server,
                                    "nats": {"type": "authorization_response", "version": 2}}
        try:
            identity, leaf = identity_of(nats.get("client_tls") or {}, self.ca_der)
            # the user ends with its certificate: nats-server closes the connection then, and the member
            # reconnects with the certificate that replaced it
            expires = int(leaf.not_valid_after_utc.timestamp())
            response["nats"]["jwt"] = encode_jwt(self.user_claims(identity, user_nkey, expires), self.issuer)
        except Refused as e:
            self.refused += 1
            client = nats.get("client_info") or {}
            log.warning("refused a NATS connection from %s: %s", client.get("host", "?"), e)
            response["nats"]["error"] = str(e)
        else:
            self.granted[identity.role] = self.granted.get(identity.role, 0) + 1
            log.info("authorised %s on the bus", identity.uri)
        return encode_jwt(response, self.issuer).encode()


def load_ca(path: str | Path) -> bytes:
    """The mesh CA certificate (PEM file) as DER: the root every authorised chain must end at."""
    return x509.load_pem_x509_certificate(Path(path).read_bytes()).public_bytes(_DER)


# ---- the service -----------------------------------------------------------------------------------------------
async def serve(callout: Callout, nats_url: str, stop: asyncio.Event, connect_timeout_s: float = 10.0,
                ready_file: Path | None = None) -> None:
    """Answer ``$SYS.REQ.USER.AUTH`` on ``nats_url`` as this process's mesh identity (``KVMESH_TLS_*``) until
    ``stop`` is set. ``ready_file`` exists while the service is subscribed (a probe's: until then nats-server can
    authorise no member, so its pod should take no connection)."""
    from kvmesh import tls
    from kvmesh.bus.bus import Bus

    bus = await Bus.connect(nats_url, "nats-auth", tls=tls.bus_tls(), connect_timeout_s=connect_timeout_s)

    async def on_request(msg: Any) -> None:
        try:
            reply = callout.answer(msg.data)
        except ValueError as e:
            log.warning("ignored a message on %s: %s", CALLOUT_SUBJECT, e)
            return
        await msg.respond(reply)

    await bus.nc.subscribe(CALLOUT_SUBJECT, cb=on_request)
    await bus.nc.flush()
    log.info("answering NATS auth callouts on %s as issuer %s", nats_url, public_key(callout.issuer))
    if ready_file:
        ready_file.write_text(f"{os.getpid()}\n")
    try:
        await stop.wait()
    finally:
        if ready_file:
            ready_file.unlink(missing_ok=True)
        await bus.close()


def parser() -> argparse.ArgumentParser:
    """``python -m kvmesh.bus.auth_callout keygen SEED_FILE`` | ``serve ...``."""
    parser = argparse.ArgumentParser(prog="python -m kvmesh.bus.auth_callout", description=__doc__.split("\n")[0])
    commands = parser.add_subparsers(dest="command", required=True)
    keygen = commands.add_parser("keygen", help="write a new issuer seed; print its public key")
    keygen.add_argument("seed", type=Path, help="where to write the seed (mode 0600)")
    run = commands.add_parser("serve", help="answer nats-server's authorization requests")
    run.add_argument("--nats", default=os.environ.get("KVMESH_NATS_URL", "nats://127.0.0.1:4222"),
                     help="nats-server to answer (KVMESH_NATS_URL)")
    run.add_argument("--issuer-seed", type=Path, required=True, help="the issuer's seed file (`keygen` writes it)")
    run.add_argument("--cluster", default=os.environ.get("KVMESH_CLUSTER", "default"),
                     help="the kvmesh cluster whose subjects users get (KVMESH_CLUSTER)")
    run.add_argument("--ready-file", type=Path, help="a file that exists while the service answers (for probes)")
    return parser


def main(argv: list[str] | None = None) -> None:
    """``python -m kvmesh.bus.auth_callout keygen SEED_FILE`` | ``serve``: see the module."""
    cli = parser()
    args = cli.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if args.command == "keygen":
        seed = new_issuer_seed()
        args.seed.touch(mode=0o600)
        args.seed.write_bytes(seed + b"\n")
        print(public_key(issuer_from_seed(seed)))
        return
    from kvmesh import tls

    cfg = tls.settings()
    if not (cfg.tls_ca and cfg.tls_cert):
        cli.error("serve needs this service's mesh certificate (KVMESH_TLS_CERT, KVMESH_TLS_KEY, KVMESH_TLS_CA)")
    callout = Callout(issuer_from_seed(args.issuer_seed.read_bytes()), Subjects(args.cluster), load_ca(cfg.tls_ca))
    stop = asyncio.Event()

    async def run_until_signal() -> None:
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
        await serve(callout, args.nats, stop, ready_file=args.ready_file)

    asyncio.run(run_until_signal())


if __name__ == "__main__":
    main()
