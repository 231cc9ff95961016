"""PD with vLLM instances: a vLLM prefill pushes its KV through kvmesh's transfer (layer group by layer group, from
vLLM's save_kv_layer) and a vLLM decode loads it into its paged KV; native and vLLM instances of the same model
hand KV to each other through the wire layout; a layout that does not convert is refused and recomputed."""

from __future__ import annotations

import json
import random
import time
import urllib.request

import pytest
from kvmesh.client import KvmeshClient

from tests.vllm.conftest import vllm_stack
from tests.vllm.test_vllm_stack import PROMPTS

pytestmark = pytest.mark.vllm


def _avx512() -> bool:
    try:
        with open("/proc/cpuinfo") as f:
            return any(line.startswith("flags") and " avx512f" in line for line in f)
    except OSError:
        return False
# vllm serve's greedy ids for PROMPTS (tests/vllm/test_vllm_stack.py checks them against a live server)
REFERENCE = [[7042, 30, 198, 198, 504, 2988, 314, 42, 216, 34, 32, 33, 40, 29, 32, 33],
             [472, 585, 304, 1758, 216, 32, 42, 448, 1003, 216, 33, 472, 1003, 304, 1672, 3987],
             [504, 2988, 314, 216, 36, 30, 2]]


def long_prompt(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(100, 40000) for _ in range(n)]


def metric(stack, service: str, name: str) -> float:
    with urllib.request.urlopen(stack.service(service).endpoints["metrics"], timeout=10) as r:
        text = r.read().decode()
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(name))


@pytest.fixture(scope="module")
def pd(tmp_path_factory):
    """One vLLM prefill, one vLLM decode, PD forced (the router never lets decode prefill a prompt itself)."""
    s = vllm_stack(tmp_path_factory, "vllmpd", both=0, prefill=1, decode=1,
                   router={"disaggregate": "always"})
    yield s
    s.stop()


def test_greedy_ids_through_vllm_pd_equal_vllm_serve(pd):
    with KvmeshClient(pd.router_grpc) as c:
        got = [c.complete(p, max_tokens=16, temperature=0) for p in PROMPTS]
    assert [g.token_ids for g in got] == REFERENCE
    assert metric(pd, "decode-0", "kvmesh_worker_kv_fallbacks_total") == 0


def spans(stack, request_id: str) -> dict[str, dict]:
    """The request's spans by name (their attributes), from the stack's JSONL trace file."""
    deadline = time.monotonic() + 10
    while True:
        found = {}
        for line in (stack.state_dir / "traces.jsonl").read_text().splitlines():
            span = json.loads(line)
            if span["attributes"].get("kvmesh.request_id") == request_id:
                found[span["name"]] = span["attributes"]
        if "kv.push" in found or time.monotonic() > deadline:
            return found
        time.sleep(0.2)


