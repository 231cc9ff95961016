"""vLLM on CUDA (``make gpu-check``'s vLLM stage): the converter and the side-stream mover on device tensors laid out
as vLLM's GPU backends lay them, then real vLLM instances on one GPU: greedy ids through ``kvmesh up
--engine-backend vllm`` with the pool on equal vLLM's own, the pool serving one instance's blocks to the other, and
a PD hand-off between two vLLM instances. Skipped without CUDA (conftest.py) or without vLLM's CUDA build."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys

import pytest
import torch
from kvmesh.contracts.layout import KVLayout
from kvmesh.vllm.layout import LayerCache, PagedLayout

CUDA = "cuda"
WIRE = KVLayout("m", num_layers=4, num_kv_heads=2, head_dim=64, block_size=16, dtype="bf16")
needs_vllm = pytest.mark.skipif(importlib.util.find_spec("vllm") is None,
                                reason="vLLM is not installed: scripts/gpu_check.sh installs its CUDA build (VLLM=1)")


def content_layers(num_blocks: int, bv: int) -> list[LayerCache]:
    """FlashAttention's 0.32 page, NHD order (LBNHC): physically [blocks, tokens, heads, K|V], viewed [B, H, N, C]."""
    return [LayerCache(torch.zeros(num_blocks, bv, WIRE.num_kv_heads, 2 * WIRE.head_dim, dtype=torch.bfloat16,
                                   device=CUDA).permute(0, 2, 1, 3), "FLASH_ATTN", kv_layout="LBNHC")
            for _ in range(WIRE.num_layers)]


def test_blocks_loaded_on_the_side_stream_read_back_through_pinned_memory():
    from kvmesh.vllm.mover import Mover

    paged = PagedLayout(content_layers(12, 32), WIRE, 32)
    mover = Mover(paged)
    try:
        wire = torch.randn(6, *WIRE.block_shape).to(torch.bfloat16)
        mover.load([([3, 9, 1], wire)])
        for layer in range(WIRE.num_layers):
            mover.wait_layer(layer)
        got: list[torch.Tensor] = []
        mover.read([3, 9, 1], None, got.append)
        mover.read([9], (1, 3), got.append)
        mover.settle()
        mover.flush()
        assert got[0].device.type == "cpu" and got[0].is_pinned()
        assert torch.equal(got[0], wire) and torch.equal(got[1], wire[2:4, 1:3])
    finally:
        mover.close()


def test_a_read_after_a_kernel_on_the_compute_stream_sees_what_it_wrote():
    """The read-out waits for an event on the compute stream: KV a kernel writes there just before is read."""
    from kvmesh.vllm.mover import Mover

    layers = content_layers(8, 16)
    paged = PagedLayout(layers, WIRE, 16)
    mover = Mover(paged)
    try:
        torch.cuda._sleep(50_000_000)  # the compute stream is busy for a while
        for layer in layers:
            layer.tensor.fill_(1.5)  # queued behind the sleep, on the compute stream
        got: list[torch.Tensor] = []
        mover.read([2], None, got.append)
        mover.flush()
        assert bool((got[0] == 1.5).all())
    finally:
        mover.close()


def vllm_greedy(model_dir: str, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
    """vLLM's own greedy ids, in a process of its own (its memory is freed when it exits)."""
    code = ("import json, sys\nfrom vllm import LLM, SamplingParams, TokensPrompt\n"
            "model, prompts, n = json.loads(sys.argv[1])\n"
            "llm = LLM(model=model, dtype='bfloat16', gpu_memory_utilization=0.3, seed=0)\n"
            "outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], "
            "SamplingParams(temperature=0, max_tokens=n))\n"
            "print(json.dumps([list(o.outputs[0].token_ids) for o in outs]))\n")
    out = subprocess.run([sys.executable, "-c", code, json.dumps([model_dir, prompts, max_tokens])],
                         capture_output=True, text=True, timeout=300, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


GPU_ENGINE = {"device": CUDA, "dtype": "bf16", "kv_dtype": "bf16", "vllm_gpu_memory_utilization": 0.3}


@needs_vllm
def test_vllm_on_cuda_with_the_pool_on_gives_vllms_greedy_ids_and_shares_blocks(tmp_path_factory, model_dir):
    from kvmesh.client import KvmeshClient

    from tests.vllm.conftest import vllm_stack
    from tests.vllm.test_vllm_pd import long_prompt

    prompts = [long_prompt(21, 600), long_prompt(22, 300)]
    want = vllm_greedy(model_dir, prompts, 16)
    stack = vllm_stack(tmp_path_factory, "cuda-both", both=2, engine=GPU_ENGINE)
    try:
        with KvmeshClient(stack.router_grpc) as c:
            got = [c.complete(p, max_tokens=16, temperature=0).token_ids for p in prompts]
            again = c.complete(prompts[0], max_tokens=16, temperature=0, policy="round_robin")
        assert got == want and again.token_ids == want[0]
        log = "".join((stack.log_dir / f"both-{i}.log").read_text() for i in range(2))
        assert "cannot be converted" not in log and "'converter': 'exact'" in log
    finally:
        stack.stop()


@needs_vllm
def test_a_pd_hand_off_between_two_vllm_instances_on_one_gpu(tmp_path_factory, model_dir):
    from kvmesh.client import KvmeshClient

    from tests.vllm.conftest import vllm_stack
    from tests.vllm.test_vllm_pd import long_prompt, metric, spans

    prompt = long_prompt(23, 900)
    want = vllm_greedy(model_dir, [prompt], 12)[0]
    stack = vllm_stack(tmp_path_factory, "cuda-pd", both=0, prefill=1, decode=1, engine=GPU_ENGINE,
                       router={"disaggregate": "always"})
    try:
        with KvmeshClient(stack.router_grpc) as c:
            out = c.complete(prompt, max_tokens=12, temperature=0)
        found = spans(stack, out.metadata["x-request-id"])
        assert found["decode.load"]["kvmesh.imported"] and "decode.kv_fallback" not in found
        assert metric(stack, "decode-0", "kvmesh_worker_kv_fallbacks_total") == 0
        assert out.token_ids == want
    finally:
        stack.stop()


@pytest.fixture(scope="module")
def model_dir() -> str:
    from kvmesh.engine.loader import resolve_model

    return str(resolve_model(None).hf_dir)
