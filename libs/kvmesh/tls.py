"""Optional TLS for every gRPC hop (client → router → cachesvc / prefill / decode, engines → the pool) and every
KV transfer connection (prefill → decode, cachesvc ↔ engines).

One TLS setting set per process, the ``[shared]`` section's ``KVMESH_TLS_CERT`` / ``KVMESH_TLS_KEY`` /
``KVMESH_TLS_CA``: with a certificate and key, servers listen with TLS; with a CA, clients verify servers against
it, and servers also require client certificates it signed (mutual TLS: only holders of a mesh certificate get in).
Unset, gRPC and transfers are plaintext, as on a single host where everything binds 127.0.0.1.

Transfers use the same files through ``ssl`` (TLS 1.3): :func:`transfer_server_context` for a
``TransferServer``, :func:`transfer_client_tls` for a ``TransferClient``; so does the NATS connection
(:func:`bus_tls`), whose certificate nats-server maps to the holder's own NATS user (``kvmesh.bus.permissions``).
"""

from __future__ import annotations

import functools
import ssl
from collections.abc import Sequence
from pathlib import Path

import grpc

from kvmesh.bus.bus import BusTLS
from kvmesh.bus.permissions import inbox_prefix
from kvmesh.identity import SPIFFE_PREFIX, Identity
from kvmesh.settings import SharedSettings, load
from kvmesh.transfer.conn import ClientTLS

Options = Sequence[tuple[str, object]]
_configured: SharedSettings | None = None


def configure(shared: SharedSettings) -> None:
    """This process's TLS: an entry point hands over the ``[shared]`` section it loaded (``KVMESH_TLS_*``)."""
    global _configured
    _configured = shared


def settings() -> SharedSettings:
    """This process's TLS settings: what its entry point configured, else (a client program, a test) the
    ``KVMESH_TLS_*`` of the environment, read once."""
    return _configured or _from_env()


@functools.cache
def _from_env() -> SharedSettings:
    return load([], check_env=False).shared


def _read(path: str) -> bytes | None:
    return Path(path).read_bytes() if path else None


def server_credentials(cfg: SharedSettings | None = None) -> grpc.ServerCredentials | None:
    cfg = cfg or settings()
    if not cfg.tls_server:
        return None
    ca = _read(cfg.tls_ca)
    return grpc.ssl_server_credentials([(_read(cfg.tls_key), _read(cfg.tls_cert))], root_certificates=ca,
                                       require_client_auth=ca is not None)


def mutual(cfg: SharedSettings | None = None) -> bool:
    """Whether this process's servers require mesh certificates (a certificate and a CA): then every call is
    authorised by the caller's role (``kvmesh.authz``)."""
    cfg = cfg or settings()
    return cfg.tls_server and cfg.tls_client


def public_server_credentials(cert: str, key: str, client_ca: str = "") -> grpc.ServerCredentials | None:
    """The router's client-facing port: its own certificate, and client certificates from its own client CA
    when one is set (never the mesh CA). None: plaintext."""
    if not cert:
        return None
    ca = _read(client_ca)
    return grpc.ssl_server_credentials([(_read(key), _read(cert))], root_certificates=ca,
                                       require_client_auth=ca is not None)


def public_ssl_context(cert: str, key: str) -> ssl.SSLContext | None:
    """HTTPS on the router's client-facing HTTP port (None: plain HTTP)."""
    if not cert:
        return None
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    context.load_cert_chain(cert, key)
    return context


MESH = object()  # add_port's default credentials: this process's mesh certificate


def add_port(server: grpc.Server | grpc.aio.Server, address: str, cfg: SharedSettings | None = None,
             credentials: object = MESH) -> int:
    """Bind ``address`` on ``server``, with TLS when this process has a certificate (or with ``credentials``:
    None = plaintext). Returns the port (0: failed)."""
    creds = server_credentials(cfg) if credentials is MESH else credentials
    assert creds is None or isinstance(creds, grpc.ServerCredentials)
    try:
        return server.add_secure_port(address, creds) if creds else server.add_insecure_port(address)
    except RuntimeError:  # newer grpcio raises "Failed to bind to address ..." instead of returning 0
        return 0


