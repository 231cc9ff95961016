"""The real default model: kvmesh's greedy tokens equal Hugging Face transformers' on the same fp32 weights."""

import json
import subprocess
import sys

import pytest
import torch
from kvmesh.contracts.sampling import SamplingParams
from kvmesh.engine.llm_engine import LLMEngine
from kvmesh.engine.loader import resolve_model
from kvmesh.settings import EngineSettings

pytestmark = pytest.mark.slow

CHAT_PROMPTS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Explain what a KV cache is in one sentence.",
]
RAW_PROMPT = "The three primary colors are"
GREEDY_24 = SamplingParams(max_tokens=24, ignore_eos=True)


@pytest.fixture(scope="module")
def engine():
    return LLMEngine(EngineSettings(threads=1))


@pytest.fixture(scope="module")
def hf_model():
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(resolve_model(None).hf_dir, dtype=torch.float32).eval()


def prompts(engine):
    tok = engine.tokenizer
    chats = [tok.apply_chat_template([{"role": "user", "content": p}]) for p in CHAT_PROMPTS]
    return chats + [tok.encode(RAW_PROMPT)]


def hf_greedy(model, prompt, n):
    """transformers' greedy decoding, continuing past EOS like ``ignore_eos`` (``generate(min_new_tokens=...)``
    would instead mask EOS out of the argmax), on the model's device."""
    out, past, ids = [], None, torch.tensor([prompt], device=model.device)
    with torch.no_grad():
        for _ in range(n):
            step = model(ids, past_key_values=past, use_cache=True)
            past = step.past_key_values
            out.append(int(step.logits[0, -1].argmax()))
            ids = torch.tensor([[out[-1]]], device=model.device)
    return out


def test_greedy_tokens_equal_transformers_for_chat_and_raw_prompts(engine, hf_model):
    for prompt in prompts(engine):
        ours = engine.generate([prompt], GREEDY_24)[0].token_ids
        assert ours == hf_greedy(hf_model, prompt, 24)


def test_the_default_engine_decodes_from_the_ggufs_quantized_blocks(engine):
    """The greedy test above then covers the quantized kernel: every matrix reads its Q4_1 / Q8_0 blocks
    (where the kernel builds with AVX-512), and they hold the fp32 values Hugging Face computes with."""
    from kvmesh.engine import native

    lib = native.load_gemm()
    if lib is None or lib.kvmesh_q_block_bytes(1) == 0:
        pytest.skip("the quantized kernel needs AVX-512 and a compiler")
    layers = engine.model.layers
    assert all(getattr(layer, n).q is not None for layer in layers for n in ("qkv", "o", "gate_up", "down"))
    assert engine.model.lm_head.q is not None


def test_a_batch_gives_each_prompt_its_solo_tokens(engine):
    ps = prompts(engine)
    solo = [engine.generate([p], GREEDY_24)[0].token_ids for p in ps]
    fresh = LLMEngine(EngineSettings(threads=1))
    assert [c.token_ids for c in fresh.generate(ps, GREEDY_24)] == solo


def test_fp8_kv_greedy_output_stays_close_to_fp32(engine):
    fp8 = LLMEngine(EngineSettings(threads=1, kv_dtype="fp8"))
    agree = total = 0
    for prompt in prompts(engine):
        ref = engine.generate([prompt], GREEDY_24)[0].token_ids
        got = fp8.generate([prompt], GREEDY_24)[0].token_ids
        prefix = next((i for i, (a, b) in enumerate(zip(ref, got)) if a != b), len(ref))
        agree, total = agree + prefix, total + len(ref)
    assert agree / total >= 0.5, f"fp8 KV agreed with fp32 on only {agree}/{total} leading tokens"


def test_cli_generate_json_reports_the_acceptance_fields(engine):
    out = subprocess.run([sys.executable, "-m", "app.cli", "generate", "--chat", "--prompt", CHAT_PROMPTS[0],
                          "--max-tokens", "24", "--ignore-eos", "--json"],
                         capture_output=True, text=True, timeout=300, check=True)
    result = json.loads(out.stdout)
    expected = engine.generate([prompts(engine)[0]], GREEDY_24)[0]
    assert result["token_ids"] == expected.token_ids
    assert result["prompt_token_ids"] == prompts(engine)[0]
    assert result["text"] and result["ttft_s"] > 0 and result["decode_tokens_per_s"] > 0
    assert result["cached_tokens"] == 0
