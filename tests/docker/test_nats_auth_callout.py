"""The NATS pod of ``deploy/k8s/components/nats-auth-callout`` run for real, as the ``pd`` overlay renders it: the
``kvmesh/nats`` image built from docker/Dockerfile, nats-server on the rendered ConfigMap's nats.conf with the
issuer's public key in its environment, and the ``nats-auth`` sidecar with its rendered command, environment and
mount paths, the two sharing one network namespace as a pod's containers do, as the pod's user (10001). A member
container in the same namespace then connects with certificates of engine pods no configuration names: each is
authorised as itself and refused another pod's subjects; the sidecar's probe file exists.

Marked ``docker`` (``make compose-test``). Nothing is published on the host: the pod's namespace has no network
but its loopback (``network_mode="none"``), so no port is guessed."""

from __future__ import annotations

import os
import subprocess
import textwrap
import time
from pathlib import Path

import pytest
from kvmesh.bus import auth_callout
from kvmesh.identity import Identity, MeshRole
from kvmesh.mesh_ca import MeshCA

from tests.deploy.test_manifests import render
from tests.docker.test_compose_stack import BUILD_TIMEOUT_S, ROOT, engine  # noqa: F401 - the engine fixture

pytestmark = pytest.mark.docker
IMAGE = "kvmesh/nats:auth-callout-test"
USER = 10001
CLUSTER = "default"  # the rendered overlay's

MEMBER = textwrap.dedent("""
    import asyncio, logging, sys, time
    from kvmesh import tls
    from kvmesh.bus import Bus, Subjects
    from kvmesh.contracts.messages import Heartbeat, InstanceLoad
    from kvmesh.settings import SharedSettings

    def member(name: str) -> SharedSettings:
        return SharedSettings(tls_cert=f"/certs/{name}.pem", tls_key=f"/certs/{name}.key", tls_ca="/certs/ca.pem",
                              tls_server_name="kvmesh.mesh")

    async def main(pod: str, other: str) -> None:
        s = Subjects("CLUSTER_NAME")
        url = "nats://127.0.0.1:4222"
        router = await Bus.connect(url, "router", tls=tls.bus_tls(member("router")), connect_timeout_s=20)
        bus = await Bus.connect(url, pod, tls=tls.bus_tls(member(pod)), connect_timeout_s=20)
        got = asyncio.Queue()
        async def heard(m):
            await got.put(m.subject)
        await router.nc.subscribe(s.heartbeats_all, cb=heard)
        await router.nc.flush()
        beat = lambda who: Heartbeat(instance_id=who, role="prefill", grpc_address="x:1", transfer_address="",
                                     ts=time.time(), load=InstanceLoad(), model="m", block_size=16)
        await bus.publish(s.heartbeat("prefill", pod), beat(pod))
        print("own:", await asyncio.wait_for(got.get(), 10), flush=True)
        await bus.publish(s.heartbeat("prefill", other), beat(other))
        await asyncio.sleep(1)
        while not got.empty():
            print("also:", got.get_nowait(), flush=True)
        await bus.close()
        await router.close()

    logging.basicConfig(level=logging.WARNING, stream=sys.stdout)
    asyncio.run(main(sys.argv[1], sys.argv[2]))
""").replace("CLUSTER_NAME", CLUSTER)


def _rendered() -> tuple[dict, dict, str, str]:
    """The pd overlay's nats container, its nats-auth sidecar, the one-node nats.conf and where a node reads it:
    a node of pd's three runs components/nats-cluster's cluster.conf, which includes that file (by a path relative
    to its own) and adds the routes, whose peers resolve only in the cluster; one node runs the included file."""
    objects = render("pd")
    (nats_set,) = [o for o in objects if o["kind"] == "StatefulSet" and o["metadata"]["name"] == "nats"]
    containers = {c["name"]: c for c in nats_set["spec"]["template"]["spec"]["containers"]}
    (conf,) = [o["data"]["nats.conf"] for o in objects if o["kind"] == "ConfigMap" and "nats.conf" in o.get("data", {})]
    args = containers["nats"]["args"]
    path = args[args.index("-c") + 1]
    clusters = [o["data"]["cluster.conf"] for o in objects
                if o["kind"] == "ConfigMap" and "cluster.conf" in o.get("data", {})]
    if clusters and path.endswith("/cluster.conf"):
        (include,) = [line.split(None, 1)[1].strip().strip('"') for line in clusters[0].splitlines()
                      if line.startswith("include ")]
        path = os.path.normpath(os.path.join(os.path.dirname(path), include))
    return containers["nats"], containers["nats-auth"], conf, path


