"""A Llama-family decoder (Llama, Mistral, Qwen2) that reads and writes the paged KV pool.

Weights use Hugging Face names on load and are fused for speed (q|k|v in one matmul, gate|up in another).
Logits are computed only for the positions the caller samples from.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from kvmesh.engine.attention import AttentionBackend, ForwardBatch
from kvmesh.engine.kv_cache import DeviceKVPool
from kvmesh.engine.model_config import ModelConfig


def _rope_tables(cfg: ModelConfig, max_pos: int, device: torch.device | str) -> tuple[torch.Tensor, torch.Tensor]:
    inv_freq = 1.0 / (cfg.rope_theta ** (torch.arange(0, cfg.head_dim, 2, dtype=torch.int64).float() / cfg.head_dim))
    freqs = torch.arange(max_pos, dtype=torch.float32)[:, None] * inv_freq[None, :]
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos().to(device), emb.sin().to(device)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, dtype: torch.dtype) -> None:
        super().__init__()
        q, kv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
        self.qkv = nn.Parameter(torch.empty(q + 2 * kv, cfg.hidden_size, dtype=dtype), requires_grad=False)
        self.qkv_bias = (nn.Parameter(torch.zeros(q + 2 * kv, dtype=dtype), requires_grad=False)
                         if cfg.attention_bias else None)
        self.o = nn.Parameter(torch.empty(cfg.hidden_size, q, dtype=dtype), requires_grad=False)
        # Llama's attention_bias also biases o_proj; Qwen2 biases q/k/v only.
        self.o_bias = (nn.Parameter(torch.zeros(cfg.hidden_size, dtype=dtype), requires_grad=False)
                       if cfg.attention_bias and cfg.architecture != "Qwen2ForCausalLM" else None)
        self.gate_up = nn.Parameter(torch.empty(2 * cfg.intermediate_size, cfg.hidden_size, dtype=dtype),
                                    requires_grad=False)
        self.down = nn.Parameter(torch.empty(cfg.hidden_size, cfg.intermediate_size, dtype=dtype),
                                 requires_grad=False)
        self.ln_attn = nn.Parameter(torch.ones(cfg.hidden_size, dtype=dtype), requires_grad=False)
        self.ln_mlp = nn.Parameter(torch.ones(cfg.hidden_size, dtype=dtype), requires_grad=False)
        self.split = (q, kv, kv)


class LlamaModel(nn.Module):
    def __init__(self, cfg: ModelConfig, dtype: torch.dtype = torch.float32,
                 device: torch.device | str = "cpu") -> None:
        super().__init__()
        self.cfg = cfg
        self.embed = nn.Parameter(torch.empty(cfg.vocab_size, cfg.hidden_size, dtype=dtype), requires_grad=False)
        self.layers = nn.ModuleList(DecoderLayer(cfg, dtype) for _ in range(cfg.num_layers))
        self.norm = nn.Parameter(torch.ones(cfg.hidden_size, dtype=dtype), requires_grad=False)
        self.lm_head = (self.embed if cfg.tie_word_embeddings else
                        nn.Parameter(torch.empty(cfg.vocab_size, cfg.hidden_size, dtype=dtype), requires_grad=False))
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
                layer.qkv.copy_(torch.cat([take(p + f"self_attn.{n}_proj.weight") for n in "qkv"]))
                if layer.qkv_bias is not None:
                    layer.qkv_bias.copy_(torch.cat([take(p + f"self_attn.{n}_proj.bias") for n in "qkv"]))
                layer.o.copy_(take(p + "self_attn.o_proj.weight"))
                if layer.o_bias is not None:
                    layer.o_bias.copy_(take(p + "self_attn.o_proj.bias"))
                layer.gate_up.copy_(torch.cat([take(p + "mlp.gate_proj.weight"), take(p + "mlp.up_proj.weight")]))
                layer.down.copy_(take(p + "mlp.down_proj.weight"))
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
            qkv = F.linear(x, layer.qkv, layer.qkv_bias)
            q, k, v = qkv.split(layer.split, dim=-1)
            q = q.view(T, cfg.num_heads, cfg.head_dim)
            k = k.view(T, cfg.num_kv_heads, cfg.head_dim)
            v = v.view(T, cfg.num_kv_heads, cfg.head_dim)
            q = q * cos + _rotate_half(q) * sin
            k = k * cos + _rotate_half(k) * sin
            o = attn.forward(i, q, k, v, kv)
            h = h + F.linear(o.reshape(T, -1), layer.o, layer.o_bias)
            x = self._rms(h, layer.ln_mlp)
            gate, up = F.linear(x, layer.gate_up).chunk(2, dim=-1)
            h = h + F.linear(F.silu(gate) * up, layer.down)
        h = self._rms(h.index_select(0, batch.sample_idx), self.norm)
        return F.linear(h, self.lm_head).float()
