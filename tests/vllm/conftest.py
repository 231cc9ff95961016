"""Real vLLM (``make vllm``): kvmesh stacks whose engines are vLLM, and standalone ``vllm serve`` as the reference.
Every test here is marked ``vllm`` and skips, naming the install command, where vLLM is not installed."""

from __future__ import annotations

import http.client
import importlib.util
import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from app.launcher import Stack, StackOptions

HAVE_VLLM = importlib.util.find_spec("vllm") is not None
pytestmark = pytest.mark.vllm
# the settings every vLLM instance here runs with: small KV (2,048 tokens of context), one thread
ENGINE = {"backend": "vllm", "num_blocks": 264, "max_model_len": 2048, "threads": 1}


def pytest_collection_modifyitems(config, items):
    for item in items:
        if "tests/vllm/" in str(item.fspath):
            item.add_marker(pytest.mark.vllm)
            if not HAVE_VLLM:
                item.add_marker(pytest.mark.skip(reason="vLLM is not installed: `make vllm` installs it (the CPU "
                                                        "build here), `make test-vllm` runs these tests"))


def vllm_stack(tmp_path_factory, name: str, both: int = 1, prefill: int = 0, decode: int = 0,
               engine: dict | None = None, **settings) -> Stack:
    opts = StackOptions.local(name, prefill=prefill, decode=decode, both=both,
                              settings={"engine": {**ENGINE, **(engine or {})}, **settings})
    stack = Stack(tmp_path_factory.mktemp(name), opts)
    stack.start(timeout_s=400)
    return stack


class UnixHTTPConnection(http.client.HTTPConnection):
    def __init__(self, path: str, timeout: float = 300) -> None:
        super().__init__("localhost", timeout=timeout)
        self.path = path

    def connect(self) -> None:
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.settimeout(self.timeout)
        self.sock.connect(self.path)


class StandaloneVLLM:
    """``python -m vllm.entrypoints.openai.api_server`` on a Unix socket (no port to race for), with the engine
    arguments kvmesh's vLLM instances use: the same weights, dtype, block size and KV size."""

    def __init__(self, workdir: Path, model_dir: str) -> None:
        self.sock = str(workdir / "vllm.sock")
        self.log = workdir / "vllm-serve.log"
        block_bytes = 30 * 2 * 3 * 64 * 128 * 4  # SmolLM2-135M fp32, one vLLM block of 128 tokens
        blocks = ENGINE["num_blocks"] * 16 // 128
        cmd = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", model_dir,
               "--tokenizer", model_dir, "--dtype", "float32", "--uds", self.sock, "--max-model-len", "2048",
               "--block-size", "128", "--num-gpu-blocks-override", str(blocks + 1),
               "--kv-cache-memory-bytes", str((blocks + 2) * block_bytes), "--enforce-eager",
               "--enable-prefix-caching", "--max-num-seqs", "64", "--seed", "0", "--disable-log-stats"]
        env = {**os.environ, "VLLM_CPU_OMP_THREADS_BIND": "nobind", "OMP_NUM_THREADS": "1",
               "VLLM_CPU_NUM_OF_RESERVED_CPU": "0", "TORCH_COMPILE_DISABLE": "1", "VLLM_NO_USAGE_STATS": "1"}
        with open(self.log, "wb") as log:
            self.proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                         env=env, start_new_session=True)
        deadline = time.monotonic() + 400
        while not self._healthy():
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"vllm serve did not come up; see {self.log}")
            time.sleep(1)
        self.model = self.get("/v1/models")["data"][0]["id"]

    def _healthy(self) -> bool:
        try:
            conn = UnixHTTPConnection(self.sock, timeout=5)
            conn.request("GET", "/health")
            return conn.getresponse().status == 200
        except OSError:
            return False

    def get(self, path: str) -> dict:
        conn = UnixHTTPConnection(self.sock)
        conn.request("GET", path)
        return json.loads(conn.getresponse().read())

    def post(self, path: str, body: dict) -> dict:
        conn = UnixHTTPConnection(self.sock)
        conn.request("POST", path, json.dumps(body), {"content-type": "application/json"})
        return json.loads(conn.getresponse().read())

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()


@pytest.fixture(scope="session")
def model_dir() -> str:
    from kvmesh.engine.loader import resolve_model

    return str(resolve_model(None).hf_dir)