def _files(tmp: Path) -> dict[str, Path]:
    """The Secrets' files, as the pod would mount them: the mesh CA, nats-server's and the sidecar's certificates,
    two engine pods', the issuer's seed; readable by the pod's user."""
    ca = MeshCA.open(tmp / "ca")
    out = {"certs": tmp / "certs", "nats-tls": tmp / "nats-tls", "auth-tls": tmp / "auth-tls", "issuer": tmp / "issuer",
           "conf": tmp / "conf", "data": tmp / "data"}
    for d in out.values():
        d.mkdir()
    for name, who in (("nats-tls", Identity(MeshRole.CLIENT, "nats")), ("auth-tls", Identity(MeshRole.CLIENT,
                                                                                             "nats-auth"))):
        files = ca.issue(who)
        for src, dst in ((files.cert, "tls.crt"), (files.key, "tls.key"), (files.ca, "ca.crt")):
            (out[name] / dst).write_bytes(Path(src).read_bytes())
    for name, who in (("prefill-7d9f-abcde", Identity(MeshRole.PREFILL, "prefill-7d9f-abcde")),
                      ("prefill-7d9f-zzzzz", Identity(MeshRole.PREFILL, "prefill-7d9f-zzzzz")),
                      ("router", Identity(MeshRole.ROUTER, "router"))):  # the router's role certificate
        files = ca.issue(who)
        (out["certs"] / f"{name}.pem").write_bytes(files.cert.read_bytes())
        (out["certs"] / f"{name}.key").write_bytes(files.key.read_bytes())
    (out["certs"] / "ca.pem").write_bytes(ca.ca_path.read_bytes())
    (out["certs"] / "member.py").write_text(MEMBER)
    seed = auth_callout.new_issuer_seed()
    (out["issuer"] / "seed").write_bytes(seed + b"\n")
    out["public"] = Path(auth_callout.public_key(auth_callout.issuer_from_seed(seed)))
    for root, dirs, names in os.walk(tmp):
        for n in dirs + names:
            os.chown(os.path.join(root, n), USER, USER)
    return out


def test_the_rendered_nats_pod_authorises_each_engine_pod_as_itself(engine, tmp_path):  # noqa: F811
    nats, sidecar, conf, conf_path = _rendered()
    assert sidecar["image"].startswith("kvmesh/nats:"), sidecar["image"]
    base = subprocess.run([str(ROOT / "docker/prepare.sh")], capture_output=True, text=True, timeout=900,
                          check=False)  # the base image the compose stage builds on (a local one offline)
    assert base.returncode == 0, f"docker/prepare.sh failed:\n{base.stderr[-3000:]}"
    built = subprocess.run(["docker", "build", "-f", "docker/Dockerfile", "--target", "nats", "--network", "host",
                            "--build-arg", f"BASE={base.stdout.strip()}", "-t", IMAGE, "."],
                           cwd=ROOT, capture_output=True, text=True, timeout=BUILD_TIMEOUT_S, check=False)
    assert built.returncode == 0, built.stderr[-3000:]
    files = _files(tmp_path)
    conf_dir = Path(conf_path).parent
    (files["conf"] / Path(conf_path).name).write_text(conf)
    os.chown(files["conf"] / Path(conf_path).name, USER, USER)
    seed_path = Path(sidecar["args"][sidecar["args"].index("--issuer-seed") + 1])
    mounts = {v["name"]: v["mountPath"] for v in sidecar["volumeMounts"]}
    env = {v["name"]: v["value"] for v in sidecar["env"] if "value" in v}
    # one node: on the one-node file, without the node's name flag (its peers resolve only in the cluster)
    alone = nats["args"][:nats["args"].index("--server_name")] if "--server_name" in nats["args"] else nats["args"]
    alone = [conf_path if a == nats["args"][nats["args"].index("-c") + 1] else a for a in alone]
    started = []
    try:
        pod = engine.containers.run(
            IMAGE, alone, detach=True, network_mode="none", user=f"{USER}:{USER}",
            environment={"AUTH_CALLOUT_ISSUER": str(files["public"])},
            volumes={str(files["nats-tls"]): {"bind": "/etc/kvmesh/tls", "mode": "ro"},
                     str(files["conf"]): {"bind": str(conf_dir), "mode": "ro"},
                     str(files["data"]): {"bind": "/data", "mode": "rw"}})
        started.append(pod)
        auth = engine.containers.run(
            IMAGE, sidecar["args"], detach=True, network_mode=f"container:{pod.id}", user=f"{USER}:{USER}",
            environment=env,
            volumes={str(files["auth-tls"]): {"bind": mounts["nats-auth-tls"], "mode": "ro"},
                     str(files["issuer"]): {"bind": str(seed_path.parent), "mode": "ro"}})
        started.append(auth)
        probe = sidecar["readinessProbe"]["exec"]["command"]
        deadline = time.monotonic() + 60
        while auth.exec_run(probe).exit_code != 0:  # the sidecar's own readiness, as kubelet asks it
            auth.reload()
            assert auth.status == "running" and time.monotonic() < deadline, auth.logs()[-3000:].decode()
            time.sleep(0.5)
        member = engine.containers.run(
            IMAGE, ["python", "/certs/member.py", "prefill-7d9f-abcde", "prefill-7d9f-zzzzz"], detach=True,
            network_mode=f"container:{pod.id}", user=f"{USER}:{USER}",
            volumes={str(files["certs"]): {"bind": "/certs", "mode": "ro"}})
        started.append(member)
        result = member.wait(timeout=120)
        out = member.logs().decode()
        assert result["StatusCode"] == 0, out + auth.logs()[-2000:].decode() + pod.logs()[-2000:].decode()
        assert f"own: kvmesh.{CLUSTER}.heartbeat.prefill.prefill-7d9f-abcde" in out, out
        assert 'permissions violation for publish to "kvmesh.default.heartbeat.prefill.prefill-7d9f-zzzzz"' \
            in out.lower() and "also:" not in out, out
        assert "authorised spiffe://kvmesh/prefill/prefill-7d9f-abcde" in auth.logs().decode()
    finally:
        for c in reversed(started):
            c.remove(force=True)
