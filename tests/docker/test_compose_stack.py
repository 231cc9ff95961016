"""The compose stack for real: the images built, the stack up with docker-compose on the host network
(compose.yaml + compose.hostnet.yaml, everything on 127.0.0.1), an OpenAI chat request through the router, the
decode container killed mid-stream with the docker SDK, a decode back, and everything torn down.

Marked ``docker`` (its own CI stage, minutes). It starts dockerd itself when it is root and the binary is
there, and skips, saying why, only where no Docker engine can be started.
"""

from __future__ import annotations

import http.client
import json
import os
import re
import shutil
import subprocess
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.ports import guess_free_port

pytestmark = pytest.mark.docker

ROOT = Path(__file__).resolve().parents[2]
FILES = ["-f", "compose.yaml", "-f", "compose.hostnet.yaml"]
BUILD_TIMEOUT_S = 1200
QUESTION = [{"role": "user", "content": "What is the capital of France?"}]
# The compose stack runs on the host network with ports passed in the environment: they cannot be 0, since the
# router's and cachesvc's ports must be known to the other containers before they start. So they are guesses that
# another process can take first; a service that finds its port taken says so (kvmesh.ready's "port N is in use",
# nats-server's "address already in use") and exits, and the bring-up retries on new guesses.
PORT_TRIES = 3
PORT_TAKEN = re.compile(r"port \d+ is in use|address already in use")


class PortTaken(Exception):
    """A container could not bind one of the guessed ports."""


def _docker_sdk():
    import docker

    if not hasattr(docker, "from_env"):  # the repository's docker/ folder, not the SDK
        pytest.fail("the docker Python SDK is not installed: pip install 'docker>=7' (the dev extra has it)")
    return docker


@pytest.fixture(scope="module")
def engine(tmp_path_factory: pytest.TempPathFactory) -> Iterator[object]:
    """A Docker engine: the running one, else dockerd started here (root only) without the default bridge,
    whose private-range addresses tests must not use."""
    docker = _docker_sdk()
    started = None
    try:
        client = docker.from_env()
        client.ping()
    except docker.errors.DockerException as e:
        dockerd = shutil.which("dockerd")
        if dockerd is None or os.geteuid() != 0:
            pytest.skip(f"no Docker engine ({e}) and none can be started here: "
                        + ("dockerd is not installed (apt-get install docker.io)" if dockerd is None
                           else "starting dockerd needs root"))
        log = tmp_path_factory.mktemp("dockerd") / "dockerd.log"
        started = subprocess.Popen([dockerd, "--bridge=none", "--iptables=false", "--ip6tables=false"],
                                   stdout=open(log, "wb"), stderr=subprocess.STDOUT,  # noqa: SIM115 - dockerd keeps it
                                   start_new_session=True)
        client = _wait_for_engine(docker, started, log)
    if shutil.which("docker-compose") is None:
        pytest.skip("docker-compose is not installed (apt-get install docker-compose)")
    yield client
    client.close()
    if started is not None:
        started.terminate()
        started.wait(60)


def _wait_for_engine(docker, proc: subprocess.Popen, log: Path):
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            pytest.skip(f"dockerd exited with {proc.returncode}: {log.read_text()[-500:]}")
        try:
            client = docker.from_env()
            client.ping()
            return client
        except docker.errors.DockerException:
            time.sleep(0.5)
    proc.terminate()
    pytest.skip(f"dockerd did not answer within 60 s: {log.read_text()[-500:]}")


