"""``kvmesh plan``: how many prefill and decode (or both) instances the running stack needs for its TTFT / ITL
targets, from one window of its heartbeats (NATS) and its routers' counters (``/metrics``), by
``kvmesh.planning.plan``. ``--serve`` plans every window and hands each change to an actuator:

- ``print`` (default): say it;
- ``local``: ask the ``kvmesh up`` running in the state directory for the pool's size (``pools.json``, which it
  reconciles: it starts ``<role>-<next index>``, or SIGTERMs its newest instance, whose routers retry and migrate
  what it held, ``app/launcher.py``);
- ``kubernetes``: set the pool's Deployment ``spec.replicas`` through the API server's ``scale`` subresource
  (``PATCH .../deployments/NAME/scale``, what ``kubectl scale`` does), with the pod's service-account token —
  the planner is the autoscaler, so the pools must not also have an HPA.

The stack is found as ``kvmesh trace`` finds it (``--state-dir``, ``$KVMESH_STATE_DIR``, ``.kvmesh/``), or, in a
cluster, named: ``--nats-url``, ``--cluster`` and ``--router-metrics`` (a name that resolves to every router pod,
a headless Service: each is scraped). ``--health-port`` serves ``GET /health`` (200 once a plan was made) for a
pod's probes."""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import re
import ssl
import statistics
import sys
import time
import urllib.request
from collections import deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from kvmesh.contracts.ids import Role
from kvmesh.planning import (
    InstanceLoad,
    Observation,
    Plan,
    PlannerConfig,
    PlannerState,
    Speed,
    Targets,
    Traffic,
    plan,
    pools_of,
)
from kvmesh.planning.signals import QUANTILES

if TYPE_CHECKING:
    from kvmesh.settings import SharedSettings

SA_DIR = Path("/var/run/secrets/kubernetes.io/serviceaccount")
COUNTERS = ("kvmesh_router_requests_total", "kvmesh_router_prompt_tokens_total",
            "kvmesh_router_prefix_hit_tokens_total", "kvmesh_router_ttft_seconds_sum",
            "kvmesh_router_ttft_seconds_count")


PROMPTS = "kvmesh_router_computed_prompt_tokens_bucket"  # the routers' histogram of computed prompt lengths


def counters(text: str) -> dict[str, float]:
    """The sums of ``COUNTERS`` over their labels in a Prometheus text exposition, and each bucket of the
    computed-prompt histogram (``PROMPTS``, keyed ``PROMPTS:<le>``) summed over its other labels."""
    out = dict.fromkeys(COUNTERS, 0.0)
    for line in text.splitlines():
        m = re.match(r"^([a-z_]+)(\{[^}]*\})?\s+([0-9.eE+-]+)$", line)
        if not m:
            continue
        if m.group(1) in COUNTERS:
            out[m.group(1)] += float(m.group(3))
        elif m.group(1) == PROMPTS and (le := re.search(r'le="([^"]+)"', m.group(2) or "")):
            key = f"{PROMPTS}:{le.group(1)}"
            out[key] = out.get(key, 0.0) + float(m.group(3))
    return out


def prompt_spread(before: Mapping[str, float], after: Mapping[str, float]) -> tuple[float, tuple[float, ...]]:
    """The window's computed prompt lengths from the histogram's buckets: the mean of their squares and
    ``QUANTILES`` evenly spaced quantiles (linear within a bucket; the last finite bound for the open one), as
    ``Traffic`` takes them; ``(0.0, ())`` without the histogram or requests (the planner then assumes
    exponential lengths)."""
    edges = sorted((float(k.split(":", 1)[1]), k) for k in after if k.startswith(PROMPTS + ":"))
    cumulative = [max(0.0, after[k] - before.get(k, 0.0)) for _, k in edges]
    if not cumulative or cumulative[-1] <= 0:
        return 0.0, ()
    bounds = [b for b, _ in edges]
    finite = max((b for b in bounds if math.isfinite(b)), default=0.0)
    out = []
    for i in range(QUANTILES):
        target = (i + 0.5) / QUANTILES * cumulative[-1]
        j = next(j for j, c in enumerate(cumulative) if c >= target)
        low, high = (bounds[j - 1], cumulative[j - 1]) if j else (0.0, 0.0)
        top = bounds[j] if math.isfinite(bounds[j]) else finite
        share = (target - high) / (cumulative[j] - high) if cumulative[j] > high else 1.0
        out.append(low + share * (top - low))
    return statistics.fmean(q * q for q in out), tuple(out)


