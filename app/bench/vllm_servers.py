"""What the vLLM benches (``kvmesh bench vllm``) start besides kvmesh: standalone ``vllm serve`` with the engine
arguments kvmesh's vLLM instances run with, the routers people put in front of vLLM (``vllm-router``,
``sglang-router``), and the kvmesh stack of vLLM instances.

Ports: the routers reach the servers over TCP, so each server and router gets a port picked free right before it
starts (bind port 0, read it, close); another process can take it in between, so a start that fails on its bind
("address already in use" in its log) is retried on a new port. The kvmesh stack binds port 0 itself.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path

from app.launcher import Stack, StackOptions

VLLM_ENV = {"VLLM_CPU_OMP_THREADS_BIND": "nobind", "VLLM_CPU_NUM_OF_RESERVED_CPU": "0", "TORCH_COMPILE_DISABLE": "1",
            "VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1", "TOKENIZERS_PARALLELISM": "false"}
"""What kvmesh's vLLM backend sets before vLLM starts (``kvmesh.vllm.engine._environment``), and so the
standalone servers too: unpinned OpenMP threads, no torch.compile."""
BIND_FAILED = ("address already in use", "Address already in use", "EADDRINUSE")
START_ATTEMPTS = 3


@dataclass(frozen=True)
class EngineShape:
    """The vLLM engine arguments of both sides of a comparison: kvmesh's instances get them as ``[engine]``
    settings (``kvmesh_engine``), which its vLLM backend turns into exactly the arguments ``serve_args`` gives
    standalone ``vllm serve`` (kvmesh.vllm.engine: ``num_blocks`` kvmesh blocks of 16 tokens are ``num_blocks /
    8`` vLLM blocks of 128; vLLM's null block on top; the KV memory two blocks over)."""
    vllm_blocks: int = 33          # usable vLLM blocks of ``block_size`` tokens (33 x 128 = 4,224 tokens)
    block_size: int = 128          # vLLM's block size (its CPU default)
    kvmesh_block_size: int = 16    # kvmesh's (the router's, the index's)
    max_model_len: int = 2048
    max_num_seqs: int = 32
    max_batched_tokens: int = 2048
    threads: int = 1
    device: str = "cpu"            # cuda: vLLM's CUDA build, each server its share of the GPU's memory
    dtype: str = "fp32"            # the model's, and the KV's (kvmesh's wire dtype the same: the exact converter)
    gpu_share: float = 0.3         # on CUDA, vLLM's gpu_memory_utilization of each server (two share one GPU)

    @property
    def torch_dtype(self) -> str:
        return {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}[self.dtype]

    def kvmesh_engine(self) -> dict:
        engine = {"backend": "vllm", "dtype": self.dtype, "threads": self.threads,
                  "block_size": self.kvmesh_block_size, "vllm_block_size": self.block_size,
                  "num_blocks": self.vllm_blocks * (self.block_size // self.kvmesh_block_size),
                  "max_model_len": self.max_model_len, "max_num_seqs": self.max_num_seqs,
                  "max_batched_tokens": self.max_batched_tokens, "enable_prefix_caching": True}
        if self.dtype != "fp32":
            engine["kv_dtype"] = self.dtype
        if self.device != "cpu":
            engine.update(device=self.device, vllm_gpu_memory_utilization=self.gpu_share)
        return engine

    def serve_args(self, model_dir: str, block_bytes: int) -> list[str]:
        """``block_bytes``: one vLLM block of fp32 KV (scaled here to the dtype's)."""
        block_bytes = block_bytes * {"fp32": 4, "bf16": 2, "fp16": 2}[self.dtype] // 4
        device = ["--enforce-eager"] if self.device == "cpu" else ["--gpu-memory-utilization", str(self.gpu_share)]
        return ["--model", model_dir, "--tokenizer", model_dir, "--dtype", self.torch_dtype,
                "--max-model-len", str(self.max_model_len), "--block-size", str(self.block_size),
                "--num-gpu-blocks-override", str(self.vllm_blocks + 1),
                "--kv-cache-memory-bytes", str((self.vllm_blocks + 2) * block_bytes), *device,
                "--enable-prefix-caching", "--max-num-seqs", str(self.max_num_seqs),
                "--max-num-batched-tokens", str(self.max_batched_tokens), "--seed", "0", "--disable-log-stats"]

    def describe(self) -> str:
        where = (f"{self.threads} OpenMP thread(s) unpinned" if self.device == "cpu"
                 else f"on {self.device}, {self.gpu_share:g} of its memory each")
        return (f"{self.vllm_blocks} KV blocks of {self.block_size} tokens, max_model_len {self.max_model_len}, "
                f"max_num_seqs {self.max_num_seqs}, max_num_batched_tokens {self.max_batched_tokens}, dtype "
                f"{self.torch_dtype}, {'eager, ' if self.device == 'cpu' else ''}prefix caching on, {where}")


def default_model() -> tuple[str, int]:
    """The default model's HF directory (the one kvmesh's vLLM instances load) and the bytes of one vLLM block of
    128 tokens of its fp32 KV."""
    from kvmesh.engine.loader import resolve_model

    source = resolve_model(None)
    mc = source.config
    return str(source.hf_dir), mc.num_layers * 2 * mc.num_kv_heads * mc.head_dim * 128 * 4


def free_port() -> int:
    """A port free now (another process may take it before ours binds: callers retry, see the module doc)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def vllm_version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    for dist in ("vllm-cpu", "vllm"):
        try:
            return f"{dist} {version(dist)}"
        except PackageNotFoundError:
            continue
    return "vllm (version unknown)"


def package_version(dist: str) -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(dist)
    except PackageNotFoundError:
        return "not installed"


def _get(url: str, timeout: float = 5.0) -> tuple[int, bytes]:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()
    except (OSError, ValueError):
        return 0, b""


class Process:
    """A server process in its own session, its output in ``log``; ``stop()`` ends its whole process group."""

    def __init__(self, name: str, cmd: list[str], log: Path, env: dict[str, str] | None = None) -> None:
        self.name, self.cmd, self.log = name, cmd, log
        with open(log, "ab") as out:
            self.proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                         env={**os.environ, **(env or {})}, start_new_session=True)

    def bind_failed(self) -> bool:
        return self.proc.poll() is not None and any(s in self.log.read_text(errors="replace") for s in BIND_FAILED)

    def wait_healthy(self, url: str, timeout_s: float) -> None:
        """Until GET ``url`` answers 200; RuntimeError naming the log if the process exits or time runs out."""
        deadline = time.monotonic() + timeout_s
        while _get(url, 2.0)[0] != 200:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.name} exited with {self.proc.returncode}; see {self.log}")
            if time.monotonic() > deadline:
                raise RuntimeError(f"{self.name} not healthy within {timeout_s:.0f} s; see {self.log}")
            time.sleep(1.0)

    def stop(self, timeout_s: float = 30.0) -> None:
        if self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, signal.SIGTERM)
                self.proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
            except ProcessLookupError:
                pass


def start_with_port(name: str, make_cmd, health_path: str, log: Path, env: dict[str, str] | None = None,
                    timeout_s: float = 600.0) -> tuple[Process, str]:
    """Start the command ``make_cmd(port)`` on a port picked free just before; retried on a new port when its
    bind failed. Returns the process and its base URL once ``health_path`` answers 200."""
    for attempt in range(START_ATTEMPTS):
        port = free_port()
        proc = Process(name, make_cmd(port), log, env)
        url = f"http://127.0.0.1:{port}"
        try:
            proc.wait_healthy(url + health_path, timeout_s)
            return proc, url
        except RuntimeError:
            proc.stop()
            if not proc.bind_failed() or attempt == START_ATTEMPTS - 1:
                raise
            print(f"{name}: port {port} was taken before it bound; retrying on another", flush=True)
    raise AssertionError("unreachable")


class VLLMServer:
    """Standalone ``vllm serve`` (its OpenAI server module, run by this Python) with ``shape``'s engine
    arguments; ``extra``: more flags (e.g. ``--enable-prompt-tokens-details``, ``--kv-events-config``)."""

    def __init__(self, name: str, workdir: Path, shape: EngineShape, extra: list[str] | None = None,
                 timeout_s: float = 600.0) -> None:
        model_dir, block_bytes = default_model()
        self.name = name
        self.args = [*shape.serve_args(model_dir, block_bytes), *(extra or [])]
        self.engine_args = len(self.args) - len(extra or [])
        env = {**VLLM_ENV, "OMP_NUM_THREADS": str(shape.threads)}

        def cmd(port: int) -> list[str]:
            return [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--host", "127.0.0.1", "--port",
                    str(port), *self.args]
        self.log = workdir / f"{name}.log"
        self.proc, self.url = start_with_port(name, cmd, "/health", self.log, env, timeout_s)
        self.model = json.loads(_get(self.url + "/v1/models")[1])["data"][0]["id"]

    def command(self, model_dir: str) -> str:
        """``vllm serve`` and the engine's flags for the report, the model directory shortened (the caller says
        what it added)."""
        return "vllm serve " + " ".join("<model dir>" if a == model_dir else a for a in self.args[1:self.engine_args])

    def stop(self) -> None:
        self.proc.stop()


class Router:
    """A router binary in front of ``workers`` (base URLs): ``vllm-router`` or ``sglang-router``'s
    ``launch_router``, given its flags; ``wrap``: a command it runs under (e.g. ``taskset -c 0``)."""

    def __init__(self, name: str, workdir: Path, kind: str, workers: list[str], flags: list[str],
                 env: dict[str, str] | None = None, timeout_s: float = 180.0, wrap: list[str] | None = None) -> None:
        self.name, self.kind, self.flags = name, kind, flags
        if kind == "vllm-router":
            exe = shutil.which("vllm-router", path=str(Path(sys.executable).parent)) or "vllm-router"
            base = [exe]
        elif kind == "sglang-router":
            base = [sys.executable, "-m", "sglang_router.launch_router"]
        else:
            raise ValueError(f"unknown router {kind!r}: vllm-router or sglang-router")
        self.log = workdir / f"{name}.log"

        self.metrics_url = ""

        def cmd(port: int) -> list[str]:
            metrics = free_port()
            self.metrics_url = f"http://127.0.0.1:{metrics}/metrics"
            return [*(wrap or []), *base, "--host", "127.0.0.1", "--port", str(port), "--worker-urls", *workers,
                    "--prometheus-port", str(metrics), *flags]
        self.proc, self.url = start_with_port(name, cmd, "/health", self.log, env, timeout_s)

    def save_metrics(self) -> None:
        """Its Prometheus text next to its log (what it saw: requests per worker, KV events indexed), if any."""
        status, body = _get(self.metrics_url, 10.0)
        if status == 200:
            self.log.with_suffix(".metrics").write_bytes(body)

    def stop(self) -> None:
        self.proc.stop(10.0)


def kvmesh_stack(workdir: Path, name: str, shape: EngineShape, both: int, pool: bool = True,
                 router: dict | None = None, cachesvc: dict | None = None, timeout_s: float = 600.0) -> Stack:
    """``kvmesh up --engine-backend vllm --prefill 0 --decode 0 --both N`` with ``shape``'s engine arguments, in
    ``workdir`` (its state directory), started."""
    opts = StackOptions.local(name, prefill=0, decode=0, both=both, pool=pool,
                              settings={"engine": shape.kvmesh_engine(), "router": router or {},
                                        "cachesvc": cachesvc or {}})
    stack = Stack(workdir, opts)
    stack.start(timeout_s=timeout_s)
    return stack


POOL_FETCH = ("kvmesh_worker_kv_transfer_bytes_total", {"direction": "pool_fetch"})  # an instance's pool fetches


def instance_metric(url: str, name: str, labels: dict[str, str], attempts: int = 5) -> float:
    """One sample of an instance's Prometheus text (0 when the instance has none yet); RuntimeError when its
    /metrics does not answer (a before / after difference must not take a missing reading for 0)."""
    from prometheus_client.parser import text_string_to_metric_families

    for _ in range(attempts):
        status, body = _get(url, 30.0)
        if status == 200:
            return sum(s.value for fam in text_string_to_metric_families(body.decode()) for s in fam.samples
                       if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()))
        time.sleep(1.0)
    raise RuntimeError(f"{url} did not answer")
