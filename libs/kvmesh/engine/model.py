"""A Llama-family decoder (Llama, Mistral, Qwen2) that reads and writes the paged KV pool.

Weights use Hugging Face names on load.
Logits are computed only for the positions the caller samples from.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from kvmesh.engine.attention import AttentionBackend, ForwardBatch
from kvmesh.engine.kv_cache import DeviceKVPool
from kvmesh.model_source.hf_config import ModelConfig


def _rope_tables(cfg: ModelConfig, max_pos: int, device: torch.device | str) -> tuple[torch.Tensor, torch.Tensor]:
    inv_freq = 1.0 / (cfg.rope_theta ** (torch.arange(0, cfg.head_dim, 2, dtype=torch.int64).float() / cfg.head_dim))
    freqs = torch.arange(max_pos, dtype=torch.float32)[:, None] * inv_freq[None, :]
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos().to(device), emb.sin().to(device)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def _param(*shape: int, dtype: torch.dtype, fill: float | None = None) -> nn.Parameter:
    t = torch.empty(*shape, dtype=dtype) if fill is None else torch.full(shape, fill, dtype=dtype)
    return nn.Parameter(t, requires_grad=False)


class DecoderLayer(nn.Module):
    """Weights kept as separate matrices: on CPU, fusing q|k|v or gate|up into one matmul measured slower."""

    def __init__(self, cfg: ModelConfig, dtype: torch.dtype) -> None:
        super().__init__()
        hidden, q, kv = cfg.hidden_size, cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
        self.q, self.k, self.v = _param(q, hidden, dtype=dtype), _param(kv, hidden, dtype=dtype), \
            _param(kv, hidden, dtype=dtype)
        bias = cfg.attention_bias
        self.q_bias, self.k_bias, self.v_bias = ((_param(q, dtype=dtype, fill=0), _param(kv, dtype=dtype, fill=0),
                                                  _param(kv, dtype=dtype, fill=0)) if bias else (None, None, None))
        self.o = _param(hidden, q, dtype=dtype)
        # Llama's attention_bias also biases o_proj; Qwen2 biases q/k/v only.
        self.o_bias = (_param(hidden, dtype=dtype, fill=0)
                       if bias and cfg.architecture != "Qwen2ForCausalLM" else None)
        self.gate = _param(cfg.intermediate_size, hidden, dtype=dtype)
        self.up = _param(cfg.intermediate_size, hidden, dtype=dtype)
        self.down = _param(hidden, cfg.intermediate_size, dtype=dtype)
        self.ln_attn = _param(hidden, dtype=dtype, fill=1)
        self.ln_mlp = _param(hidden, dtype=dtype, fill=1)


class LlamaModel(nn.Module):
    def __init__(self, cfg: ModelConfig, dtype: torch.dtype = torch.float32,
                 device: torch.device | str = "cpu") -> None:
        super().__init__()
        self.cfg = cfg
        self.embed = _param(cfg.vocab_size, cfg.hidden_size, dtype=dtype)
        self.layers = nn.ModuleList(DecoderLayer(cfg, dtype) for _ in range(cfg.num_layers))
        self.norm = _param(cfg.hidden_size, dtype=dtype, fill=1)
        self.lm_head = self.embed if cfg.tie_word_embeddings else _param(cfg.vocab_size, cfg.hidden_size, dtype=dtype)
        self.to(device)
        self.cos, self.sin = _rope_tables(cfg, cfg.max_position_embeddings, device)

    # ---- weights -------------------------------------------------------------------------------------------
    def load_hf_weights(self, weights: dict[str, torch.Tensor]) -> None:
        """Copy Hugging Face-named tensors into the fused parameters; refuses missing or mis-shaped tensors."""
        def take(name: str) -> torch.Tensor:
            if name not in weights:
                raise ValueError(f"checkpoint is missing tensor {name!r}")
            return weights[name]

        with torch.no_grad():
            self.embed.copy_(take("model.embed_tokens.weight"))
            self.norm.copy_(take("model.norm.weight"))
            if not self.cfg.tie_word_embeddings:
                self.lm_head.copy_(take("lm_head.weight"))
            for i, layer in enumerate(self.layers):
                p = f"model.layers.{i}."
                for n in "qkvo":
                    getattr(layer, n).copy_(take(p + f"self_attn.{n}_proj.weight"))
                    if getattr(layer, f"{n}_bias") is not None:
                        getattr(layer, f"{n}_bias").copy_(take(p + f"self_attn.{n}_proj.bias"))
                for n in ("gate", "up", "down"):
                    getattr(layer, n).copy_(take(p + f"mlp.{n}_proj.weight"))
                layer.ln_attn.copy_(take(p + "input_layernorm.weight"))
                layer.ln_mlp.copy_(take(p + "post_attention_layernorm.weight"))

    def init_random(self, seed: int = 0) -> None:
        """Small random weights for tests and simulations."""
        g = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            for p in self.parameters():
                if p.dim() > 1:
                    p.copy_(torch.randn(p.shape, generator=g) * 0.05)

    # ---- forward -------------------------------------------------------------------------------------------
    def _rms(self, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return F.rms_norm(x, (x.shape[-1],), w, self.cfg.rms_norm_eps)

    @torch.inference_mode()
    def forward(self, batch: ForwardBatch, kv: DeviceKVPool, attn: AttentionBackend) -> torch.Tensor:
        """Logits ``[len(batch.sample_idx), vocab]`` (float32)."""
        cfg = self.cfg
        attn.plan(batch, kv)
        h = self.embed.index_select(0, batch.input_ids)
        cos = self.cos.index_select(0, batch.positions)[:, None, :]
        sin = self.sin.index_select(0, batch.positions)[:, None, :]
        T = h.shape[0]
        for i, layer in enumerate(self.layers):
            x = self._rms(h, layer.ln_attn)
            q = F.linear(x, layer.q, layer.q_bias).view(T, cfg.num_heads, cfg.head_dim)
            k = F.linear(x, layer.k, layer.k_bias).view(T, cfg.num_kv_heads, cfg.head_dim)
            v = F.linear(x, layer.v, layer.v_bias).view(T, cfg.num_kv_heads, cfg.head_dim)
            q = q * cos + _rotate_half(q) * sin
            k = k * cos + _rotate_half(k) * sin
            o = attn.forward(i, q, k, v, kv)
            h = h + F.linear(o.reshape(T, -1), layer.o, layer.o_bias)
            x = self._rms(h, layer.ln_mlp)
            h = h + F.linear(F.silu(F.linear(x, layer.gate)) * F.linear(x, layer.up), layer.down)
        h = self._rms(h.index_select(0, batch.sample_idx), self.norm)
        return F.linear(h, self.lm_head).float()
