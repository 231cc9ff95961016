"""``kvmesh.bus.auth_callout``'s decision and its JWTs, against requests built here the way nats-server builds them
(the service against a real nats-server: tests/integration/test_bus_permissions.py, ``callout``)."""

from __future__ import annotations

import os
from pathlib import Path

import nkeys
import pytest
from kvmesh.bus import auth_callout as ac
from kvmesh.bus import permissions
from kvmesh.bus.subjects import Subjects
from kvmesh.identity import Identity, MeshRole
from kvmesh.mesh_ca import MeshCA

SUBJECTS = Subjects("unit")


@pytest.fixture(scope="module")
def ca(tmp_path_factory: pytest.TempPathFactory) -> MeshCA:
    return MeshCA.open(tmp_path_factory.mktemp("callout") / "tls")


@pytest.fixture(scope="module")
def callout(ca: MeshCA) -> ac.Callout:
    return ac.Callout(ac.issuer_from_seed(ac.new_issuer_seed()), SUBJECTS, ac.load_ca(ca.ca_path))


SERVER = nkeys.from_seed(bytearray(nkeys.encode_seed(os.urandom(32), nkeys.PREFIX_BYTE_SERVER)))
USER = bytes(nkeys.from_seed(bytearray(nkeys.encode_seed(os.urandom(32), nkeys.PREFIX_BYTE_USER))).public_key).decode()


def chain(ca: MeshCA, who: Identity) -> list[str]:
    files = ca.issue(who)
    return [files.cert.read_text(), Path(files.ca).read_text()]


def request(client_tls: dict, server: nkeys.KeyPair = SERVER, user: str = USER) -> bytes:
    """An authorization request as nats-server signs it (NATS ADR-26)."""
    server_id = ac.public_key(server)
    claims = {"sub": "issuer", "aud": "nats-authorization-request",
              "nats": {"server_id": {"id": server_id, "name": "n0"}, "user_nkey": user, "client_tls": client_tls,
                       "client_info": {"host": "10.1.2.3"}, "type": "authorization_request", "version": 2}}
    return ac.encode_jwt(claims, server).encode()


def test_a_jwt_decodes_to_its_claims_and_a_changed_byte_fails_its_signature():
    issuer = ac.issuer_from_seed(ac.new_issuer_seed())
    token = ac.encode_jwt({"sub": "x", "nats": {"a": 1}}, issuer)
    claims = ac.decode_jwt(token)
    assert claims["iss"] == ac.public_key(issuer) and claims["nats"] == {"a": 1} and claims["jti"]
    head, body, sig = token.split(".")
    forged = ac._b64(ac._unb64(body).replace(b'"a": 1', b'"a": 2'))
    with pytest.raises(ValueError, match="signature"):
        ac.decode_jwt(f"{head}.{forged}.{sig}")
    with pytest.raises(ValueError, match="not a JWT"):
        ac.decode_jwt("garbage")
    with pytest.raises(ValueError, match="not a NATS JWT"):  # a header that is not an object
        ac.decode_jwt(f"{ac._b64(b'[1]')}.{body}.{sig}")


def test_only_an_account_seed_is_an_issuer():
    with pytest.raises(ValueError, match="account nkey"):
        ac.issuer_from_seed(bytes(nkeys.encode_seed(os.urandom(32), nkeys.PREFIX_BYTE_USER)))
    with pytest.raises(ValueError, match="not an nkey seed"):
        ac.issuer_from_seed(b"SAnotaseed")


@pytest.mark.parametrize("who", [Identity(MeshRole.PREFILL, "prefill-7d9f-abc"), Identity(MeshRole.DECODE, "d-1"),
                                 Identity(MeshRole.BOTH, "b-2"), Identity(MeshRole.ROUTER, "router-x"),
                                 Identity(MeshRole.CACHESVC, "cachesvc-1"), Identity(MeshRole.ADMIN, "planner")],
                         ids=lambda w: w.role)
