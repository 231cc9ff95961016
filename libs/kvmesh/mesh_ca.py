"""A mesh CA and the per-service certificates it signs, for ``kvmesh up`` (into the state directory) and
compose's init step (``python -m kvmesh.mesh_ca /certs router/router cachesvc/cachesvc ...``).

EC P-256 keys (milliseconds each). Each certificate names its holder's identity (``kvmesh.identity``: the URI SAN
``spiffe://kvmesh/<role>/<instance>``) and, for servers, ``localhost``, ``127.0.0.1`` and :data:`MESH_SERVER_NAME`;
clients of a generated mesh expect that name (``tls_server_name``), so an instance may advertise any address.
Files already in the folder are reused (the CA always; a certificate while it names the same identity and has a
month left), so a restarted stack keeps its CA. Production brings its own (cert-manager, SPIRE: docs/deploy.md).
"""

from __future__ import annotations

import datetime
import ipaddress
import os
import sys
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from kvmesh.identity import Identity

MESH_SERVER_NAME = "kvmesh.mesh"
CA_DAYS = 3650
LEAF_DAYS = 365
RENEW_BEFORE = datetime.timedelta(days=30)


@dataclass(frozen=True)
class CertFiles:
    """One holder's PEM files: its certificate, its key, the mesh CA."""

    cert: Path
    key: Path
    ca: Path

    def env(self) -> dict[str, str]:
        """The ``[shared]`` variables that make a process present these (and expect the mesh's server name)."""
        return {"KVMESH_TLS_CERT": str(self.cert), "KVMESH_TLS_KEY": str(self.key), "KVMESH_TLS_CA": str(self.ca),
                "KVMESH_TLS_SERVER_NAME": MESH_SERVER_NAME}


def _now() -> datetime.datetime:
    return datetime.datetime.now(datetime.UTC)


def _write_key(path: Path, key: ec.EllipticCurvePrivateKey) -> None:
    data = key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                             serialization.NoEncryption())
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(data)


class MeshCA:
    def __init__(self, directory: Path, key: ec.EllipticCurvePrivateKey, cert: x509.Certificate) -> None:
        self.dir, self.key, self.cert = directory, key, cert

    @property
    def ca_path(self) -> Path:
        return self.dir / "ca.pem"

    @classmethod
    def open(cls, directory: str | Path) -> MeshCA:
        """The CA in ``directory`` (``ca.pem`` / ``ca.key``), made there first if it is not."""
        d = Path(directory)
        d.mkdir(parents=True, exist_ok=True)
        cert_path, key_path = d / "ca.pem", d / "ca.key"
        if cert_path.is_file() and key_path.is_file():
            key = serialization.load_pem_private_key(key_path.read_bytes(), None)
            assert isinstance(key, ec.EllipticCurvePrivateKey), f"{key_path} is not an EC key"
            return cls(d, key, x509.load_pem_x509_certificate(cert_path.read_bytes()))
        key = ec.generate_private_key(ec.SECP256R1())
        name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "kvmesh mesh CA")])
        cert = (x509.CertificateBuilder().subject_name(name).issuer_name(name).public_key(key.public_key())
                .serial_number(x509.random_serial_number()).not_valid_before(_now() - datetime.timedelta(minutes=5))
                .not_valid_after(_now() + datetime.timedelta(days=CA_DAYS))
                .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
                .add_extension(x509.KeyUsage(False, False, False, False, False, True, True, False, False),
                               critical=True)
                .sign(key, hashes.SHA256()))
        _write_key(key_path, key)
        cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
        return cls(d, key, cert)

    def issue(self, identity: Identity, hosts: tuple[str, ...] = ()) -> CertFiles:
        """The certificate of ``identity`` (server and client use), reused when one for it is already here."""
        stem = f"{identity.role}-{identity.instance}"
        files = CertFiles(self.dir / f"{stem}.pem", self.dir / f"{stem}.key", self.ca_path)
        if self._reusable(files, identity):
            return files
        key = ec.generate_private_key(ec.SECP256R1())
        names: list[x509.GeneralName] = [x509.UniformResourceIdentifier(identity.uri),
                                         x509.DNSName(MESH_SERVER_NAME), x509.DNSName("localhost"),
                                         x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]
        for host in hosts:
            try:
                names.append(x509.IPAddress(ipaddress.ip_address(host)))
            except ValueError:
                names.append(x509.DNSName(host))
        cert = (x509.CertificateBuilder()
                .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, str(identity))]))
                .issuer_name(self.cert.subject).public_key(key.public_key())
                .serial_number(x509.random_serial_number()).not_valid_before(_now() - datetime.timedelta(minutes=5))
                .not_valid_after(_now() + datetime.timedelta(days=LEAF_DAYS))
                .add_extension(x509.SubjectAlternativeName(names), critical=False)
                .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
                .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH,
                                                      ExtendedKeyUsageOID.CLIENT_AUTH]), critical=False)
                .sign(self.key, hashes.SHA256()))
        _write_key(files.key, key)
        files.cert.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
        return files

    def _reusable(self, files: CertFiles, identity: Identity) -> bool:
        if not (files.cert.is_file() and files.key.is_file()):
            return False
        cert = x509.load_pem_x509_certificate(files.cert.read_bytes())
        uris = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value.get_values_for_type(
            x509.UniformResourceIdentifier)
        return (cert.issuer == self.cert.subject and uris == [identity.uri]
                and cert.not_valid_after_utc - _now() > RENEW_BEFORE)


def main(argv: list[str] | None = None) -> None:
    """``python -m kvmesh.mesh_ca DIR ROLE/INSTANCE[=HOST,HOST] ...``: the CA and one certificate per holder."""
    args = sys.argv[1:] if argv is None else argv
    if len(args) < 2:
        sys.exit("usage: python -m kvmesh.mesh_ca DIR ROLE/INSTANCE[=HOST,...] ... "
                 "(e.g. /certs router/router cachesvc/cachesvc=cachesvc)")
    ca = MeshCA.open(args[0])
    for spec in args[1:]:
        name, _, hosts = spec.partition("=")
        files = ca.issue(Identity.parse(f"spiffe://kvmesh/{name}"), tuple(filter(None, hosts.split(","))))
        print(f"{name}: {files.cert}")


if __name__ == "__main__":
    main()
