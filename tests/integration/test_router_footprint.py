"""The router process, started the way `kvmesh up` starts it, serves without loading torch."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from kvmesh.bus.nats_server import NatsServer
from kvmesh.ready import wait_ready

from tests.integration.test_router_bad_input import tiny_model_dir

RSS_LIMIT_KB = 150 * 1024  # measured ~70 MB with the tiny model, ~120 MB with the default one; 400 MB with torch


def status(pid: int) -> dict[str, str]:
    lines = Path(f"/proc/{pid}/status").read_text().splitlines()
    return {k: v.strip() for k, _, v in (line.partition(":") for line in lines)}


def test_a_serving_router_maps_no_torch_and_stays_small(nats_server: NatsServer, tmp_path: Path) -> None:
    model = tiny_model_dir(tmp_path)
    ready, log = tmp_path / "router.ready", tmp_path / "router.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen([sys.executable, "-m", "services.router", "--model", str(model), "--nats-url",
                                 nats_server.url, "--http-port", "0", "--grpc-port", "0", "--ready-file",
                                 str(ready)], stdout=out, stderr=subprocess.STDOUT)
    try:
        wait_ready(ready, proc, "router", log)
        maps = Path(f"/proc/{proc.pid}/maps").read_text()
        rss_kb = int(status(proc.pid)["VmRSS"].split()[0])
    finally:
        proc.terminate()
        proc.wait(timeout=10)
    assert "torch" not in maps
    assert rss_kb <= RSS_LIMIT_KB
