"""Load a model's weights, and convert a GGUF file into an HF safetensors directory.

Finding the model (its config, tokenizer, fingerprint) is torch-free and lives in :mod:`kvmesh.model_source`;
this module is the part that needs torch. ``python -m kvmesh.engine.loader <gguf> <hf_dir>`` converts in a
process of its own (what a torch-free caller of ``model_source.resolve_model`` runs).
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch
from gguf import GGUFReader
from gguf.quants import dequantize
from safetensors.torch import load_file, save_file

from kvmesh.model_source import resolve
from kvmesh.model_source.hf_config import ModelConfig
from kvmesh.model_source.resolve import ModelSource

TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "chat_template.jinja",
    "generation_config.json",
)

# GGUF architecture -> HF architecture. llama.cpp stores Q/K rows of "llama" permuted for its rope kernel.
GGUF_ARCHITECTURES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM"}
GGUF_PERMUTES_QK = {"llama"}
GGUF_GLOBAL_TENSORS = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
}
GGUF_LAYER_TENSORS = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}


def resolve_model(source: str | Path | None, cache_dir: Path | None = None) -> ModelSource:
    """:func:`kvmesh.model_source.resolve.resolve_model`, converting a GGUF in this process (the engine has
    torch loaded anyway)."""
    return resolve.resolve_model(source, cache_dir, convert=_convert_gguf_once)


def load_weights(src: ModelSource, dtype: torch.dtype = torch.float32) -> dict[str, torch.Tensor]:
    """All tensors of the model under their HF names (lm_head.weight absent when embeddings are tied)."""
    index = src.hf_dir / "model.safetensors.index.json"
    if index.is_file():
        files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
    else:
        files = ["model.safetensors"]
    weights: dict[str, torch.Tensor] = {}
    for name in files:
        weights.update({k: v.to(dtype) for k, v in load_file(src.hf_dir / name).items()})
    return weights


class _GGUFTensors:
    """A GGUF's model config and its tensors under their HF names, each with the row order fix the conversion
    applies (llama.cpp's per-head Q/K permutation undone): one home for that rule, which the dequantized
    weights and the quantized blocks both follow."""

    def __init__(self, gguf_path: Path) -> None:
        self.reader = GGUFReader(gguf_path)
        self.arch = str(_meta(self.reader, "general.architecture"))
        self.config = _gguf_config(self.reader, self.arch)
        self._heads = {"attn_q": self.config.num_heads, "attn_k": self.config.num_kv_heads}

    def __iter__(self) -> Iterator[tuple[str, Any]]:
        return ((_hf_tensor_name(t.name), t) for t in self.reader.tensors)

    def rows(self, tensor: Any, w: np.ndarray) -> np.ndarray:
        """``w`` (the tensor's values or its raw blocks, one row per output feature) in the HF row order."""
        part = tensor.name.split(".")[-2]
        if self.arch in GGUF_PERMUTES_QK and part in self._heads:
            return _unpermute_rope_rows(w, self._heads[part])
        return w


def load_quantized(gguf_path: Path) -> dict[str, tuple[str, np.ndarray]]:
    """The GGUF's matrices stored in a type the C GEMM reads quantized (``quant.TYPES``), under their HF names:
    (type, the file's rows ``[out_features, row bytes]``), in the row order of the converted weights."""
    from kvmesh.engine import quant

    tensors = _GGUFTensors(gguf_path)
    return {name: (t.tensor_type.name, tensors.rows(t, np.asarray(t.data))) for name, t in tensors
            if t.tensor_type.name in quant.TYPES and len(t.data.shape) == 2}


def save_hf_dir(
    config: ModelConfig,
    weights: dict[str, torch.Tensor],
    out_dir: str | Path,
    tokenizer_dir: str | Path | None = None,
) -> Path:
    """Write config.json, model.safetensors and (copied from tokenizer_dir) the tokenizer files."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(config.to_hf(), indent=2))
    skip = {"lm_head.weight"} if config.tie_word_embeddings else set()
    save_file({k: v.contiguous() for k, v in weights.items() if k not in skip}, out / "model.safetensors")
    if tokenizer_dir is not None:
        for name in TOKENIZER_FILES:
            if (Path(tokenizer_dir) / name).is_file():
                shutil.copyfile(Path(tokenizer_dir) / name, out / name)
    return out


def _convert_gguf_once(gguf_path: Path, hf_dir: Path) -> None:
    """Convert into a temp dir beside hf_dir, then rename: a crash never leaves a half-written cache entry."""
    hf_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{hf_dir.name}.", dir=hf_dir.parent))
    try:
        _convert_gguf(gguf_path, tmp)
        for f in [tmp, *tmp.iterdir()]:  # mkdtemp and safetensors write private files; the cache is shared
            f.chmod(0o755 if f.is_dir() else 0o644)
        os.rename(tmp, hf_dir)
    except OSError:
        if not (hf_dir / "config.json").is_file():  # not just another process winning the race
            raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _convert_gguf(gguf_path: Path, out: Path) -> None:
    from transformers import AutoTokenizer

    tensors = _GGUFTensors(gguf_path)
    weights = {name: torch.from_numpy(tensors.rows(t, np.array(dequantize(t.data, t.tensor_type), dtype=np.float32)))
               for name, t in tensors}  # np.array: a copy, t.data is a read-only map
    save_hf_dir(tensors.config, weights, out)

    tokenizer = AutoTokenizer.from_pretrained(
        str(gguf_path.parent), gguf_file=gguf_path.name, local_files_only=True
    )
    tokenizer.save_pretrained(str(out), save_jinja_files=False)  # chat_template inside tokenizer_config.json
    # transformers 5 names its own class and load-time flags here; keep the file loadable by any version.
    tok_config = json.loads((out / "tokenizer_config.json").read_text())
    tok_config = {k: v for k, v in tok_config.items() if k not in ("is_local", "local_files_only", "backend")}
    tok_config["tokenizer_class"] = "PreTrainedTokenizerFast"
    (out / "tokenizer_config.json").write_text(json.dumps(tok_config, indent=2, ensure_ascii=False))


def _meta(reader: GGUFReader, key: str, default: Any = None) -> Any:
    field = reader.get_field(key)
    return default if field is None else field.contents()


def _gguf_config(reader: GGUFReader, arch: str) -> ModelConfig:
    """Build an HF config.json dict from GGUF metadata and parse it, so one place validates both formats."""
    if arch not in GGUF_ARCHITECTURES:
        supported = ", ".join(GGUF_ARCHITECTURES)
        raise ValueError(f"unsupported GGUF architecture {arch!r}; supported: {supported}")
    names = {t.name for t in reader.tensors}
    hidden = int(_meta(reader, f"{arch}.embedding_length"))
    heads = int(_meta(reader, f"{arch}.attention.head_count"))
    tokens = reader.get_field("tokenizer.ggml.tokens")
    scaling = _meta(reader, f"{arch}.rope.scaling.type", "none")
    if "rope_freqs.weight" in names:  # Llama 3.1-style frequency factors
        scaling = "llama3"
    eos = [_meta(reader, f"tokenizer.ggml.{k}_token_id") for k in ("eos", "eot")]
    return ModelConfig.from_hf(
        {
            "architectures": [GGUF_ARCHITECTURES[arch]],
            "vocab_size": _meta(reader, f"{arch}.vocab_size") or (len(tokens.data) if tokens else 0),
            "hidden_size": hidden,
            "intermediate_size": _meta(reader, f"{arch}.feed_forward_length"),
            "num_hidden_layers": _meta(reader, f"{arch}.block_count"),
            "num_attention_heads": heads,
            "num_key_value_heads": _meta(reader, f"{arch}.attention.head_count_kv", heads),
            "head_dim": _meta(reader, f"{arch}.attention.key_length", hidden // heads),
            "rms_norm_eps": _f32(_meta(reader, f"{arch}.attention.layer_norm_rms_epsilon")),
            "rope_theta": _f32(_meta(reader, f"{arch}.rope.freq_base", 10000.0)),
            "rope_scaling": None if scaling == "none" else {"rope_type": scaling},
            "max_position_embeddings": _meta(reader, f"{arch}.context_length"),
            "tie_word_embeddings": "output.weight" not in names,
            "bos_token_id": _meta(reader, "tokenizer.ggml.bos_token_id"),
            "eos_token_id": list(dict.fromkeys(e for e in eos if e is not None)),
        }
    )


def _f32(value: float) -> float:
    """The shortest decimal that is this float32 (GGUF stores 1e-5 as 9.999999747378752e-06)."""
    return float(str(np.float32(value)))


def _hf_tensor_name(gguf_name: str) -> str:
    """blk.3.attn_q.bias -> model.layers.3.self_attn.q_proj.bias (HF naming)."""
    parts = gguf_name.split(".")
    if len(parts) == 2 and parts[0] in GGUF_GLOBAL_TENSORS:
        return f"{GGUF_GLOBAL_TENSORS[parts[0]]}.{parts[1]}"
    if len(parts) == 4 and parts[0] == "blk" and parts[2] in GGUF_LAYER_TENSORS:
        return f"model.layers.{parts[1]}.{GGUF_LAYER_TENSORS[parts[2]]}.{parts[3]}"
    raise ValueError(f"unsupported GGUF tensor {gguf_name!r}")


def _unpermute_rope_rows(w: np.ndarray, n_head: int) -> np.ndarray:
    """Undo llama.cpp's per-head row permutation of Q/K (interleaved -> half-split rotary pairs)."""
    rows = w.shape[0]
    return w.reshape(n_head, rows // n_head // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


if __name__ == "__main__":
    _convert_gguf_once(Path(sys.argv[1]), Path(sys.argv[2]))
