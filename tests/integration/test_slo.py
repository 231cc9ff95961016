"""Latency targets end to end: set in an OpenAI body, HTTP headers or the SDK, they reach the engines through the
router (role both, and PD: prefill holds the TTFT target, decode the ITL target), which count the request as
goodput in their metrics, and so does the router; a TTFT target no instance can meet is refused at once (429)
and one out of range is a 400 naming where targets are set. Tiny random model, real nats-server, real ports."""

from __future__ import annotations

import dataclasses

import openai
import pytest
from kvmesh.client import KvmeshClient

from .test_logprobs import both, pd  # noqa: F401 - fixtures: a role both mesh, a PD one
from .test_router_bad_input import TinyMesh, model_dir  # noqa: F401 - model_dir: a fixture

PROMPT = [(i * 37) % 240 + 3 for i in range(23)]
# a prompt the engines, which measure their speed at start, take longer to prefill than the shortest target the
# router holds a request to (1 ms, what is left of a target at the least)
LONG = [(i * 37) % 240 + 3 for i in range(400)]
GREEDY = {"max_tokens": 5, "temperature": 0}


def router_goodput(mesh: TinyMesh) -> dict[str, float]:
    return {s.labels["outcome"]: s.value for m in mesh.router.metrics.registry.collect() for s in m.samples
            if s.name == "kvmesh_router_slo_requests_total"}


def engine_goodput(mesh: TinyMesh) -> list[dict[str, int]]:
    return [dataclasses.asdict(w.engine.stats().slo) for w in mesh.workers]


def complete(mesh: TinyMesh, extra_body: dict | None = None, headers: dict | None = None, prompt=PROMPT):
    api = openai.OpenAI(base_url=f"http://127.0.0.1:{mesh.http_port}/v1", api_key="unused", max_retries=0)
    return api.completions.create(model=mesh.router.model_id, prompt=prompt, **GREEDY,
                                  extra_body={"ignore_eos": True, **(extra_body or {})}, extra_headers=headers)


def test_targets_in_the_body_reach_the_engine_and_a_request_that_met_them_is_goodput_everywhere(both):  # noqa: F811
    before, engine_before = router_goodput(both).get("met", 0), engine_goodput(both)[0].get("met", 0)
    complete(both, {"kvmesh_slo": {"ttft_s": 600, "itl_s": 60}})
    assert router_goodput(both)["met"] == before + 1
    assert engine_goodput(both)[0]["met"] == engine_before + 1


def test_the_sdk_and_the_headers_set_targets_too(both):  # noqa: F811
    engine_before = engine_goodput(both)[0].get("met", 0)
    with KvmeshClient(both.grpc_target) as c:
        c.complete(PROMPT, max_tokens=3, ignore_eos=True, ttft_s=600, itl_s=60)
    complete(both, headers={"x-kvmesh-slo-ttft-s": "600"})
    assert engine_goodput(both)[0]["met"] == engine_before + 2


def test_a_ttft_target_no_instance_can_meet_is_refused_at_once(both):  # noqa: F811
    with pytest.raises(openai.RateLimitError, match="TTFT SLO"):  # 429
        complete(both, {"kvmesh_slo": {"ttft_s": 1e-6}}, prompt=LONG)


def test_a_target_out_of_range_is_a_400_saying_where_targets_are_set(both):  # noqa: F811
    with pytest.raises(openai.BadRequestError, match="kvmesh_slo"):
        complete(both, {"kvmesh_slo": {"itl_s": -1}})


def test_through_pd_prefill_holds_the_ttft_target_and_decode_the_itl_target(pd):  # noqa: F811
    complete(pd, {"kvmesh_slo": {"ttft_s": 600, "itl_s": 60}})
    prefill, decode = engine_goodput(pd)
    assert prefill["met"] >= 1 and decode["met"] >= 1
    assert router_goodput(pd)["met"] >= 1


def test_through_pd_a_ttft_target_neither_path_meets_is_refused_at_once(pd):  # noqa: F811
    with pytest.raises(openai.RateLimitError, match="TTFT SLO"):  # 429
        complete(pd, {"kvmesh_slo": {"ttft_s": 1e-6}}, prompt=LONG)