class Stack:
    """One compose project on the host network, with its own ports, passwords, API key and volumes."""

    def __init__(self) -> None:
        self.project = f"kvmeshtest{uuid.uuid4().hex[:8]}"
        self.api_key = "sk-" + uuid.uuid4().hex
        self.env = {
            **os.environ, "KVMESH_ROUTER_API_KEY": self.api_key,
            "KVMESH_CLUSTER": "dockertest",
        }
        self.guess_ports()

    def guess_ports(self) -> None:
        """New guesses for the host ports (see PORT_TAKEN)."""
        self.http_port = guess_free_port()
        self.env.update({"KVMESH_NATS_PORT": str(guess_free_port()), "KVMESH_CACHESVC_PORT": str(guess_free_port()),
                         "KVMESH_ROUTER_HTTP_PORT": str(self.http_port),
                         "KVMESH_ROUTER_GRPC_PORT": str(guess_free_port())})

    def logs(self, tail: int = 40) -> str:
        return subprocess.run(["docker-compose", "-p", self.project, *FILES, "logs", "--tail", str(tail)], cwd=ROOT,
                              env=self.env, capture_output=True, text=True, check=False).stdout

    def compose(self, *args: str, timeout_s: float = 600) -> str:
        out = subprocess.run(["docker-compose", "-p", self.project, *FILES, *args], cwd=ROOT, env=self.env,
                             capture_output=True, text=True, timeout=timeout_s, check=False)
        if out.returncode != 0:
            raise AssertionError(f"docker-compose {' '.join(args)} failed ({out.returncode}):\n"
                                 f"{out.stdout[-3000:]}\n{out.stderr[-3000:]}")
        return out.stdout

    def container(self, client, service: str):
        labels = [f"com.docker.compose.project={self.project}", f"com.docker.compose.service={service}"]
        found = client.containers.list(all=True, filters={"label": labels})
        assert len(found) == 1, f"{service}: {len(found)} containers"
        return found[0]

    def request(self, method: str, path: str, body: dict | None = None, key: str | None = "default",
                timeout_s: float = 120) -> tuple[int, dict]:
        conn = http.client.HTTPConnection("127.0.0.1", self.http_port, timeout=timeout_s)
        headers = {"content-type": "application/json"}
        if key:
            headers["authorization"] = f"Bearer {self.api_key if key == 'default' else key}"
        conn.request(method, path, json.dumps(body) if body is not None else None, headers)
        resp = conn.getresponse()
        data = json.loads(resp.read() or b"{}")
        conn.close()
        return resp.status, data

    def health(self) -> tuple[int, dict]:
        try:
            return self.request("GET", "/health", key=None, timeout_s=5)
        except (OSError, ValueError):
            return 0, {}

    def wait_healthy(self, timeout_s: float) -> None:
        """Until the router answers /health; raises PortTaken as soon as a container says its port is taken."""
        deadline = time.monotonic() + timeout_s
        checked = time.monotonic()
        while (status := self.health())[0] != 200:
            if time.monotonic() - checked > 5:
                checked = time.monotonic()
                if PORT_TAKEN.search(self.logs(tail=20)):
                    raise PortTaken
            assert time.monotonic() < deadline, f"router not healthy within {timeout_s:g}s: {status}"
            time.sleep(1)


@pytest.fixture(scope="module")
def stack(engine) -> Iterator[Stack]:
    s = Stack()
    base = subprocess.run([str(ROOT / "docker/prepare.sh")], capture_output=True, text=True, env=s.env,
                          timeout=900, check=False)
    assert base.returncode == 0, f"docker/prepare.sh failed:\n{base.stderr[-3000:]}"
    s.env["KVMESH_BASE_IMAGE"] = base.stdout.strip()
    t0 = time.monotonic()
    s.compose("build", timeout_s=BUILD_TIMEOUT_S)
    print(f"\nimages built on {s.env['KVMESH_BASE_IMAGE']} in {time.monotonic() - t0:.0f} s")
    try:
        t0 = time.monotonic()
        for attempt in range(PORT_TRIES):
            s.compose("up", "-d", "--no-build")
            try:
                s.wait_healthy(240)
                break
            except PortTaken:
                if attempt == PORT_TRIES - 1:
                    raise AssertionError(f"a guessed port was taken {PORT_TRIES} times:\n{s.logs()}") from None
                print(f"a guessed port was taken: retrying on other ports\n{s.logs(tail=5)}")
                s.compose("down", "-v", "--remove-orphans", "--timeout", "20")
                s.guess_ports()
        print(f"stack healthy in {time.monotonic() - t0:.0f} s")
        yield s
    except BaseException:
        print(s.logs()[-8000:])
        raise
    finally:
        s.compose("down", "-v", "--remove-orphans", "--timeout", "20")


