"""``kvmesh up``: the whole stack as local processes — nats-server, cachesvc, engine instances, router.

Everything the stack writes (logs, NATS data, stack.json, the span file traces.jsonl) goes to the state directory.
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

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from kvmesh import config, tls
from kvmesh.bus import NatsServer
from kvmesh.bus.nats_server import free_port
from kvmesh.state import StackInfo
from kvmesh.telemetry.spans import trace_file
from kvmesh.tls import TLSConfig

HOST = "127.0.0.1"


@dataclass
class StackOptions:
    prefill: int = 1
    decode: int = 1
    both: int = 0
    nats_url: str | None = None
    http_port: int = 8000
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
    grpc_address: str
    log_path: Path


class Stack:
    def __init__(self, state_dir: Path, opts: StackOptions) -> None:
        self.state_dir = state_dir
        self.opts = opts
        self.services: list[Service] = []
        self.nats: NatsServer | None = None
        self.log_dir = state_dir / "logs"

    def start(self, timeout_s: float = 180.0) -> StackInfo:
        o = self.opts
        self.log_dir.mkdir(parents=True, exist_ok=True)
        nats_url = o.nats_url
        if nats_url is None:
            self.nats = NatsServer(self.state_dir / "nats").start()
            nats_url = self.nats.url
        common = ["--nats-url", nats_url, "--cluster", o.cluster]
        try:
            cache_port = o.cachesvc_port or free_port()
            self._spawn("cachesvc", ["services.cachesvc", "--port", str(cache_port), "--transfer-backend",
                                     o.transfer_backend, *common], cache_port)
            model = ["--model", o.model] if o.model else []
            pool = ["--cachesvc-address", f"{HOST}:{cache_port}"] if o.pool else []
            for role, count in (("prefill", o.prefill), ("decode", o.decode), ("both", o.both)):
                for i in range(count):
                    port = free_port()
                    module = "services.prefill" if role == "prefill" else "services.decode"
                    self._spawn(f"{role}-{i}", [module, "--role", role, "--instance-id", f"{role}-{i}",
                                                "--port", str(port), "--threads", str(o.threads),
                                                "--transfer-backend", o.transfer_backend,
                                                *pool, *model, *common], port)
            self._spawn("router", ["services.router", "--grpc-port", str(o.grpc_port), "--http-port",
                                   str(o.http_port), "--cachesvc-address", f"{HOST}:{cache_port}", *model,
                                   *common], o.grpc_port)
            self._wait_ready(time.monotonic() + timeout_s)
        except BaseException:
            self.stop()
            raise
        info = StackInfo(router_grpc=f"{HOST}:{o.grpc_port}", router_http=f"http://{HOST}:{o.http_port}",
                         nats_url=nats_url, cluster=o.cluster,
                         pids={s.name: s.proc.pid for s in self.services})
        info.write(self.state_dir)
        return info

    def _spawn(self, name: str, args: list[str], port: int) -> None:
        log_path = self.log_dir / f"{name}.log"
        env = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": str(self.opts.threads),
               "KVMESH_STATE_DIR": str(self.state_dir),
               # spans of every service go to one file that `kvmesh trace` reads (unless the caller chose one)
               "KVMESH_TRACE_FILE": os.environ.get("KVMESH_TRACE_FILE", str(trace_file(self.state_dir))),
               **self.opts.env}
        with open(log_path, "ab") as log:
            proc = subprocess.Popen([sys.executable, "-m", *args], stdout=log, stderr=subprocess.STDOUT,
                                    stdin=subprocess.DEVNULL, env=env, start_new_session=True)
        self.services.append(Service(name, proc, f"{HOST}:{port}", log_path))

    def _wait_ready(self, deadline: float) -> None:
        pending = list(self.services)
        tls_cfg = config.load(TLSConfig, env={**os.environ, **self.opts.env})  # what the services were given
        while pending:
            for s in list(pending):
                if s.proc.poll() is not None:
                    raise RuntimeError(f"{s.name} exited with code {s.proc.returncode}; last log lines:\n"
                                       + _tail(s.log_path))
                if _serving(s.grpc_address, tls_cfg):
                    pending.remove(s)
            if time.monotonic() > deadline:
                raise TimeoutError(f"not healthy in time: {', '.join(s.name for s in pending)}; see {self.log_dir}")
            time.sleep(0.2)
        want = self.opts.prefill + self.opts.decode + self.opts.both
        while _router_instances(self.opts.http_port) < want:  # heartbeats reached the router
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


def _serving(address: str, tls_cfg: TLSConfig | None = None) -> bool:
    try:
        with tls.channel(address, cfg=tls_cfg) as ch:
            resp = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(service=""), timeout=1.0)
        return resp.status == health_pb2.HealthCheckResponse.SERVING
    except grpc.RpcError:
        return False


def _router_instances(http_port: int) -> int:
    try:
        with urllib.request.urlopen(f"http://{HOST}:{http_port}/health", timeout=1.0) as r:
            return int(json.load(r)["instances"])
    except urllib.error.HTTPError as e:
        return int(json.load(e).get("instances", 0))
    except (OSError, ValueError, KeyError):
        return 0


def _tail(path: Path, lines: int = 30) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return "(no log)"
