"""The router process, started the way `kvmesh up` starts it, serves without loading torch."""

from __future__ import annotations

import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

from kvmesh.bus.nats_server import NatsServer, free_port

from tests.integration.test_router_bad_input import tiny_model_dir

RSS_LIMIT_KB = 150 * 1024  # measured ~70 MB with the tiny model, ~120 MB with the default one; 400 MB with torch


def status(pid: int) -> dict[str, str]:
    lines = Path(f"/proc/{pid}/status").read_text().splitlines()
    return {k: v.strip() for k, _, v in (line.partition(":") for line in lines)}


def wait_serving(port: int, proc: subprocess.Popen[str], within_s: float = 60.0) -> None:
    deadline = time.monotonic() + within_s
    while True:
        try:
            urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=1).read()
            return
        except urllib.error.HTTPError:
            return  # it answers (503 while no engine instance has a heartbeat in)
        except OSError:
            assert proc.poll() is None, f"the router exited: {proc.communicate()[1][-2000:]}"
            assert time.monotonic() < deadline, "the router did not serve HTTP in time"
            time.sleep(0.1)


def test_a_serving_router_maps_no_torch_and_stays_small(nats_server: NatsServer, tmp_path: Path) -> None:
    model = tiny_model_dir(tmp_path)
    http_port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "services.router", "--model", str(model), "--nats-url",
                             nats_server.url, "--http-port", str(http_port), "--grpc-port", str(free_port())],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        wait_serving(http_port, proc)
        maps = Path(f"/proc/{proc.pid}/maps").read_text()
        rss_kb = int(status(proc.pid)["VmRSS"].split()[0])
    finally:
        proc.terminate()
        proc.wait(timeout=10)
    assert "torch" not in maps
    assert rss_kb <= RSS_LIMIT_KB
