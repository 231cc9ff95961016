"""``kvmesh plan``'s edges: the routers' counters turned into a window's traffic, the Kubernetes actuator against
a fake API server (the ``scale`` subresource, bearer token, merge patch), and the command's help and errors."""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, HTTPServer
from typing import ClassVar

import pytest
from kvmesh.contracts.ids import Role
from kvmesh.planning import Plan, PlannerState, PoolPlan

from app import plan as plan_cli
from app.cli import main

METRICS = """# HELP kvmesh_router_requests_total Finished requests
kvmesh_router_requests_total{api="openai",outcome="ok"} 30.0
kvmesh_router_requests_total{api="grpc",outcome="ok"} 10.0
kvmesh_router_prompt_tokens_total 8000.0
kvmesh_router_prefix_hit_tokens_total 2000.0
kvmesh_router_ttft_seconds_sum 3.5
"""


def test_router_counters_become_the_window_traffic() -> None:
    before = plan_cli.counters(METRICS)
    after = {k: v * 2 for k, v in before.items()}
    t = plan_cli.traffic(before, after, window_s=10.0, output_tokens=128)
    assert t.rate == 4.0 and t.prompt_tokens == 200.0 and t.hit_rate == 0.25 and t.output_tokens == 128


class FakeApiServer(BaseHTTPRequestHandler):
    calls: ClassVar[list[tuple[str, str, str, dict]]] = []
    replicas = 2

    def _reply(self, body: dict) -> None:
        data = json.dumps(body).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_GET(self) -> None:
        FakeApiServer.calls.append(("GET", self.path, self.headers.get("Authorization", ""), {}))
        self._reply({"kind": "Scale", "spec": {"replicas": FakeApiServer.replicas}})

    def do_PATCH(self) -> None:
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        FakeApiServer.calls.append(("PATCH", self.path, self.headers.get("Content-Type", ""), body))
        FakeApiServer.replicas = body["spec"]["replicas"]
        self._reply({"kind": "Scale", "spec": {"replicas": FakeApiServer.replicas}})

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture
def api_server() -> Iterator[str]:
    FakeApiServer.calls, FakeApiServer.replicas = [], 2
    server = HTTPServer(("127.0.0.1", 0), FakeApiServer)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()


def test_the_kubernetes_actuator_patches_the_pools_deployment_scale(api_server: str) -> None:
    k8s = plan_cli.Kubernetes(api_server, "serving", {Role.PREFILL: "kvmesh-prefill", Role.DECODE: "kvmesh-decode"},
                              token="sa-token")
    assert k8s.replicas(Role.PREFILL) == 2
    p = Plan((PoolPlan(Role.PREFILL, 2, 5, "out", "ttft"), PoolPlan(Role.DECODE, 3, 3, "hold", "ok")),
             PlannerState())
    assert plan_cli.act(p, k8s.scale) == ["prefill: 2 -> 5"]
    get, patch = FakeApiServer.calls
    assert get == ("GET", "/apis/apps/v1/namespaces/serving/deployments/kvmesh-prefill/scale", "Bearer sa-token", {})
    assert patch == ("PATCH", "/apis/apps/v1/namespaces/serving/deployments/kvmesh-prefill/scale",
                     "application/merge-patch+json", {"spec": {"replicas": 5}})
    assert k8s.replicas(Role.PREFILL) == 5


