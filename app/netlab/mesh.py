"""kvmesh spread over the lab's hosts, as it runs across machines: nothing on loopback, every service dialling
the others by the addresses they advertise.

| host | runs |
|---|---|
| control | nats-server, cachesvc, the router |
| prefill | prefill-0 |
| decode | decode-0 (advertising the wan host's address when a delay is set) |
| wan | with a delay: ``delay_proxy`` forwarding decode's gRPC and transfer ports, both ways |
| client | nothing: the tests' and the benchmark's requests (``Lab.call``) |

The link into decode is the one that carries the KV push (and decode's stream back); ``cap`` shapes it, the delay
proxy lengthens it.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

from kvmesh.bus import find_nats_server
from kvmesh.ready import terminate, wait_ready

from app.netlab.hosts import Lab

HOSTS = ["control", "prefill", "decode", "wan", "client"]
NATS_PORT, CACHESVC_PORT, GRPC_PORT, HTTP_PORT = 4222, 50060, 50051, 8000
PREFILL_PORT, DECODE_PORT, DECODE_TRANSFER_PORT = 50061, 50062, 50063


class NetnsMesh:
    """Start with ``start()``, stop with ``stop()``; ``state_dir`` holds logs, ready files and the span file."""

    def __init__(self, lab: Lab, state_dir: Path, delay_ms: float = 0.0, env: dict[str, str] | None = None) -> None:
        self.lab = lab
        self.state_dir = state_dir
        self.delay_ms = delay_ms
        self.env = env or {}
        self.procs: dict[str, subprocess.Popen] = {}
        self.endpoints: dict[str, dict[str, str]] = {}

    @property
    def router_http(self) -> str:
        return f"http://{self.lab['control'].address}:{HTTP_PORT}"

    @property
    def trace_file(self) -> Path:
        return self.state_dir / "traces.jsonl"

    def start(self, timeout_s: float = 300.0) -> None:
        deadline = time.monotonic() + timeout_s
        (self.state_dir / "logs").mkdir(parents=True, exist_ok=True)
        (self.state_dir / "ready").mkdir(parents=True, exist_ok=True)
        control = self.lab["control"].address
        try:
            self._nats(control, deadline)
            shared = {"KVMESH_NATS_URL": f"nats://{control}:{NATS_PORT}", "KVMESH_CLUSTER": "netns",
                      "KVMESH_TELEMETRY_TRACE_FILE": str(self.trace_file)}
            self._service("cachesvc", "control", "services.cachesvc", deadline, {
                **shared, "KVMESH_CACHESVC_HOST": control, "KVMESH_CACHESVC_PORT": str(CACHESVC_PORT)})
            engine = {**shared, "KVMESH_INSTANCE_CACHESVC_ADDRESS": f"{control}:{CACHESVC_PORT}",
                      "KVMESH_ENGINE_THREADS": "1"}
            self._service("prefill-0", "prefill", "services.prefill", deadline, {
                **engine, "KVMESH_INSTANCE_ROLE": "prefill", "KVMESH_INSTANCE_ID": "prefill-0",
                "KVMESH_INSTANCE_HOST": self.lab["prefill"].address, "KVMESH_INSTANCE_PORT": str(PREFILL_PORT)})
            decode = self.lab["decode"].address
            self._service("decode-0", "decode", "services.decode", deadline, {
                **engine, "KVMESH_INSTANCE_ROLE": "decode", "KVMESH_INSTANCE_ID": "decode-0",
                "KVMESH_INSTANCE_HOST": decode, "KVMESH_INSTANCE_PORT": str(DECODE_PORT),
                "KVMESH_INSTANCE_TRANSFER_PORT": str(DECODE_TRANSFER_PORT),
                **({"KVMESH_INSTANCE_ADVERTISE_HOST": self.lab["wan"].address} if self.delay_ms else {})})
            if self.delay_ms:
                self._delay_proxy(decode, deadline)
            self._service("router", "control", "services.router", deadline, {
                **shared, "KVMESH_ROUTER_HOST": control, "KVMESH_ROUTER_HTTP_PORT": str(HTTP_PORT),
                "KVMESH_ROUTER_GRPC_PORT": str(GRPC_PORT),
                "KVMESH_ROUTER_CACHESVC_ADDRESS": f"{control}:{CACHESVC_PORT}"})
            while self.health().get("instances", 0) < 2:
                if time.monotonic() > deadline:
                    raise TimeoutError(f"the router does not see both engines; see {self.state_dir / 'logs'}")
                time.sleep(0.3)
        except BaseException:
            self.stop()
            raise

    def stop(self) -> None:
        for name in ("router", "delay-proxy", "decode-0", "prefill-0", "cachesvc", "nats"):
            proc = self.procs.pop(name, None)
            if proc is not None:
                terminate(proc)

    # ---- requests, from the client host ---------------------------------------------------------------------
    def health(self) -> dict:
        return self.lab.call("client", lambda: _get_json(f"{self.router_http}/health"))

    def post(self, path: str, body: dict, headers: dict[str, str] | None = None) -> dict:
        """POST a JSON body to the router from the client host; the JSON answer."""
        return self.lab.call("client", lambda: _post_json(f"{self.router_http}{path}", body, headers or {}))

    def metrics(self, service: str) -> str:
        """``service``'s Prometheus text, scraped from the client host."""
        url = self.endpoints[service]["metrics"]
        url = url if url.endswith("/metrics") else f"{url}/metrics"
        return self.lab.call("client", lambda: _get_text(url))

    # ---- starting the pieces ------------------------------------------------------------------------------------
    def _nats(self, address: str, deadline: float) -> None:
        store = self.state_dir / "nats"
        store.mkdir(parents=True, exist_ok=True)
        self._spawn("nats", "control", [str(find_nats_server()), "-a", address, "-p", str(NATS_PORT), "-js", "-sd",
                                        str(store)], {})
        self.lab.call("control", lambda: wait_port(address, NATS_PORT, deadline))

    def _delay_proxy(self, decode: str, deadline: float) -> None:
        wan = self.lab["wan"].address
        routes = [f"{wan}:{p}={decode}:{p}" for p in (DECODE_PORT, DECODE_TRANSFER_PORT)]
        self._spawn("delay-proxy", "wan", [sys.executable, "-m", "app.netlab.delay_proxy", "--delay-ms",
                                           str(self.delay_ms), *routes], {})
        for port in (DECODE_PORT, DECODE_TRANSFER_PORT):
            self.lab.call("wan", lambda p=port: wait_port(wan, p, deadline))

    def _service(self, name: str, host: str, module: str, deadline: float, env: dict[str, str]) -> None:
        ready = self.state_dir / "ready" / f"{name}.json"
        ready.unlink(missing_ok=True)
        proc = self._spawn(name, host, [sys.executable, "-m", module], {**env, "KVMESH_READY_FILE": str(ready)})
        self.endpoints[name] = wait_ready(ready, proc, name, self.state_dir / "logs" / f"{name}.log",
                                          timeout_s=max(1.0, deadline - time.monotonic())).endpoints

    def _spawn(self, name: str, host: str, argv: list[str], env: dict[str, str]) -> subprocess.Popen:
        with open(self.state_dir / "logs" / f"{name}.log", "ab") as log:
            proc = self.lab.popen(host, argv, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                  start_new_session=True,
                                  env={**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1",
                                       "KVMESH_STATE_DIR": str(self.state_dir), **self.env, **env})
        self.procs[name] = proc
        return proc


def wait_port(host: str, port: int, deadline: float) -> None:
    while True:
        try:
            socket.create_connection((host, port), timeout=1.0).close()
            return
        except OSError:
            if time.monotonic() > deadline:
                raise TimeoutError(f"nothing listens on {host}:{port}") from None
            time.sleep(0.1)


def _get_json(url: str) -> dict:
    try:
        with urllib.request.urlopen(url, timeout=10) as r:
            return json.load(r)
    except urllib.error.HTTPError as e:
        return json.load(e)
    except (OSError, ValueError):
        return {}


def _get_text(url: str) -> str:
    with urllib.request.urlopen(url, timeout=10) as r:
        return r.read().decode()


def _post_json(url: str, body: dict, headers: dict[str, str]) -> dict:
    req = urllib.request.Request(url, data=json.dumps(body).encode(),
                                 headers={"content-type": "application/json", **headers})
    with urllib.request.urlopen(req, timeout=300) as r:
        return json.load(r)