def traffic(before: Mapping[str, float], after: Mapping[str, float], window_s: float,
            output_tokens: float) -> Traffic:
    """The window's traffic from two scrapes of the routers' counters (finished requests, their prompt and
    cached tokens); ``output_tokens``: the mean output the routers do not count."""
    d = {k: max(0.0, after[k] - before[k]) for k in COUNTERS}
    n = d["kvmesh_router_requests_total"]
    if n <= 0:
        return Traffic(0.0, 0.0, output_tokens)
    prompt = d["kvmesh_router_prompt_tokens_total"]
    sq, quantiles = prompt_spread(before, after)
    return Traffic(n / window_s, prompt / n, output_tokens,
                   min(0.99, d["kvmesh_router_prefix_hit_tokens_total"] / prompt) if prompt else 0.0, sq, quantiles)


def mean_ttft(before: Mapping[str, float], after: Mapping[str, float]) -> float:
    """The mean TTFT of the window's first tokens, from two scrapes of the routers' histogram (0: none)."""
    n = after["kvmesh_router_ttft_seconds_count"] - before["kvmesh_router_ttft_seconds_count"]
    return max(0.0, after["kvmesh_router_ttft_seconds_sum"] - before["kvmesh_router_ttft_seconds_sum"]) / n \
        if n > 0 else 0.0


def fan_out(url: str) -> list[str]:
    """``url`` once per address its host resolves to (a headless Service: every router pod), in order."""
    import socket
    from urllib.parse import urlsplit

    parts = urlsplit(url)
    try:
        found = socket.getaddrinfo(parts.hostname or "", parts.port or 80, type=socket.SOCK_STREAM)
    except OSError:
        return [url]  # unresolvable now: the scrape says so
    hosts = list(dict.fromkeys(str(a[4][0]) for a in found))
    return [parts._replace(netloc=f"[{h}]:{parts.port or 80}" if ":" in h else f"{h}:{parts.port or 80}").geturl()
            for h in hosts] or [url]


def scrape(urls: list[str]) -> dict[str, float]:
    total = dict.fromkeys(COUNTERS, 0.0)
    for url in (u for named in urls for u in fan_out(named)):
        with urllib.request.urlopen(url, timeout=5) as r:
            for k, v in counters(r.read().decode()).items():
                total[k] = total.get(k, 0.0) + v
    return total


def operator_settings(state_dir: Path | None) -> SharedSettings | None:
    """The operator's mesh certificate ``kvmesh up`` made in ``state_dir`` (``tls/admin-operator.*``), as
    ``[shared]`` TLS settings; None: it made none."""
    from kvmesh.mesh_ca import CertFiles
    from kvmesh.settings import SharedSettings

    if state_dir is None or not (state_dir / "tls" / "admin-operator.pem").is_file():
        return None
    files = CertFiles(*(state_dir / "tls" / f for f in ("admin-operator.pem", "admin-operator.key", "ca.pem")))
    return SharedSettings(**{k.removeprefix("KVMESH_").lower(): v for k, v in files.env().items()})


async def heartbeats(nats_url: str, cluster: str, window_s: float, state_dir: Path | None = None) -> list[InstanceLoad]:
    """The last heartbeat of every engine instance heard within ``window_s``. A mesh NATS server takes mesh
    certificates only: the operator's one of ``state_dir`` (``operator_settings``), else that of ``KVMESH_TLS_*``
    (an admin certificate may read heartbeats)."""
    from kvmesh import tls
    from kvmesh.bus.bus import Bus
    from kvmesh.bus.subjects import Subjects
    from kvmesh.contracts.messages import Heartbeat

    seen: dict[str, InstanceLoad] = {}

    async def on_beat(beat: object, headers: dict[str, str]) -> None:
        if not (isinstance(beat, Heartbeat) and beat.role.is_engine):
            return
        if beat.draining:  # stopping: no longer capacity
            seen.pop(beat.instance_id, None)
        else:
            seen[beat.instance_id] = InstanceLoad.from_beat(beat.instance_id, beat.role, beat.load, beat.block_size)

    bus = await Bus.connect(nats_url, "kvmesh-plan", tls=tls.bus_tls(operator_settings(state_dir)))
    try:
        await bus.subscribe(Subjects(cluster).heartbeats_all, on_beat)
        await asyncio.sleep(window_s)
    finally:
        await bus.close()
    return list(seen.values())