def channel_credentials(cfg: SharedSettings | None = None) -> grpc.ChannelCredentials | None:
    cfg = cfg or settings()
    if not cfg.tls_client:
        return None
    return grpc.ssl_channel_credentials(root_certificates=_read(cfg.tls_ca), private_key=_read(cfg.tls_key),
                                        certificate_chain=_read(cfg.tls_cert))


def _options(options: Options, cfg: SharedSettings) -> list[tuple[str, object]]:
    out = list(options)
    if cfg.tls_client and cfg.tls_server_name:
        out.append(("grpc.ssl_target_name_override", cfg.tls_server_name))
    return out


def aio_channel(address: str, options: Options = (), cfg: SharedSettings | None = None) -> grpc.aio.Channel:
    """An asyncio channel to another kvmesh service, TLS when this process has a CA."""
    cfg = cfg or settings()
    creds = channel_credentials(cfg)
    opts = _options(options, cfg)
    return grpc.aio.secure_channel(address, creds, opts) if creds else grpc.aio.insecure_channel(address, opts)


def channel(address: str, options: Options = (), cfg: SharedSettings | None = None) -> grpc.Channel:
    """A blocking channel to another kvmesh service, TLS when this process has a CA."""
    cfg = cfg or settings()
    creds = channel_credentials(cfg)
    opts = _options(options, cfg)
    return grpc.secure_channel(address, creds, opts) if creds else grpc.insecure_channel(address, opts)


def transfer_server_context(cfg: SharedSettings | None = None) -> ssl.SSLContext | None:
    """The server side of TLS on transfer connections: this process's certificate, and with a CA, client
    certificates it signed required (as gRPC's). None: plaintext."""
    cfg = cfg or settings()
    if not cfg.tls_server:
        return None
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.minimum_version = ssl.TLSVersion.TLSv1_3
    context.num_tickets = 0  # no resumption: connections are pooled and long-lived
    context.load_cert_chain(cfg.tls_cert, cfg.tls_key)
    if cfg.tls_ca:
        context.load_verify_locations(cfg.tls_ca)
        context.verify_mode = ssl.CERT_REQUIRED
    return context


def transfer_client_tls(cfg: SharedSettings | None = None) -> ClientTLS | None:
    """The client side of TLS on transfer connections: servers verified against the CA (their certificate
    naming ``tls_server_name``, else the host dialled), this process's certificate presented. None: plaintext."""
    cfg = cfg or settings()
    if not cfg.tls_client:
        return None
    context = ssl.create_default_context(cafile=cfg.tls_ca)
    context.minimum_version = ssl.TLSVersion.TLSv1_3
    if cfg.tls_cert:
        context.load_cert_chain(cfg.tls_cert, cfg.tls_key)
    return ClientTLS(context, cfg.tls_server_name)


def identity_of(cert_path: str) -> Identity | None:
    """The mesh identity a PEM certificate names (its ``spiffe://kvmesh/...`` URI SAN); None: it names none."""
    from cryptography import x509  # only where a certificate is read

    cert = x509.load_pem_x509_certificate(Path(cert_path).read_bytes())
    try:
        sans = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    except x509.ExtensionNotFound:
        return None
    uris = [u for u in sans.get_values_for_type(x509.UniformResourceIdentifier) if u.startswith(SPIFFE_PREFIX)]
    try:
        return Identity.parse(uris[0]) if uris else None
    except ValueError:
        return None


def bus_tls(cfg: SharedSettings | None = None) -> BusTLS | None:
    """The NATS connection's TLS: the server verified against the CA, this process's certificate presented and,
    when it names a mesh identity, replies on that identity's own inbox. None: no CA, plaintext."""
    cfg = cfg or settings()
    if not cfg.tls_client:
        return None
    context = ssl.create_default_context(cafile=cfg.tls_ca)
    context.minimum_version = ssl.TLSVersion.TLSv1_2
    who = None
    if cfg.tls_cert:
        context.load_cert_chain(cfg.tls_cert, cfg.tls_key)
        who = identity_of(cfg.tls_cert)
    return BusTLS(context, cfg.tls_server_name, inbox_prefix(who) if who else "")
