"""``kvmesh up``: the whole stack as local processes — nats-server, cachesvc, engine instances, router.

Everything the stack writes (logs, NATS data, stack.json, ready files, the span file traces.jsonl) goes to the state
directory. Services bind the ports given (0 = any free one) and report the ports bound in their ready files;
stack.json holds those actual addresses.
Each service runs in its own session, so Ctrl-C / SIGTERM reaches the launcher alone and it stops the services in
order: router, engines, cachesvc, then NATS.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Self

from kvmesh.bus import NatsServer
from kvmesh.ready import poll_ready
from kvmesh.state import StackInfo
from kvmesh.telemetry.spans import trace_file

# what `python -m` runs for each engine role; `both` is composed in the application layer (app/both.py)
ENGINE_MODULES = {"prefill": "services.prefill", "decode": "services.decode", "both": "app.both"}


@dataclass
class StackOptions:
    prefill: int = 1
    decode: int = 1
    both: int = 0
    nats_url: str | None = None
    http_port: int = 8000   # router ports; 0 = any free port (tests, benchmarks): read back from Stack / stack.json
    grpc_port: int = 50051
    cachesvc_port: int = 0
    cluster: str = "local"
    model: str | None = None
    threads: int = 1
    transfer_backend: str = "tcp"
    pool: bool = True  # engines write back to and fetch from cachesvc's pool (False: the router still asks it)
    env: dict[str, str] = field(default_factory=dict)  # extra KVMESH_* settings for every service


@dataclass
class Service:
    name: str
    proc: subprocess.Popen
    log_path: Path
    ready_path: Path
    endpoints: dict[str, str] = field(default_factory=dict)  # what it bound, from its ready file

    @property
    def grpc_address(self) -> str:
        return self.endpoints.get("grpc", "")


class Stack:
    """Services start on the ports given (0 = any free one, the default for all but the router's) and report
    what they bound in a ready file (``kvmesh.ready``); the stack passes those addresses on: cachesvc first, then
    the engines and the router with its actual address. No port is picked ahead of a bind."""

    def __init__(self, state_dir: Path, opts: StackOptions) -> None:
        self.state_dir = state_dir
        self.opts = opts
        self.services: list[Service] = []
        self.nats: NatsServer | None = None
        self.log_dir = state_dir / "logs"
        self.ready_dir = state_dir / "ready"

    def service(self, name: str) -> Service:
        return next(s for s in self.services if s.name == name)

    @property
    def router_grpc(self) -> str:
        """host:port the router's gRPC API bound."""
        return self.service("router").endpoints["grpc"]

    @property
    def router_http(self) -> str:
        """http://host:port the router's HTTP API bound."""
        return self.service("router").endpoints["http"]

    @property
    def grpc_port(self) -> int:
        return int(self.router_grpc.rsplit(":", 1)[1])

    @property
    def http_port(self) -> int:
        return int(self.router_http.rsplit(":", 1)[1])

    def start(self, timeout_s: float = 180.0) -> StackInfo:
        """Start everything and return once the router sees every engine. A service that cannot start (e.g. a
        fixed port in use) raises ServiceFailed (a RuntimeError) with its message; TimeoutError past
        ``timeout_s``."""
        o = self.opts
        deadline = time.monotonic() + timeout_s
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self.ready_dir.mkdir(parents=True, exist_ok=True)
        try:
            nats_url = o.nats_url
            if nats_url is None:
                self.nats = NatsServer(self.state_dir / "nats").start()  # any free port, read back
                nats_url = self.nats.url
            common = ["--nats-url", nats_url, "--cluster", o.cluster]
            cache = self._spawn("cachesvc", ["services.cachesvc", "--port", str(o.cachesvc_port),
                                             "--transfer-backend", o.transfer_backend, *common])
            self._wait_ready([cache], deadline)  # the engines and the router need its actual address
            cache_address = cache.grpc_address
            model = ["--model", o.model] if o.model else []
            pool = ["--cachesvc-address", cache_address] if o.pool else []
            for role, count in (("prefill", o.prefill), ("decode", o.decode), ("both", o.both)):
                for i in range(count):
                    module = ENGINE_MODULES[role]
                    self._spawn(f"{role}-{i}", [module, "--role", role, "--instance-id", f"{role}-{i}",
                                                "--port", "0", "--threads", str(o.threads),
                                                "--transfer-backend", o.transfer_backend,
                                                *pool, *model, *common])
            self._spawn("router", ["services.router", "--grpc-port", str(o.grpc_port), "--http-port",
                                   str(o.http_port), "--cachesvc-address", cache_address, *model, *common])
            self._wait_ready(self.services, deadline)
            self._wait_instances(deadline)
        except BaseException:
            self.stop()
            raise
        info = StackInfo(router_grpc=self.router_grpc, router_http=self.router_http, nats_url=nats_url,
                         cluster=o.cluster, pids={s.name: s.proc.pid for s in self.services},
                         endpoints={s.name: s.endpoints for s in self.services})
        info.write(self.state_dir)
        return info

    def _spawn(self, name: str, args: list[str]) -> Service:
        log_path = self.log_dir / f"{name}.log"
        ready_path = self.ready_dir / f"{name}.json"
        ready_path.unlink(missing_ok=True)  # one from an earlier run is not this process's
        env = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": str(self.opts.threads),
               "KVMESH_STATE_DIR": str(self.state_dir),
               # spans of every service go to one file that `kvmesh trace` reads (unless the caller chose one)
               "KVMESH_TRACE_FILE": os.environ.get("KVMESH_TRACE_FILE", str(trace_file(self.state_dir))),
               **self.opts.env}
        with open(log_path, "ab") as log:
            proc = subprocess.Popen([sys.executable, "-m", *args, "--ready-file", str(ready_path)], stdout=log,
                                    stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env,
                                    start_new_session=True)
        service = Service(name, proc, log_path, ready_path)
        self.services.append(service)
        return service

    def _wait_ready(self, services: list[Service], deadline: float) -> None:
        """Until each has written its ready file (it serves): read what it bound."""
        pending = [s for s in services if not s.endpoints]
        while pending:
            for s in list(pending):
                ready = poll_ready(s.ready_path, s.proc, s.name, s.log_path)  # ServiceFailed if it gave up
                if ready is not None:
                    s.endpoints = ready.endpoints
                    pending.remove(s)
            if pending and time.monotonic() > deadline:
                raise TimeoutError(f"not ready in time: {', '.join(s.name for s in pending)}; see {self.log_dir}")
            time.sleep(0.1)

    def _wait_instances(self, deadline: float) -> None:
        want = self.opts.prefill + self.opts.decode + self.opts.both
        while _router_instances(self.router_http) < want:  # heartbeats reached the router
            if time.monotonic() > deadline:
                raise TimeoutError(f"router does not see all {want} engine instances; see {self.log_dir}")
            time.sleep(0.2)

    def stop(self, timeout_s: float = 10.0) -> None:
        for group in (["router"], [s.name for s in self.services if s.name not in ("router", "cachesvc")],
                      ["cachesvc"]):
            procs = [s.proc for s in self.services if s.name in group and s.proc.poll() is None]
            for p in procs:
                p.send_signal(signal.SIGTERM)
            for p in procs:
                try:
                    p.wait(timeout_s)
                except subprocess.TimeoutExpired:
                    p.kill()
                    p.wait()
        if self.nats is not None:
            self.nats.stop()
        (self.state_dir / "stack.json").unlink(missing_ok=True)

    def __enter__(self) -> Self:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def _router_instances(http_url: str) -> int:
    try:
        with urllib.request.urlopen(f"{http_url}/health", timeout=1.0) as r:
            return int(json.load(r)["instances"])
    except urllib.error.HTTPError as e:
        return int(json.load(e).get("instances", 0))
    except (OSError, ValueError, KeyError):
        return 0