def stream_until_killed(s: Stack, kill) -> list[dict]:
    """Start a long streamed chat completion, call ``kill()`` after its third content chunk, and return every
    event that follows until the stream ends."""
    conn = http.client.HTTPConnection("127.0.0.1", s.http_port, timeout=60)
    body = {"messages": [{"role": "user", "content": "Tell me a long story about a dragon."}],
            "max_tokens": 512, "temperature": 0, "ignore_eos": True, "stream": True}
    conn.request("POST", "/v1/chat/completions", json.dumps(body),
                 {"content-type": "application/json", "authorization": f"Bearer {s.api_key}"})
    resp = conn.getresponse()
    assert resp.status == 200, resp.read()
    content, after = 0, []
    for raw in resp:
        line = raw.decode().strip()
        if not line.startswith("data: "):
            continue
        data = line[len("data: "):]
        event = {"done": True} if data == "[DONE]" else json.loads(data)
        if content >= 3:
            after.append(event)
        elif event.get("choices") and event["choices"][0]["delta"].get("content"):
            content += 1
            if content == 3:
                kill()
        if "done" in event:
            break
    conn.close()
    return after


def test_the_stack_answers_a_chat_request_through_the_router(stack):
    status, body = stack.request("POST", "/v1/chat/completions",
                                 {"messages": QUESTION, "max_tokens": 16, "temperature": 0})
    assert status == 200, body
    assert "Paris" in body["choices"][0]["message"]["content"]
    assert body["model"] == "SmolLM2-135M-Instruct"
    status, body = stack.request("POST", "/v1/chat/completions", {"messages": QUESTION}, key="sk-wrong")
    assert status == 401 and body["error"]["type"] == "authentication_error"


def test_every_service_is_healthy_and_runs_as_a_non_root_user(stack, engine):
    for service in ("nats", "cachesvc", "prefill", "decode", "router-host"):
        c = stack.container(engine, service)
        deadline = time.monotonic() + 30  # docker runs the healthcheck every 5 s
        while (c.reload() or c.attrs["State"]["Health"])["Status"] != "healthy":
            assert time.monotonic() < deadline, (service, c.attrs["State"]["Health"])
            time.sleep(1)
        assert c.attrs["Config"]["User"] == "kvmesh", service


def test_router_and_cachesvc_images_hold_no_torch(stack, engine):
    code = "import importlib.util as u; print([m for m in ('torch', 'transformers', 'safetensors') if u.find_spec(m)])"
    probe = ["python", "-c", code]
    for service in ("router-host", "cachesvc", "prefill"):
        status, out = stack.container(engine, service).exec_run(probe)
        assert status == 0, out
        found = out.decode().strip()
        assert (found == "[]") == (service != "prefill"), (service, found)  # the engines have them


def test_decode_killed_mid_stream_is_a_clear_error_and_the_router_serves_again_when_decode_is_back(
        stack, engine):
    decode, router = stack.container(engine, "decode"), stack.container(engine, "router-host")
    after = stream_until_killed(stack, lambda: decode.kill())
    errors = [e["error"] for e in after if "error" in e]
    assert errors and errors[0]["code"] == 503 and errors[0]["type"] == "service_unavailable", after
    assert "done" in after[-1]
    assert not any(c.get("finish_reason") for e in after for c in e.get("choices", [])), "it cannot finish"

    deadline = time.monotonic() + 30  # the router drops decode once its heartbeats stop
    while (health := stack.health())[0] != 503:
        assert time.monotonic() < deadline, f"router still reports {health}"
        time.sleep(0.5)
    status, body = stack.request("POST", "/v1/chat/completions", {"messages": QUESTION, "max_tokens": 8})
    assert status == 503 and "decode" in body["error"]["message"], body
    router.reload()
    assert router.status == "running"

    # decode back, and one more beside it: on the host network each replica takes its own port and instance id
    stack.compose("up", "-d", "--no-build", "--no-deps", "--scale", "decode=2", "decode")
    deadline = time.monotonic() + 180
    while (health := stack.health()) != (200, {"ok": True, "instances": 3}):
        assert time.monotonic() < deadline, f"router does not see 1 prefill + 2 decode: {health}"
        time.sleep(1)
    status, body = stack.request("POST", "/v1/chat/completions",
                                 {"messages": QUESTION, "max_tokens": 16, "temperature": 0})
    assert status == 200 and "Paris" in body["choices"][0]["message"]["content"], body