def test_each_identity_gets_the_user_a_listed_identity_would_have(ca, callout, who):
    response = ac.decode_jwt(callout.answer(request({"verified_chains": [chain(ca, who)]})).decode())
    assert response["aud"] == ac.public_key(SERVER) and response["sub"] == USER
    assert response["iss"] == ac.public_key(callout.issuer) and "error" not in response["nats"]
    user = ac.decode_jwt(response["nats"]["jwt"])
    assert (user["sub"], user["aud"], user["name"], user["iss"]) == (USER, "$G", who.uri, response["iss"])
    from cryptography import x509

    leaf = x509.load_pem_x509_certificate(chain(ca, who)[0].encode())
    assert user["exp"] == int(leaf.not_valid_after_utc.timestamp())  # the user ends with its certificate
    listed = permissions.user(who, SUBJECTS)["permissions"]
    assert user["nats"]["pub"] == listed["publish"] and user["nats"]["sub"] == listed["subscribe"]
    assert ("resp" in user["nats"]) == ("allow_responses" in listed)
    assert user["nats"]["type"] == "user" and user["nats"]["version"] == 2


def refusal(callout: ac.Callout, client_tls: dict) -> str:
    response = ac.decode_jwt(callout.answer(request(client_tls)).decode())
    assert "jwt" not in response["nats"]
    return response["nats"]["error"]


def test_a_certificate_that_gives_nothing_on_the_bus_is_refused_with_the_reason(ca, callout, tmp_path):
    before = callout.refused
    assert "no verified client certificate" in refusal(callout, {})
    assert "no verified client certificate" in refusal(callout, {"certs": chain(ca, Identity(MeshRole.DECODE, "d"))})
    other = MeshCA.open(tmp_path / "other")
    assert "does not end at the mesh CA" in refusal(callout, {"verified_chains": [
        chain(other, Identity(MeshRole.DECODE, "d"))]})
    assert "nothing to do on the bus" in refusal(callout, {"verified_chains": [
        chain(ca, Identity(MeshRole.CLIENT, "healthcheck"))]})
    assert "does not parse" in refusal(callout, {"verified_chains": [["-----BEGIN CERTIFICATE-----\nxx\n"]]})
    assert callout.refused == before + 5


def test_a_message_that_is_not_a_servers_signed_request_gets_no_answer(ca, callout):
    good = {"verified_chains": [chain(ca, Identity(MeshRole.DECODE, "d"))]}
    impostor = nkeys.from_seed(bytearray(nkeys.encode_seed(os.urandom(32), nkeys.PREFIX_BYTE_SERVER)))
    token = request(good).decode()
    head, _, sig = token.split(".")
    other_body = request(good, server=impostor).decode().split(".")[1]
    with pytest.raises(ValueError):
        callout.answer(f"{head}.{other_body}.{sig}".encode())  # another server's claims under this one's signature
    with pytest.raises(ValueError, match="not an authorization request"):
        callout.answer(request(good, user=""))
    with pytest.raises(ValueError):
        callout.answer(b"hello")


def test_the_nats_server_configuration_lists_the_callout_service_alone(tmp_path):
    conf = permissions.write_config(tmp_path / "nats.conf", [], SUBJECTS, "c", "k", "ca", auth_callout="AISSUER")
    import json

    config = json.loads(conf.read_text())
    users = config["authorization"]["users"]
    assert [u["user"] for u in users] == [permissions.CALLOUT_IDENTITY.uri]
    assert users[0]["permissions"]["subscribe"]["allow"][0] == ac.CALLOUT_SUBJECT
    assert users[0]["permissions"]["publish"] == {"deny": [">"]}
    assert config["authorization"]["auth_callout"] == {"issuer": "AISSUER",
                                                       "auth_users": [permissions.CALLOUT_IDENTITY.uri]}
    assert config["tls"]["verify_and_map"] is True
