"""The engine on CUDA: the default model's greedy tokens against Hugging Face transformers on the same GPU (fp32:
equal; bf16: close), the paged attention backends (torch SDPA, flashinfer) agreeing on one pool, and a
prefill -> decode mesh whose engines run on the GPU. Skipped without CUDA (conftest.py)."""

from __future__ import annotations

import copy

import pytest
import torch
from kvmesh.contracts.layout import KVLayout
from kvmesh.engine.attention import ForwardBatch, SeqSlice, TorchAttention, make_backend
from kvmesh.engine.kv_cache import DeviceKVPool
from kvmesh.engine.llm_engine import LLMEngine
from kvmesh.engine.loader import resolve_model
from kvmesh.settings import EngineSettings

from tests.e2e.conftest import start_stack
from tests.e2e.test_generate_matches_hf import CHAT_PROMPTS, GREEDY_24, hf_greedy, prompts
from tests.e2e.test_mesh import expected_tokens, post

CUDA = "cuda"


def _flashinfer_missing() -> bool:
    try:
        import flashinfer  # noqa: F401
    except ImportError:
        return True
    return False


needs_flashinfer = pytest.mark.skipif(_flashinfer_missing(),
                                      reason="flashinfer is not installed: pip install 'kvmesh[cuda]'")
FLASHINFER = pytest.param("flashinfer", marks=needs_flashinfer)


@pytest.fixture(scope="module")
def engine():
    """The defaults on CUDA: fp32 compute and KV, attention auto (torch SDPA in fp32)."""
    return LLMEngine(EngineSettings(device=CUDA))


@pytest.fixture(scope="module")
def hf_model():
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(resolve_model(None).hf_dir, dtype=torch.float32).to(CUDA).eval()


def leading_agreement(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def test_fp32_on_cuda_runs_torch_attention_and_equals_transformers(engine, hf_model):
    assert engine.attn.name == "torch" and engine.kv.k.is_cuda
    for prompt in prompts(engine):
        assert engine.generate([prompt], GREEDY_24)[0].token_ids == hf_greedy(hf_model, prompt, 24)


def test_a_batch_on_cuda_gives_each_prompt_its_solo_tokens(engine):
    ps = prompts(engine)
    solo = [engine.generate([p], GREEDY_24)[0].token_ids for p in ps]
    assert [c.token_ids for c in LLMEngine(EngineSettings(device=CUDA)).generate(ps, GREEDY_24)] == solo


def test_penalties_on_cuda_give_the_reference_loops_tokens(engine, hf_model):
    """The penalized rows' tallies live on the logits' device: greedy tokens with the penalties equal a loop
    applying vLLM's formulas to transformers' logits on the same GPU (as fp32 greedy equals it without them)."""
    from kvmesh.contracts.sampling import SamplingParams

    p = SamplingParams(max_tokens=16, ignore_eos=True, presence_penalty=1.0, frequency_penalty=0.5,
                       repetition_penalty=1.3)
    prompt = prompts(engine)[0]
    out: list[int] = []
    for _ in range(16):
        with torch.no_grad():
            logits = hf_model(torch.tensor([prompt + out], device=CUDA)).logits[0, -1].float().cpu()
        for t in set(prompt + out):
            logits[t] = logits[t] / 1.3 if logits[t] > 0 else logits[t] * 1.3
        for t in set(out):
            logits[t] -= 0.5 * out.count(t) + 1.0
        out.append(int(logits.argmax()))
    assert engine.generate([prompt], p)[0].token_ids == out


@pytest.mark.parametrize("attention", ["torch", FLASHINFER])
def test_bf16_on_cuda_tracks_transformers_in_bf16(engine, hf_model, attention):
    """bf16 rounds differently in every kernel, so not token for token: most leading tokens agree."""
    ours = LLMEngine(EngineSettings(device=CUDA, dtype="bf16", kv_dtype="bf16", attention=attention))
    assert ours.attn.name == attention
    hf16 = copy.deepcopy(hf_model).to(torch.bfloat16)
    agree = total = 0
    for prompt in prompts(engine):
        got = ours.generate([prompt], GREEDY_24)[0].token_ids
        agree, total = agree + leading_agreement(got, hf_greedy(hf16, prompt, 24)), total + 24
    assert agree / total >= 0.5, f"bf16 ({attention}) agreed with transformers on {agree}/{total} leading tokens"


@needs_flashinfer
def test_auto_picks_flashinfer_in_bf16():
    assert LLMEngine(EngineSettings(device=CUDA, dtype="bf16", kv_dtype="bf16", num_blocks=16)).attn.name == \
        "flashinfer"


@needs_flashinfer
@pytest.mark.parametrize("kv_dtype", ["bf16", "fp8"])
def test_paged_attention_backends_agree_on_one_pool(kv_dtype):
    """One mixed step: a fresh prompt, a prompt on a cached prefix, two decode rows, over scattered blocks."""
    heads, kv_heads, head_dim, bs = 8, 2, 64, 16
    layout = KVLayout("gpu-test", 1, kv_heads, head_dim, bs, kv_dtype)
    g = torch.Generator(device=CUDA).manual_seed(0)
    base = DeviceKVPool(layout, 64, torch.bfloat16, CUDA)
    for t in (base.k, base.v):
        t.copy_(torch.randn(t.shape, generator=g, device=CUDA).to(t.dtype))
    # (query tokens, KV tokens after the step, blocks)
    shapes = [(20, 20, [3, 9]), (9, 39, [12, 0, 30]), (1, 41, [7, 21, 40]), (1, 17, [50, 2])]
    seqs, start = [], 0
    for num_query, kv_len, table in shapes:
        seqs.append(SeqSlice(start, num_query, kv_len, table))
        start += num_query
    batch = ForwardBatch.build(seqs, [[1] * n for n, _, _ in shapes], bs, [s.start + s.num_query - 1 for s in seqs],
                               CUDA)
    q = torch.randn(start, heads, head_dim, generator=g, device=CUDA, dtype=torch.bfloat16)
    k, v = (torch.randn(start, kv_heads, head_dim, generator=g, device=CUDA, dtype=torch.bfloat16) for _ in "kv")
    outs = []
    for backend in (TorchAttention(), make_backend("flashinfer", heads, kv_heads, head_dim, CUDA, torch.bfloat16,
                                                   base.dtype)):
        pool = copy.copy(base)
        pool.k, pool.v = base.k.clone(), base.v.clone()
        backend.plan(batch, pool)
        outs.append(backend.forward(0, q, k, v, pool).float())
    assert torch.allclose(outs[0], outs[1], atol=2e-2, rtol=2e-2), (outs[0] - outs[1]).abs().max()


@pytest.fixture(scope="module")
def gpu_mesh(tmp_path_factory):
    """1 prefill + 1 decode, both engines on the GPU: the KV pushed between them leaves and enters GPU memory."""
    stack = start_stack(tmp_path_factory, "gpu", settings={"engine": {"device": CUDA}})
    yield stack
    stack.stop()


def test_the_mesh_on_cuda_serves_the_engines_greedy_tokens(gpu_mesh, engine):
    prompt = engine.tokenizer.apply_chat_template([{"role": "user", "content": CHAT_PROMPTS[0]}])
    status, body, _ = post(gpu_mesh, "/v1/completions", {"prompt": prompt, "max_tokens": 16, "temperature": 0})
    assert status == 200, body
    served = engine.tokenizer.decode(engine.tokenizer.encode(body["choices"][0]["text"]))
    assert served == engine.tokenizer.decode(expected_tokens(engine, CHAT_PROMPTS[0], 16))
