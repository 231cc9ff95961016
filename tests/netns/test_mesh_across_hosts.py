"""kvmesh across hosts: each service in a network namespace of its own (veth links through a bridge), decode
behind a link capped with tc (tbf) and lengthened by a delay proxy it advertises instead of its own address.
Nothing may assume one host: the router reaches the engines and prefill pushes KV to decode by the addresses they
advertise, the NATS URL and cachesvc's address are another host's, and the answers are the same as on one host.
The namespaces are the test's own, removed at the end."""

from __future__ import annotations

import pytest

from app.netlab.hosts import Lab
from app.netlab.mesh import DECODE_PORT, DECODE_TRANSFER_PORT, HOSTS, NetnsMesh

pytestmark = [pytest.mark.netns, pytest.mark.slow]
DELAY_MS, CAP_MBIT = 5.0, 200
PROMPT = [(i * 7919) % 30000 + 100 for i in range(300)]  # 300 token ids: 19 blocks of KV to push


def metric(text: str, name: str) -> float:
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(name))


@pytest.fixture(scope="module")
def mesh(tmp_path_factory):
    with Lab(HOSTS) as lab:
        lab.cap("decode", CAP_MBIT)
        m = NetnsMesh(lab, tmp_path_factory.mktemp("netns"), delay_ms=DELAY_MS)
        m.start()
        try:
            yield m
        finally:
            m.stop()
    assert not lab.namespaces(), "the lab's namespaces outlived it"


def completion(mesh: NetnsMesh, disaggregate: str, salt: str) -> dict:
    return mesh.post("/v1/completions", {"prompt": PROMPT, "max_tokens": 12, "temperature": 0, "ignore_eos": True,
                                         "cache_salt": salt}, {"x-kvmesh-disaggregate": disaggregate})


def test_decode_is_reached_at_the_address_it_advertises(mesh):
    """Decode advertises the wan host (its delay proxy): the router's Decode calls and prefill's pushes go there."""
    completion(mesh, "always", "advertised")
    proxied = (mesh.state_dir / "logs" / "delay-proxy.log").read_text()
    lab = mesh.lab
    assert f"connection from {lab['control'].address} to {lab['decode'].address}:{DECODE_PORT}" in proxied
    assert f"connection from {lab['prefill'].address} to {lab['decode'].address}:{DECODE_TRANSFER_PORT}" in proxied


def test_the_kv_push_crosses_the_capped_delayed_link_and_gives_one_hosts_answer(mesh):
    before = metric(mesh.metrics("decode-0"), 'kvmesh_worker_kv_transfer_bytes_total{direction="receive"}')
    pd = completion(mesh, "always", "pd")
    local = completion(mesh, "never", "local")  # decode computes the prompt itself: no push
    assert pd["choices"][0]["text"] == local["choices"][0]["text"] and len(local["choices"][0]["text"]) > 0
    assert metric(mesh.metrics("router"), "kvmesh_router_kv_fallbacks_total") == 0  # the push was used
    received = metric(mesh.metrics("decode-0"), 'kvmesh_worker_kv_transfer_bytes_total{direction="receive"}')
    assert received - before >= 300 // 16 * 30 * 2 * 3 * 64 * 4 * 16  # 18 full blocks: 30 layers' K and V, fp32
