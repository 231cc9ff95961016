"""Container entrypoint: fills in what only the running container knows, checks the settings, then execs the
service command (so the service is PID 1 and gets the signals).

- ``<NAME>_FILE`` for ``KVMESH_*`` and ``NATS_*`` variables: ``<NAME>`` is read from that file (docker
  secrets).
- ``KVMESH_HOST=auto``: this container's own address. Engines advertise the address they bind, so on a bridge
  network each replica binds its own address, not 0.0.0.0.
- An engine on port 0 binds any free port itself and writes it to its ready file (``KVMESH_READY_FILE``, set
  here to /tmp/kvmesh-ready.json unless given), which the healthcheck reads: no port is picked here, since
  another process on the host network could take it before the engine binds it. One without an instance id
  gets ``<role>-<hostname>-<port>`` (port 0: a random suffix instead): replicas on a bridge network share the
  port, replicas on the host network the hostname, so the default ``<role>-<port>`` could collide.
- ``HEALTHCHECK_ADDRESS`` (``grpc://host:port``, ``nats://host:port`` or ``ready:///path/to/ready.json``) tells
  docker/healthcheck.py what to ask.
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
    for key in [k for k in env if k.endswith("_FILE") and k.startswith(("KVMESH_", "NATS_"))]:
        name, path = key[:-len("_FILE")], env[key]
        try:
            env[name] = Path(path).read_text().strip()
        except OSError as e:
            fail(f"{key}={path!r}: cannot read the secret file ({e.strerror}); mount it or unset {key}")
        del env[key]


def flags(argv: list[str]) -> dict[str, str]:
    """``--some-flag value`` / ``--some-flag=value`` pairs as ``{"some_flag": "value"}``."""
    out: dict[str, str] = {}
    i = 0
    while i < len(argv):
        arg = argv[i]
        if arg.startswith("--"):
            name, eq, value = arg[2:].partition("=")
            if not eq and i + 1 < len(argv) and not argv[i + 1].startswith("--"):
                value, i = argv[i + 1], i + 1
            out[name.replace("-", "_")] = value
        i += 1
    return out


def own_address() -> str:
    try:
        return socket.gethostbyname(socket.gethostname())
    except OSError as e:
        fail(f"KVMESH_HOST=auto: cannot resolve this container's hostname ({e}); set KVMESH_HOST explicitly")
        raise


def prepare_service(service: str, argv: list[str], env: dict[str, str]) -> str:
    """Resolve the container-specific settings of ``service`` into ``env``; returns its health address."""
    from app import config_show  # noqa: PLC0415 - only for kvmesh services

    given = flags(argv)
    if env.get("KVMESH_HOST") == "auto" and "host" not in given:
        env["KVMESH_HOST"] = own_address()
    path = given.get("config")
    try:
        if service in ("prefill", "decode"):
            cfg = config_show.load_service(service, path, env, given)["worker"]
            suffix = cfg.port or uuid.uuid4().hex[:8]  # port 0: the engine picks it as it binds, after us
            if not cfg.instance_id:
                env["KVMESH_INSTANCE_ID"] = f"{cfg.role}-{socket.gethostname()}-{suffix}"
        loaded = config_show.load_service(service, path, env, given)
    except (OSError, ValueError) as e:
        fail(f"bad settings for {service}: {e}")
        raise
    cfg = loaded[config_show.SERVICE_SECTIONS[service][0]]
    port = cfg.grpc_port if service == "router" else cfg.port
    if port == 0:  # bound as the service starts: the healthcheck reads it from the service's ready file
        env.setdefault("KVMESH_READY_FILE", READY_FILE)
        return f"ready://{env['KVMESH_READY_FILE']}"
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