def test_a_long_prompt_is_pushed_layer_group_by_group_while_vllm_computes_and_decode_loads_it(pd):
    prompt = long_prompt(7, 1500)
    with KvmeshClient(pd.router_grpc) as c:
        out = c.complete(prompt, max_tokens=8, temperature=0)
    found = spans(pd, out.metadata["x-request-id"])
    push, load = found["kv.push"], found["decode.load"]
    block = 30 * 2 * 16 * 3 * 64 * 4
    assert push["kvmesh.bytes"] == -(-1500 // 16) * block  # every block, once, the last partial one included
    assert push["kvmesh.part.layers"] == ["0-15", "15-30", "0-15", "15-30"]  # 2 chunks x 2 layer groups
    assert 0 <= push["kvmesh.critical_ms"] <= push["kvmesh.push_ms"]  # measured from the compute's end
    assert load["kvmesh.imported"] and "decode.kv_fallback" not in found
    assert metric(pd, "decode-0", "kvmesh_worker_kv_fallbacks_total") == 0


def test_the_same_greedy_ids_as_role_both_on_a_long_prompt(pd, tmp_path_factory):
    prompt = long_prompt(8, 900)
    with KvmeshClient(pd.router_grpc) as c:
        via_pd = c.complete(prompt, max_tokens=12, temperature=0).token_ids
    both = vllm_stack(tmp_path_factory, "vllmboth", both=1)
    try:
        req = urllib.request.Request(f"{both.router_http}/v1/completions",
                                     json.dumps({"prompt": prompt, "max_tokens": 12, "temperature": 0}).encode(),
                                     {"content-type": "application/json"})
        with urllib.request.urlopen(req, timeout=300) as r:
            text = json.load(r)["choices"][0]["text"]
        with KvmeshClient(both.router_grpc) as c:
            alone = c.complete(prompt, max_tokens=12, temperature=0).token_ids
    finally:
        both.stop()
    assert via_pd == alone and text


def mixed_stack(tmp_path_factory, name: str, prefill: dict[str, str], decode: dict[str, str]):
    """One prefill and one decode, each with its own engine variables, PD forced."""
    from app.launcher import Stack, StackOptions
    from tests.vllm.conftest import ENGINE

    opts = StackOptions.local(name, prefill=1, decode=1, both=0,
                              settings={"engine": {k: v for k, v in ENGINE.items() if k != "backend"},
                                        "router": {"disaggregate": "always"}},
                              instance_env={"prefill-0": prefill, "decode-0": decode})
    stack = Stack(tmp_path_factory.mktemp(name), opts)
    stack.start(timeout_s=400)
    return stack


NATIVE, VLLM = {"KVMESH_ENGINE_BACKEND": "native"}, {"KVMESH_ENGINE_BACKEND": "vllm"}


@pytest.mark.parametrize("prefill,decode", [(NATIVE, VLLM), (VLLM, NATIVE)], ids=["native-to-vllm", "vllm-to-native"])
def test_native_and_vllm_hand_kv_to_each_other_through_the_wire_layout(tmp_path_factory, prefill, decode):
    """The two engines of one model convert their KV to the same wire layout: a push from one is loaded by the
    other, and greedy tokens equal vllm serve's (which the native engine also gives on these prompts)."""
    stack = mixed_stack(tmp_path_factory, "mixed", prefill, decode)
    try:
        long = long_prompt(9, 700)
        with KvmeshClient(stack.router_grpc) as c:
            got = [c.complete(p, max_tokens=16, temperature=0) for p in [*PROMPTS, long]]
        assert [g.token_ids for g in got[:3]] == REFERENCE
        found = spans(stack, got[3].metadata["x-request-id"])
        assert found["decode.load"]["kvmesh.imported"] and "decode.kv_fallback" not in found
        assert metric(stack, "decode-0", "kvmesh_worker_kv_fallbacks_total") == 0
    finally:
        stack.stop()
    both = vllm_stack(tmp_path_factory, "vllmref", both=1)
    try:
        with KvmeshClient(both.router_grpc) as c:
            assert got[3].token_ids == c.complete(long, max_tokens=16, temperature=0).token_ids
    finally:
        both.stop()


def test_a_decode_whose_kv_layout_differs_is_never_paired_and_computes_the_prompt_itself(tmp_path_factory):
    """A native prefill storing bf16 KV and a vLLM decode in fp32: the bytes would mean something else, so the
    router sends the request to decode alone (which prefills it) and says why."""
    stack = mixed_stack(tmp_path_factory, "mismatch", {**NATIVE, "KVMESH_ENGINE_KV_DTYPE": "bf16"}, VLLM)
    try:
        with KvmeshClient(stack.router_grpc) as c:
            out = c.complete(PROMPTS[0], max_tokens=16, temperature=0)
        assert out.token_ids == REFERENCE[0]
        route = next(a for name, a in spans_any(stack, out.metadata["x-request-id"]) if name == "router.route")
        assert route["kvmesh.route.path"] == "local" and "KV layout" in route["kvmesh.route.reason"]
        assert metric(stack, "prefill-0", 'kvmesh_worker_kv_transfer_bytes_total{direction="push"}') == 0
    finally:
        stack.stop()


def test_a_decode_that_names_the_converter_takes_a_push_of_another_dtype(tmp_path_factory):
    """A native prefill storing bf16 KV, a vLLM decode in fp32 that names bf16 (``kv_convert_from``): the router
    pairs them, decode's intake casts the push into its layout and vLLM starts from it, nothing recomputed."""
    stack = mixed_stack(tmp_path_factory, "convert", {**NATIVE, "KVMESH_ENGINE_KV_DTYPE": "bf16"},
                        {**VLLM, "KVMESH_ENGINE_KV_CONVERT_FROM": "bf16"})
    try:
        with KvmeshClient(stack.router_grpc) as c:
            out = c.complete(long_prompt(10, 700), max_tokens=8, temperature=0)
        found = spans(stack, out.metadata["x-request-id"])
        assert found["decode.load"]["kvmesh.imported"] and found["decode.load"]["kvmesh.converted"]
        assert "decode.kv_fallback" not in found and len(out.token_ids) == 8
        assert metric(stack, "decode-0", "kvmesh_worker_kv_fallbacks_total") == 0
    finally:
        stack.stop()


@pytest.mark.skipif(not _avx512(), reason="vLLM's CPU backend keeps an fp8 KV cache only with AVX-512 or AMX; "
                                          "without them its engine refuses to start, before kvmesh sees the layout")
def test_a_vllm_instance_whose_kv_cannot_be_converted_says_so_at_start_and_is_never_paired(tmp_path_factory):
    """vLLM's fp8 pages on the CPU kernel are not a packing kvmesh measured: the decode refuses them at start
    (its log says what to set, its heartbeat says why), and the router sends the request to it alone even though
    both wire layouts are fp8."""
    fp8 = {"KVMESH_ENGINE_KV_DTYPE": "fp8"}
    stack = mixed_stack(tmp_path_factory, "unconvertible", {**NATIVE, **fp8}, {**VLLM, **fp8})
    try:
        log = (stack.log_dir / "decode-0.log").read_text()
        assert "cannot be converted to kvmesh's wire layout" in log and "set dtype and kv_dtype fp32" in log
        with KvmeshClient(stack.router_grpc) as c:
            out = c.complete(PROMPTS[0], max_tokens=8, temperature=0)
        assert len(out.token_ids) == 8
        route = next(a for name, a in spans_any(stack, out.metadata["x-request-id"]) if name == "router.route")
        assert route["kvmesh.route.path"] == "local" and "KV layout" in route["kvmesh.route.reason"]
        assert metric(stack, "prefill-0", 'kvmesh_worker_kv_transfer_bytes_total{direction="push"}') == 0
    finally:
        stack.stop()


def spans_any(stack, request_id: str) -> list[tuple[str, dict]]:
    deadline = time.monotonic() + 10
    while True:
        found = [(s["name"], s["attributes"]) for line in (stack.state_dir / "traces.jsonl").read_text().splitlines()
                 if (s := json.loads(line))["attributes"].get("kvmesh.request_id") == request_id]
        if any(name == "router.route" for name, _ in found) or time.monotonic() > deadline:
            return found
        time.sleep(0.2)
