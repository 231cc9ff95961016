"""Container entrypoint: fills in what only the running container knows, checks the settings, then execs the
service command (so the service is PID 1 and gets the signals).

- ``<NAME>_FILE`` for ``KVMESH_*`` variables: ``<NAME>`` is read from that file (docker secrets).
- ``KVMESH_<SECTION>_HOST=auto`` (``KVMESH_INSTANCE_HOST``, ``KVMESH_ROUTER_HOST``, ``KVMESH_CACHESVC_HOST``):
  this container's own address. Engines advertise the address they bind, so on a bridge network each replica
  binds its own address, not 0.0.0.0.
- The service's settings are loaded as it will load them (kvmesh.settings.load_entry_point): an unknown or renamed
  ``KVMESH_*`` variable or a bad value stops the container here, exit 2.
- An engine on port 0 binds any free port itself and writes it to its ready file (``KVMESH_READY_FILE``, set
  here to /tmp/kvmesh-ready.json unless given), which the healthcheck reads: no port is picked here, since
  another process on the host network could take it before the engine binds it. One without an instance id
  gets ``<role>-<hostname>-<port>`` (port 0: a random suffix instead): replicas on a bridge network share the
  port, replicas on the host network the hostname, so the default ``<role>-<port>`` could collide.
- ``HEALTHCHECK_ADDRESS`` (``grpc://host:port``, ``nats://host:port`` or ``ready:///path/to/ready.json``) tells
  docker/healthcheck.py what to ask, and ``HEALTHCHECK_TLS`` how: ``mesh`` (the default: the service's own mesh
  certificate when it has one), ``public`` (the router's client-facing TLS) or ``none``.
"""

from __future__ import annotations

import os
import socket
import sys
import uuid
from pathlib import Path

READY_FILE = "/tmp/kvmesh-ready.json"
SERVICES = {"services.router": "router", "services.prefill": "prefill", "services.decode": "decode",
            "services.cachesvc": "cachesvc"}


def fail(message: str) -> None:
    print(f"kvmesh entrypoint: {message}", file=sys.stderr, flush=True)
    sys.exit(2)


def read_secret_files(env: dict[str, str]) -> None:
    for key in [k for k in env if k.endswith("_FILE") and k.startswith("KVMESH_")]:
        name, path = key[:-len("_FILE")], env[key]
        try:
            env[name] = Path(path).read_text().strip()
        except OSError as e:
            fail(f"{key}={path!r}: cannot read the secret file ({e.strerror}); mount it or unset {key}")
        del env[key]


def own_address(name: str) -> str:
    try:
        return socket.gethostbyname(socket.gethostname())
    except OSError as e:
        fail(f"{name}=auto: cannot resolve this container's hostname ({e}); set {name} explicitly")
        raise


def prepare_service(service: str, argv: list[str], env: dict[str, str]) -> str:
    """Resolve the container-specific settings of ``service`` into ``env``; returns its health address."""
    from kvmesh import settings

    own = settings.ENTRY_POINT_SECTIONS[service][0]  # router, instance or cachesvc
    host_var = f"KVMESH_{own.upper()}_HOST"
    if env.get(host_var) == "auto" and "--host" not in argv:
        env[host_var] = own_address(host_var)
    try:
        loaded = settings.load_entry_point(service, argv, env)
        if own == "instance" and not loaded.instance.id:
            suffix = loaded.instance.port or uuid.uuid4().hex[:8]  # port 0: the engine picks it as it binds
            env["KVMESH_INSTANCE_ID"] = f"{loaded.instance.role}-{socket.gethostname()}-{suffix}"
            loaded = settings.load_entry_point(service, argv, env)
    except (OSError, ValueError) as e:
        fail(f"bad settings for {service}: {e}")
        raise
    cfg = loaded[own]
    if service == "router":  # its health is asked on the clients' port, which the mesh certificate does not serve
        env["HEALTHCHECK_TLS"] = "public" if loaded.router.public_tls_cert else "none"
    port = cfg.grpc_port if service == "router" else cfg.port
    if port == 0:  # bound as the service starts: the healthcheck reads it from the service's ready file
        ready = loaded.shared.ready_file
        if not ready:
            env["KVMESH_READY_FILE"] = ready = READY_FILE
        return f"ready://{ready}"
    host = "127.0.0.1" if cfg.host in ("0.0.0.0", "") else cfg.host
    return f"grpc://{host}:{port}"


def nats_address(argv: list[str]) -> str:
    host, port = "127.0.0.1", "4222"
    for i, arg in enumerate(argv[:-1]):
        if arg in ("-p", "--port"):
            port = argv[i + 1]
        elif arg in ("-a", "--addr", "--net") and argv[i + 1] not in ("0.0.0.0", "::"):
            host = argv[i + 1]
    return f"nats://{host}:{port}"


def main(argv: list[str]) -> None:
    if not argv:
        fail("no command: give one, e.g. python -m services.router")
    env = dict(os.environ)
    read_secret_files(env)
    if Path(argv[0]).name.startswith("python") and argv[1:2] == ["-m"] and argv[2:3] and argv[2] in SERVICES:
        env["HEALTHCHECK_ADDRESS"] = prepare_service(SERVICES[argv[2]], argv[3:], env)
    elif Path(argv[0]).name == "nats-server":
        env["HEALTHCHECK_ADDRESS"] = nats_address(argv)
    try:
        os.execvpe(argv[0], argv, env)
    except OSError as e:
        fail(f"cannot run {argv[0]!r}: {e.strerror}")


if __name__ == "__main__":
    main(sys.argv[1:])