@dataclass
class Kubernetes:
    """Scales a pool's Deployment through the API server (the ``scale`` subresource, a JSON merge patch of
    ``spec.replicas``). ``deployments``: pool role -> Deployment name. In a pod: the service-account token, CA
    and namespace under ``SA_DIR`` and the API server from ``KUBERNETES_SERVICE_HOST``/``_PORT``."""

    server: str
    namespace: str
    deployments: Mapping[Role, str]
    token: str = ""
    context: ssl.SSLContext | None = None

    @classmethod
    def in_cluster(cls, deployments: Mapping[Role, str], namespace: str | None = None) -> Kubernetes:
        import os

        host, port = os.environ.get("KUBERNETES_SERVICE_HOST"), os.environ.get("KUBERNETES_SERVICE_PORT", "443")
        if not host:
            raise RuntimeError("not in a Kubernetes pod: KUBERNETES_SERVICE_HOST is unset (pass --k8s-server)")
        ctx = ssl.create_default_context(cafile=str(SA_DIR / "ca.crt"))
        return cls(f"https://{host}:{port}", namespace or (SA_DIR / "namespace").read_text().strip(), deployments,
                   (SA_DIR / "token").read_text().strip(), ctx)

    def _call(self, method: str, path: str, body: dict | None = None) -> dict:
        req = urllib.request.Request(f"{self.server}{path}", method=method,
                                     data=json.dumps(body).encode() if body is not None else None)
        if self.token:
            req.add_header("Authorization", f"Bearer {self.token}")
        if body is not None:
            req.add_header("Content-Type", "application/merge-patch+json")
        req.add_header("Accept", "application/json")
        with urllib.request.urlopen(req, timeout=10, context=self.context) as r:
            result: dict = json.loads(r.read())
            return result

    def _path(self, role: Role) -> str:
        return f"/apis/apps/v1/namespaces/{self.namespace}/deployments/{self.deployments[role]}/scale"

    def replicas(self, role: Role) -> int:
        return int(self._call("GET", self._path(role)).get("spec", {}).get("replicas", 0))

    def scale(self, role: Role, replicas: int) -> None:
        self._call("PATCH", self._path(role), {"spec": {"replicas": replicas}})


@dataclass
class Health:
    """``GET /health`` for a planner pod's probes: 200 with the plans made so far once there is one, else 503."""

    plans: int = 0
    port: int = 0  # the port bound

    @classmethod
    def serve(cls, port: int, host: str = "0.0.0.0") -> Health:
        import threading
        from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

        health = cls()

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                ok = self.path.partition("?")[0] == "/health"
                code = 404 if not ok else 200 if health.plans else 503
                body = json.dumps({"plans": health.plans}).encode()
                self.send_response(code)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args: object) -> None:
                pass

        server = ThreadingHTTPServer((host, port), Handler)
        health.port = server.server_address[1]
        threading.Thread(target=server.serve_forever, daemon=True, name="plan-health").start()
        return health


def act(p: Plan, scale: Callable[[Role, int], None]) -> list[str]:
    """Hand each pool whose target differs from its size to ``scale``; what was done, in words."""
    done = []
    for pool in p.pools:
        if pool.target != pool.current:
            scale(pool.role, pool.target)
            done.append(f"{pool.role}: {pool.current} -> {pool.target}")
    return done


def parser() -> argparse.ArgumentParser:
    """The command line of ``kvmesh plan`` (the planner pod's manifest is checked against it)."""
    p = argparse.ArgumentParser(prog="kvmesh plan", description=__doc__.split("\n\n")[0])
    p.add_argument("--state-dir", help="the stack's state directory (default: $KVMESH_STATE_DIR, else .kvmesh/)")
    p.add_argument("--ttft-s", type=float, default=2.0, help="TTFT target, seconds")
    p.add_argument("--itl-s", type=float, default=0.1, help="ITL target, seconds")
    p.add_argument("--window-s", type=float, default=15.0, help="one observation's window")
    p.add_argument("--output-tokens", type=float, default=256.0,
                   help="mean output tokens per request (the routers do not count them)")
    p.add_argument("--startup-s", type=float, default=30.0, help="how long a new instance takes to serve")
    p.add_argument("--ttft-miss", type=float, default=0.01,
                   help="share of requests a prefill pool's queue may push past the TTFT target (its tail; 0: size "
                        "on the mean TTFT alone)")
    p.add_argument("--min", type=int, default=1, help="fewest instances per pool")
    p.add_argument("--max", type=int, default=16, help="most instances per pool")
    p.add_argument("--serve", action="store_true", help="plan every window and act on each change")
    p.add_argument("--actuator", default="print", choices=("print", "local", "kubernetes"))
    p.add_argument("--k8s-server", help="API server URL (default: in-cluster)")
    p.add_argument("--k8s-namespace", help="default: the pod's namespace")
    p.add_argument("--k8s-deployment", action="append", default=[], metavar="ROLE=NAME",
                   help="the Deployment of a pool (repeatable), e.g. prefill=kvmesh-prefill")
    p.add_argument("--nats-url", help="the fleet's NATS (in a cluster; default: the stack's, from stack.json)")
    p.add_argument("--cluster", default="default", help="with --nats-url: the kvmesh cluster name")
    p.add_argument("--router-metrics", action="append", default=[], metavar="URL",
                   help="with --nats-url: the routers' /metrics (repeatable); a host that resolves to several "
                        "addresses (a headless Service) is scraped at each")
    p.add_argument("--health-port", type=int, default=0, help="serve GET /health on this port (0: not)")
    p.add_argument("--json", action="store_true")
    return p


