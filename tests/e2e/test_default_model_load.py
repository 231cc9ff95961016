"""The embedded default model (SmolLM2-135M-Instruct, Q4_1 GGUF) converted into a fresh cache."""

import time
from pathlib import Path

import pytest
import torch
from kvmesh.engine.loader import load_weights, resolve_model
from kvmesh.model_source.resolve import ModelSource, default_model_path
from kvmesh.model_source.tokenizer import IncrementalDetokenizer, Tokenizer
from transformers import AutoConfig, AutoModelForCausalLM

pytestmark = pytest.mark.slow

SYSTEM_PROMPT = (
    "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n"
)


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("kvmesh-cache")


@pytest.fixture(scope="module")
def src(cache_dir: Path) -> ModelSource:
    return resolve_model(None, cache_dir=cache_dir)


@pytest.fixture(scope="module")
def tok(src: ModelSource) -> Tokenizer:
    return Tokenizer.from_dir(src.hf_dir)


def test_default_model_converts_to_the_smollm2_135m_config(src: ModelSource) -> None:
    c = src.config
    assert (c.num_layers, c.hidden_size, c.num_heads, c.num_kv_heads, c.head_dim) == (30, 576, 9, 3, 64)
    assert c.tie_word_embeddings and c.rope_theta == 1e5 and c.vocab_size == 49152


def test_second_resolve_is_fast_and_gives_the_same_fingerprint(src: ModelSource, cache_dir: Path) -> None:
    start = time.perf_counter()
    again = resolve_model(None, cache_dir=cache_dir)
    assert time.perf_counter() - start < 5
    assert again.fingerprint == src.fingerprint and again.hf_dir == src.hf_dir


def test_chat_template_is_chatml_with_the_default_system_prompt(tok: Tokenizer) -> None:
    ids = tok.apply_chat_template([{"role": "user", "content": "Hi"}])
    text = SYSTEM_PROMPT + "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
    assert tok.decode(ids, skip_special_tokens=False) == text
    assert tok.eos_token_ids == (2,)  # <|im_end|>


def test_converted_weights_give_the_logits_of_transformers_gguf_loader(src: ModelSource, tok) -> None:
    ours = AutoModelForCausalLM.from_config(AutoConfig.for_model(**src.config.to_hf()), dtype=torch.float32)
    loaded = ours.load_state_dict(load_weights(src), strict=False)  # lm_head shares the embedding tensor
    assert not loaded.unexpected_keys and set(loaded.missing_keys) <= {"lm_head.weight"}
    path = default_model_path()
    ref = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32)
    ids = torch.tensor([tok.apply_chat_template([{"role": "user", "content": "What is a KV cache?"}])])
    with torch.no_grad():
        diff = (ours(ids).logits - ref(ids).logits).abs().max().item()
    assert diff < 1e-3


def test_detokenizer_streams_multibyte_text_of_the_real_tokenizer(tok: Tokenizer) -> None:
    text = "Emoji 😀🎉 and 中文字符 mixed: naïve café"
    ids = tok.encode(text)
    detok = IncrementalDetokenizer(tok)
    deltas = [detok.push(i) for i in ids]
    assert "".join(deltas) == detok.text == tok.decode(ids) == text
    assert not any("\ufffd" in d for d in deltas)
