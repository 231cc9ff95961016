"""How a service says which ports it bound, and how a fixed port that is taken fails.

Every server binds what it is given, port 0 included (= any free port), and reports what it actually bound:
once it serves, it logs one ready line (``<service> ready: grpc=127.0.0.1:41234 http=...``) and, when given a
ready file (``--ready-file PATH`` or ``$KVMESH_READY_FILE``), writes there atomically (tmp + rename) a small JSON
of the same endpoints. Whoever started it (``kvmesh up``, test fixtures) reads that back instead of picking a
"free" port first: a picked port can be taken by another process before the service binds it.

A fixed port that cannot be bound raises :class:`PortInUse`, whose message names the setting to change; the
service logs it, writes it to the ready file as ``error`` and exits with :data:`EXIT_BIND`.
"""

from __future__ import annotations

import errno
import json
import logging
import os
import signal
import subprocess
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

READY_FILE_ENV = "KVMESH_READY_FILE"
EXIT_BIND = 3  # a service that could not bind a port exits with this code

log = logging.getLogger("kvmesh.ready")


class PortInUse(OSError):
    """A port that cannot be bound; the message says which setting to change."""


def bind_error(what: str, host: str, port: int, setting: str, cause: BaseException) -> PortInUse:
    code = getattr(cause, "errno", None)
    if port and code in (None, errno.EADDRINUSE):  # gRPC says only "Failed to bind": almost always in use
        return PortInUse(f"{what} port {port} is in use on {host}: set {setting} (0 = any free port)")
    reason = getattr(cause, "strerror", None) or str(cause)
    return PortInUse(f"cannot bind {what} to {host}:{port} ({reason}): check the host, or set {setting} "
                     "(0 = any free port)")


@contextmanager
def binding(what: str, host: str, port: int, setting: str) -> Iterator[None]:
    """Turn a failed bind inside the block into :class:`PortInUse` naming ``setting``
    (e.g. ``"--http-port / KVMESH_HTTP_PORT"``)."""
    try:
        yield
    except PortInUse:
        raise
    except OSError as e:
        raise bind_error(what, host, port, setting, e) from e


@dataclass(frozen=True)
class Ready:
    """What a ready file holds: the endpoints a service bound, or why it could not start."""

    service: str
    pid: int
    endpoints: dict[str, str] = field(default_factory=dict)  # e.g. grpc, http, metrics, transfer
    error: str = ""

    @classmethod
    def read(cls, path: str | Path) -> Ready | None:
        """The file's content; None while it does not exist yet."""
        try:
            d = json.loads(Path(path).read_text())
        except FileNotFoundError:
            return None
        return cls(service=str(d["service"]), pid=int(d["pid"]),
                   endpoints={str(k): str(v) for k, v in d.get("endpoints", {}).items()},
                   error=str(d.get("error", "")))

    def write(self, path: str | Path) -> None:
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        tmp.write_text(json.dumps({"service": self.service, "pid": self.pid, "endpoints": self.endpoints,
                                   **({"error": self.error} if self.error else {})}))
        tmp.replace(path)


def ready_file(explicit: str | None = None) -> str:
    """The ready file to write: the flag's value, else ``$KVMESH_READY_FILE``, else "" (none)."""
    return explicit if explicit is not None else os.environ.get(READY_FILE_ENV, "")


def report_ready(service: str, endpoints: dict[str, str], path: str | None = None) -> Ready:
    """Log the ready line and write the ready file (when there is one)."""
    ready = Ready(service, os.getpid(), dict(endpoints))
    log.info("%s ready: %s", service, " ".join(f"{k}={v}" for k, v in endpoints.items()))
    if target := ready_file(path):
        ready.write(target)
    return ready


def report_failure(service: str, error: str, path: str | None = None) -> None:
    """Log why the service cannot start and put it in the ready file, for whoever waits on it."""
    log.error("%s", error)
    if target := ready_file(path):
        Ready(service, os.getpid(), error=error).write(target)


class ServiceFailed(RuntimeError):
    """A service exited, or said it cannot start, before it was ready."""


def wait_ready(path: str | Path, proc: subprocess.Popen, name: str, log_path: Path | None = None,
               timeout_s: float = 60.0) -> Ready:
    """Wait until ``proc`` has written ``path``. Raises ServiceFailed with its error (e.g. a port in use) or,
    when it exited without one, with the tail of its log; TimeoutError when it takes longer than ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while True:
        ready = poll_ready(path, proc, name, log_path)
        if ready is not None:
            return ready
        if time.monotonic() > deadline:
            raise TimeoutError(f"{name} did not report ready within {timeout_s:.0f}s"
                               + (f"; see {log_path}" if log_path else ""))
        time.sleep(0.05)


def poll_ready(path: str | Path, proc: subprocess.Popen, name: str, log_path: Path | None = None) -> Ready | None:
    """One look at ``path``: the Ready once there, None while starting; raises ServiceFailed as ``wait_ready``.
    The starter removes ``path`` before it starts ``proc`` (a file of an earlier run is not this one's)."""
    exited = proc.poll() is not None  # before reading: a file written just before exiting is seen
    ready = Ready.read(path)
    if ready is not None:
        if ready.error:
            raise ServiceFailed(f"{name}: {ready.error}")
        return ready
    if exited:
        raise ServiceFailed(f"{name} exited with code {proc.returncode} before it was ready"
                            + (f"; last log lines:\n{tail(log_path)}" if log_path else ""))
    return None


def terminate(proc: subprocess.Popen, grace_s: float = 10.0) -> None:
    """Stop ``proc`` if it still runs: SIGTERM, then SIGKILL past ``grace_s``."""
    if proc.poll() is not None:
        return
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(grace_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def tail(path: Path, lines: int = 30) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return "(no log)"