def main(argv: list[str] | None = None) -> int:
    p = parser()
    args = p.parse_args(argv)
    if not 0 <= args.ttft_miss < 1:
        p.error(f"--ttft-miss {args.ttft_miss} must be in [0, 1) (a share of requests)")
    from kvmesh import state

    directory = state.state_dir(args.state_dir)
    try:
        if args.nats_url:
            if not args.router_metrics:
                raise ValueError("--nats-url needs --router-metrics URL (the routers' /metrics)")
            nats_url, cluster, metrics = args.nats_url, args.cluster, list(args.router_metrics)
        else:
            info = state.StackInfo.read(directory)
            nats_url, cluster = info.nats_url, info.cluster
            metrics = [e["metrics"] for name, e in info.endpoints.items()
                       if name.startswith("router") and "metrics" in e]
        actuator = _actuator(args, directory)
    except (OSError, ValueError, RuntimeError) as e:
        print(f"kvmesh plan: {e}", file=sys.stderr)
        return 2
    health = Health.serve(args.health_port) if args.health_port else None
    config = PlannerConfig(speed=Speed(), startup_s=args.startup_s, window_s=args.window_s, ttft_miss=args.ttft_miss,
                           min_instances={r: args.min for r in Role if r.is_engine},
                           max_instances={r: args.max for r in Role if r.is_engine})
    targets, plan_state, rates = Targets(args.ttft_s, args.itl_s), PlannerState(), deque[float](maxlen=8)
    while True:
        before = scrape(metrics)
        fleet = asyncio.run(heartbeats(nats_url, cluster, args.window_s, None if args.nats_url else directory))
        after = scrape(metrics)
        window = traffic(before, after, args.window_s, args.output_tokens)
        obs = Observation(time.monotonic(), fleet, window, targets, tuple(rates), mean_ttft(before, after))
        out = plan(obs, config, plan_state,
                   sizes(fleet, directory) if args.actuator == "local" else None)
        plan_state = out.state
        rates.append(window.rate)
        if health is not None:
            health.plans += 1
        if args.json:
            print(json.dumps({"traffic": window.__dict__, "instances": len(fleet), "ttft_s": obs.ttft_s,
                              "pools": [{"role": str(x.role), "current": x.current, "target": x.target,
                                         "action": x.action, "reason": x.reason} for x in out.pools]}), flush=True)
        else:
            print(out.describe(), flush=True)
        if not args.serve:
            return 0
        for line in act(out, actuator):
            print(f"kvmesh plan: scaled {line}", flush=True)


def sizes(fleet: list[InstanceLoad], directory: Path) -> dict[Role, int]:
    """Each pool's size for a local stack: what was last asked of it (instances still starting count), else
    what the heartbeats show."""
    from app.launcher import want_pools

    return {**pools_of(fleet), **{Role(r): n for r, n in want_pools(directory).items()}}


def _actuator(args: argparse.Namespace, directory: Path) -> Callable[[Role, int], None]:
    if args.actuator == "print":
        return lambda role, n: None
    if args.actuator == "local":
        from app.launcher import ask_pools

        return lambda role, n: ask_pools(directory, {str(role): n})
    deployments = {}
    for entry in args.k8s_deployment:
        role, sep, name = entry.partition("=")
        if not sep or not name:
            raise ValueError(f"--k8s-deployment {entry!r}: expected ROLE=NAME")
        deployments[Role(role)] = name
    if not deployments:
        raise ValueError("--actuator kubernetes needs --k8s-deployment ROLE=NAME for each pool")
    k8s = Kubernetes(args.k8s_server, args.k8s_namespace or "default", deployments) if args.k8s_server \
        else Kubernetes.in_cluster(deployments, args.k8s_namespace)
    return k8s.scale


if __name__ == "__main__":
    sys.exit(main())
