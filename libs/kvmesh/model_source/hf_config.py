"""The shape of a Llama-family model, parsed from (and written back to) a Hugging Face config.json."""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

# HF architecture -> config.json model_type. All three share the Llama block (RMSNorm, SwiGLU, RoPE, GQA).
MODEL_TYPES = {
    "LlamaForCausalLM": "llama",
    "Qwen2ForCausalLM": "qwen2",
    "MistralForCausalLM": "mistral",
}


@dataclass(frozen=True)
class ModelConfig:
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    # q/k/v projections carry biases (always for Qwen2). A Llama checkpoint with attention_bias also biases
    # o_proj, which Qwen2 never does: the presence of `o_proj.bias` in the weights tells the two apart.
    attention_bias: bool
    bos_token_id: int | None
    eos_token_ids: tuple[int, ...]

    @classmethod
    def from_hf(cls, d: dict[str, Any]) -> ModelConfig:
        """Parse a config.json dict; raise ValueError for anything this engine would compute wrongly."""
        archs = d.get("architectures") or []
        arch = archs[0] if archs else ""
        if arch not in MODEL_TYPES:
            raise ValueError(f"unsupported architecture {arch!r}; supported: {', '.join(MODEL_TYPES)}")
        # transformers 5 writes `rope_parameters`; older versions `rope_theta` + `rope_scaling`.
        rope = d.get("rope_scaling") or d.get("rope_parameters") or {}
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        if rope_type not in (None, "default"):
            raise ValueError(f"unsupported rope_scaling type {rope_type!r}; only unscaled RoPE is supported")
        if d.get("mlp_bias"):
            raise ValueError("unsupported mlp_bias=true")
        max_pos = int(d.get("max_position_embeddings", 2048))
        uses_window = d.get("use_sliding_window", arch == "MistralForCausalLM")  # Qwen2 has an on/off flag
        window = d.get("sliding_window") if uses_window else None
        if window is not None and window < max_pos:
            raise ValueError(f"unsupported sliding-window attention (window {window} < context {max_pos})")
        eos = d.get("eos_token_id")
        heads = int(d["num_attention_heads"])
        return cls(
            architecture=arch,
            vocab_size=int(d["vocab_size"]),
            hidden_size=int(d["hidden_size"]),
            intermediate_size=int(d["intermediate_size"]),
            num_layers=int(d["num_hidden_layers"]),
            num_heads=heads,
            num_kv_heads=int(d.get("num_key_value_heads") or heads),
            head_dim=int(d.get("head_dim") or d["hidden_size"] // heads),
            rms_norm_eps=float(d.get("rms_norm_eps", 1e-6)),
            rope_theta=float(d.get("rope_theta", rope.get("rope_theta", 10000.0))),
            max_position_embeddings=max_pos,
            tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
            attention_bias=arch == "Qwen2ForCausalLM" or bool(d.get("attention_bias", False)),
            bos_token_id=d.get("bos_token_id"),
            eos_token_ids=tuple(eos) if isinstance(eos, list) else (() if eos is None else (int(eos),)),
        )

    def to_hf(self) -> dict[str, Any]:
        """A config.json dict that transformers' AutoConfig / AutoModelForCausalLM accept."""
        eos = list(self.eos_token_ids)
        return {
            "architectures": [self.architecture],
            "model_type": MODEL_TYPES[self.architecture],
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_layers,
            "num_attention_heads": self.num_heads,
            "num_key_value_heads": self.num_kv_heads,
            "head_dim": self.head_dim,
            "hidden_act": "silu",
            "rms_norm_eps": self.rms_norm_eps,
            "rope_theta": self.rope_theta,
            "rope_scaling": None,
            "max_position_embeddings": self.max_position_embeddings,
            "tie_word_embeddings": self.tie_word_embeddings,
            "attention_bias": self.attention_bias,
            "sliding_window": None,
            "use_sliding_window": False,
            "bos_token_id": self.bos_token_id,
            "eos_token_id": eos[0] if len(eos) == 1 else (eos or None),
            "torch_dtype": "float32",
        }

    @classmethod
    def tiny(cls, **overrides: Any) -> ModelConfig:
        """A tiny random-weight model for unit tests: GQA and tied embeddings, like the default model."""
        base = cls(
            architecture="LlamaForCausalLM",
            vocab_size=256,
            hidden_size=64,
            intermediate_size=128,
            num_layers=2,
            num_heads=4,
            num_kv_heads=2,
            head_dim=16,
            rms_norm_eps=1e-5,
            rope_theta=10000.0,
            max_position_embeddings=512,
            tie_word_embeddings=True,
            attention_bias=False,
            bos_token_id=1,
            eos_token_ids=(2,),
        )
        return replace(base, **overrides)
