"""The ablation's configurations, scenarios and table, without starting a stack."""

from __future__ import annotations

from types import SimpleNamespace

from app.bench import ablation
from app.bench.serve import RunResult
from app.bench.stats import SLO, RequestRecord
from app.launcher import Service, Stack, StackOptions


def test_configurations_turn_the_tiers_on_one_by_one():
    c = ablation.configs(host_cache_mb=32)
    a, b, cc, d, e = (c[k].stack_options(device_blocks=40) for k in "ABCDE")
    assert a.env["KVMESH_ENGINE_ENABLE_PREFIX_CACHING"] == "0" and not a.pool
    assert "KVMESH_ENGINE_ENABLE_PREFIX_CACHING" not in b.env and "KVMESH_ENGINE_HOST_CACHE_MB" not in b.env
    assert not b.pool
    assert cc.env["KVMESH_ENGINE_HOST_CACHE_MB"] == "32" and not cc.pool
    assert d.pool and (d.prefill, d.decode, d.both) == (1, 1, 0)
    assert e.pool and (e.prefill, e.decode, e.both) == (0, 0, 1) and e.env == d.env
    assert all(o.env["KVMESH_ENGINE_NUM_BLOCKS"] == "40" for o in (a, b, cc, d, e))
    assert (c["D"].victim, c["E"].victim) == ("decode-0", "both-0")


def test_without_the_pool_engines_get_no_cachesvc_address_but_the_router_does(tmp_path, monkeypatch):
    spawned: dict[str, dict[str, str]] = {}

    def spawn(self: Stack, name: str, module: str, env: dict[str, str]) -> Service:  # "ready" at once
        spawned[name] = {**self.child_env, **env}
        endpoints = {"grpc": "127.0.0.1:4321"} if name == "cachesvc" else {"grpc": "127.0.0.1:1",
                                                                          "http": "http://127.0.0.1:2"}
        self.services.append(Service(name, SimpleNamespace(pid=1), tmp_path / "log", tmp_path / "ready",
                                     endpoints))
        return self.services[-1]

    monkeypatch.setattr(Stack, "_spawn", spawn)
    monkeypatch.setattr(Stack, "_wait_ready", lambda self, services, deadline: None)
    monkeypatch.setattr(Stack, "_wait_instances", lambda self, deadline: None)
    for pool in (True, False):
        Stack(tmp_path, StackOptions(settings={"shared": {"nats_url": "nats://127.0.0.1:1"}}, pool=pool)).start()
        for engine in ("prefill-0", "decode-0"):
            assert spawned[engine]["KVMESH_INSTANCE_CACHESVC_ADDRESS"] == ("127.0.0.1:4321" if pool else "")
        assert spawned["router"]["KVMESH_ROUTER_CACHESVC_ADDRESS"] == "127.0.0.1:4321"  # the address it bound
        assert spawned["router"]["KVMESH_NATS_URL"] == "nats://127.0.0.1:1"


def test_every_scenario_is_small_and_the_switch_returns_to_x():
    work = ablation.scenarios(max_tokens=8, doc_words=40)
    assert list(work) == list(ablation.SCENARIOS)
    assert sum(w.num_requests for w in work.values()) <= 40
    switch = work["hot-set switch"]
    assert [p.name for p in switch.phases] == ["Y", "X again"]
    x_docs = {c.system for c in work["cold start"].phases[0].conversations}
    assert {c.system for c in switch.phases[1].conversations} == x_docs


def _result(config: str, scenario: str, texts: dict[str, str], cached: int = 0) -> ablation.ScenarioResult:
    recs = [RequestRecord(k, ttft_s=0.1, e2e_s=0.5, output_tokens=3, text=t, prompt_tokens=100,
                          cached_tokens=cached) for k, t in texts.items()]
    recs.append(RequestRecord("dead/0", error="HTTP 503"))
    return ablation.ScenarioResult(config, scenario, RunResult(config, "", "m", recs, 2.0, [("p", 2.0)]), None)


def test_correctness_compares_each_answer_with_config_a_skipping_the_failure_scenario():
    results = [_result("A", "cold start", {"a/0": "x", "b/0": "y"}), _result("A", "failure", {"f/0": "1"}),
               _result("B", "cold start", {"a/0": "x", "b/0": "z"}), _result("B", "failure", {"f/0": "2"})]
    assert ablation.agreement(results, "B") == (1, 2)
    assert ablation.agreement(results, "A") == (2, 2)


def test_a_scenario_with_phases_gets_a_row_per_phase():
    r = _result("B", "hot-set switch", {"a/0": "x"})
    r.run.phases = [("Y", 1.0), ("X again", 1.0)]
    for rec in r.run.records:
        rec.phase = "Y" if rec.key == "a/0" else "X again"
    table = ablation.rows([r], SLO())
    assert [(t["scenario"], t["ok"]) for t in table] == [("hot-set switch: Y", "1/1"),
                                                          ("hot-set switch: X again", "0/1")]


def test_the_table_reports_tokens_saved_failures_and_correctness():
    results = [_result("A", "cold start", {"a/0": "x"}), _result("B", "cold start", {"a/0": "x"}, cached=60)]
    args = SimpleNamespace(concurrency=2, max_tokens=8, doc_words=40, device_blocks=40, host_cache_mb=64,
                           kill_after=2)
    body = ablation.report(results, ablation.configs(), SLO(), args)
    assert "| B | local prefix cache | 0 | 0.0 | 1/1 |" in body
    assert "| cold start | B | 1/2 | 1 / 0 |" in body and "60 / 100 (60%)" in body


def test_the_notes_say_what_the_pool_served_in_bytes_and_tokens():
    served = _result("D", "hot-set switch", {"a/0": "x"})
    served.loaded = {"host": 0.0, "pool": 10 * ablation.BLOCK_NBYTES, "pd": 0.0}
    args = SimpleNamespace(concurrency=2, max_tokens=8, doc_words=40, device_blocks=40, host_cache_mb=8,
                           kill_after=2)
    body = ablation.report([_result("C", "hot-set switch", {"a/0": "x"}), served], ablation.configs(), SLO(), args)
    assert "D hot-set switch 7.0 MB = 160 tokens" in body and "served nothing" not in body
    assert "served nothing" in ablation.report([_result("C", "cold start", {})], ablation.configs(), SLO(), args)


def test_bytes_loaded_per_tier_come_from_the_engines_metrics():
    import http.server
    import threading

    pages = [('kvmesh_worker_kv_block_bytes 1000.0\n'
             'kvmesh_worker_kv_host_moves_total{direction="load"} 3.0\n'
             'kvmesh_worker_kv_host_moves_total{direction="spill"} 9.0\n'
             'kvmesh_worker_kv_transfer_bytes_total{direction="pool_fetch"} 500.0\n'
             'kvmesh_worker_kv_transfer_bytes_total{direction="push"} 70.0\n'
             'kvmesh_worker_kv_transfer_bytes_total{direction="receive"} 70.0\n'),
             'kvmesh_worker_kv_block_bytes 10.0\nkvmesh_worker_kv_host_moves_total{direction="load"} 2.0\n']

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            body = pages[int(self.path.strip("/").split("/")[0])].encode()
            self.send_response(200)
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass

    srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    try:
        base = f"http://127.0.0.1:{srv.server_port}"
        got = ablation.loaded_bytes([f"{base}/0/metrics", f"{base}/1/metrics", "http://127.0.0.1:1/metrics"])
    finally:
        srv.shutdown()
    assert got == {"host": 3 * 1000 + 2 * 10, "pool": 500.0, "pd": 70.0}  # the dead engine counts nothing