def test_plan_has_help(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as e:
        main(["plan", "--help"])
    assert e.value.code == 0 and "--serve" in capsys.readouterr().out


def test_plan_without_a_stack_says_how_to_start_one(tmp_path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["plan", "--state-dir", str(tmp_path)]) == 2
    assert "kvmesh up" in capsys.readouterr().err


def test_the_kubernetes_actuator_needs_the_pools_deployments(tmp_path, capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "stack.json").write_text(json.dumps({"router_grpc": "", "router_http": "", "nats_url": "",
                                                     "cluster": "c"}))
    assert main(["plan", "--state-dir", str(tmp_path), "--actuator", "kubernetes", "--k8s-server", "http://x"]) == 2
    assert "--k8s-deployment" in capsys.readouterr().err


def test_the_local_actuator_asks_the_running_stack_for_the_pools_size(tmp_path) -> None:
    from kvmesh.planning import InstanceLoad

    from app.launcher import want_pools

    fleet = [InstanceLoad("prefill-0", Role.PREFILL), InstanceLoad("decode-0", Role.DECODE)]
    assert plan_cli.sizes(fleet, tmp_path) == {Role.PREFILL: 1, Role.DECODE: 1}
    scale = plan_cli._actuator(plan_cli.argparse.Namespace(actuator="local"), tmp_path)
    p = Plan((PoolPlan(Role.PREFILL, 1, 3, "out", "ttft"), PoolPlan(Role.DECODE, 1, 1, "hold", "ok")),
             PlannerState())
    assert plan_cli.act(p, scale) == ["prefill: 1 -> 3"]
    assert want_pools(tmp_path) == {"prefill": 3}
    # instances still starting count: the next plan sees the size asked, not the heartbeats'
    assert plan_cli.sizes(fleet, tmp_path) == {Role.PREFILL: 3, Role.DECODE: 1}


def test_a_bad_pools_file_is_refused_with_what_it_should_hold(tmp_path) -> None:
    from app.launcher import want_pools

    (tmp_path / "pools.json").write_text('{"router": 2}')
    with pytest.raises(ValueError, match="expected \\{role: instances\\}"):
        want_pools(tmp_path)


def test_the_window_mean_ttft_comes_from_the_routers_histogram() -> None:
    before = plan_cli.counters(METRICS + "kvmesh_router_ttft_seconds_count 10\n")
    after = {**before, "kvmesh_router_ttft_seconds_sum": 5.5, "kvmesh_router_ttft_seconds_count": 14.0}
    assert plan_cli.mean_ttft(before, after) == pytest.approx(0.5)
    assert plan_cli.mean_ttft(before, before) == 0.0


def test_a_metrics_url_is_scraped_at_every_address_its_name_resolves_to() -> None:
    assert "http://127.0.0.1:8000/metrics" in plan_cli.fan_out("http://localhost:8000/metrics")
    assert plan_cli.fan_out("http://10.1.2.3:8000/metrics") == ["http://10.1.2.3:8000/metrics"]


def test_in_a_cluster_the_planner_needs_the_routers_metrics(tmp_path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["plan", "--state-dir", str(tmp_path), "--nats-url", "nats://nats:4222"]) == 2
    assert "--router-metrics" in capsys.readouterr().err


def test_the_health_endpoint_is_ready_once_a_plan_was_made() -> None:
    import urllib.error
    import urllib.request

    health = plan_cli.Health.serve(0, host="127.0.0.1")
    url = f"http://127.0.0.1:{health.port}/health"
    with pytest.raises(urllib.error.HTTPError) as e:
        urllib.request.urlopen(url, timeout=5)
    assert e.value.code == 503
    health.plans = 1
    with urllib.request.urlopen(url, timeout=5) as r:
        assert r.status == 200 and json.load(r) == {"plans": 1}


def test_a_ttft_miss_outside_0_1_is_refused_saying_what_it_is(tmp_path, capsys):
    with pytest.raises(SystemExit) as e:
        main(["plan", "--state-dir", str(tmp_path), "--ttft-miss", "1.5"])
    assert e.value.code == 2 and "--ttft-miss 1.5 must be in [0, 1)" in capsys.readouterr().err


def test_the_routers_prompt_histogram_gives_the_window_its_spread() -> None:
    """Two routers' buckets summed; the window's quantiles read back from the cumulative counts (linear inside
    a bucket), so the planner sizes prefill for the prompts it saw, not for exponential ones."""
    def buckets(counts: dict[str, int]) -> str:
        return "".join(f'kvmesh_router_computed_prompt_tokens_bucket{{le="{le}",router="{r}"}} {n}\n'
                       for r in ("a", "b") for le, n in counts.items())

    before = plan_cli.counters(METRICS + buckets({"100.0": 0, "1000.0": 0, "+Inf": 0}))
    doubled = "".join(f"{line.rsplit(' ', 1)[0]} {2 * float(line.rsplit(' ', 1)[1])}\n"
                      for line in METRICS.splitlines() if not line.startswith("#"))
    # each router: 10 of its 20 requests in the window computed 0-100 tokens, 10 computed 100-1000
    after = plan_cli.counters(doubled + buckets({"100.0": 10, "1000.0": 20, "+Inf": 20}))
    t = plan_cli.traffic(before, after, window_s=10.0, output_tokens=128)
    assert t.rate == 4.0 and len(t.prompt_quantiles) == plan_cli.QUANTILES
    assert t.prompt_quantiles[0] == pytest.approx(2.0)                # 1% into the lower half's 0-100
    assert t.prompt_quantiles[24] == pytest.approx(98.0)              # the 49th percentile
    assert t.prompt_quantiles[-1] == pytest.approx(100 + 0.98 * 900)  # the 99th
    assert t.prompt_sq_tokens == pytest.approx(sum(q * q for q in t.prompt_quantiles) / plan_cli.QUANTILES)
    assert plan_cli.prompt_spread(before, before) == (0.0, ())        # no requests: exponential
