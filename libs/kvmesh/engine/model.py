"""A Llama-family decoder (Llama, Mistral, Qwen2) that reads and writes the paged KV pool.

Weights use Hugging Face names on load.
Logits are computed only for the positions the caller samples from.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import cast

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from kvmesh.engine import native
from kvmesh.engine.attention import AttentionBackend, ForwardBatch
from kvmesh.engine.kv_cache import DeviceKVPool
from kvmesh.engine.linear import Linear
from kvmesh.engine.lora import LoRABatch
from kvmesh.model_source.hf_config import ModelConfig


def _rope_tables(cfg: ModelConfig, max_pos: int, device: torch.device | str,
                 dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """cos / sin ``[max_pos, head_dim]``, computed in fp32 and stored in the model's dtype (as transformers
    rounds them), so the rotation keeps q and k in that dtype."""
    inv_freq = 1.0 / (cfg.rope_theta ** (torch.arange(0, cfg.head_dim, 2, dtype=torch.int64).float() / cfg.head_dim))
    freqs = torch.arange(max_pos, dtype=torch.float32)[:, None] * inv_freq[None, :]
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos().to(device, dtype), emb.sin().to(device, dtype)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def _param(*shape: int, dtype: torch.dtype, fill: float | None = None) -> nn.Parameter:
    t = torch.empty(*shape, dtype=dtype) if fill is None else torch.full(shape, fill, dtype=dtype)
    return nn.Parameter(t, requires_grad=False)


class DecoderLayer(nn.Module):
    """q|k|v and gate|up each in one fused matrix (fewer calls; measured faster than separate ones once packed),
    each a ``Linear`` holding only the forms this device reads (see ``engine/linear.py``). The matrices are set
    by ``LlamaModel.load_hf_weights`` / ``init_random``; norms and biases are parameters."""

    MATRICES = ("qkv", "o", "gate_up", "down")

    def __init__(self, cfg: ModelConfig, dtype: torch.dtype) -> None:
        super().__init__()
        hidden, q, kv = cfg.hidden_size, cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
        self.shapes = {"qkv": (q + 2 * kv, hidden), "o": (hidden, q),
                       "gate_up": (2 * cfg.intermediate_size, hidden), "down": (hidden, cfg.intermediate_size)}
        self.qkv_bias = _param(q + 2 * kv, dtype=dtype, fill=0) if cfg.attention_bias else None
        # Llama's attention_bias also biases o_proj; Qwen2 biases q/k/v only.
        self.o_bias = (_param(hidden, dtype=dtype, fill=0)
                       if cfg.attention_bias and cfg.architecture != "Qwen2ForCausalLM" else None)
        self.ln_attn = _param(hidden, dtype=dtype, fill=1)
        self.ln_mlp = _param(hidden, dtype=dtype, fill=1)
        self.splits = (q, kv, kv)
        self.qkv: Linear
        self.o: Linear
        self.gate_up: Linear
        self.down: Linear


class LlamaModel(nn.Module):
    def __init__(self, cfg: ModelConfig, dtype: torch.dtype = torch.float32,
                 device: torch.device | str = "cpu", *, native_gemm: bool = True,
                 native_pointwise: bool = True) -> None:
        """``native_gemm`` / ``native_pointwise``: use the C kernels where they apply and build (the engine's
        settings of those names); off, torch's ops."""
        super().__init__()
        self.cfg = cfg
        self.native_gemm = native_gemm
        self.dtype, self.device = dtype, torch.device(device)
        # a ModuleList (registered as the model's submodules) that holds only decoder layers
        self.layers = cast(Sequence[DecoderLayer],
                           nn.ModuleList(DecoderLayer(cfg, dtype) for _ in range(cfg.num_layers)))
        self.norm = _param(cfg.hidden_size, dtype=dtype, fill=1)
        self.to(device)
        self.cos, self.sin = _rope_tables(cfg, cfg.max_position_embeddings, device, dtype)
        self.embed: torch.Tensor | None = None  # dense only when not tied to lm_head (else lm_head.rows)
        self.lm_head: Linear
        # RMSNorm and RoPE in one C call each where the kernel builds (CPU fp32), else torch ops
        cpu_fp32 = self.device.type == "cpu" and dtype == torch.float32
        self.pointwise = native.load_pointwise() if native_pointwise and cpu_fp32 else None

    # ---- weights -------------------------------------------------------------------------------------------
    def load_hf_weights(self, weights: dict[str, torch.Tensor]) -> None:
        """Fuse and pack Hugging Face-named tensors; refuses missing or mis-shaped tensors."""
        def take(name: str) -> torch.Tensor:
            if name not in weights:
                raise ValueError(f"checkpoint is missing tensor {name!r}")
            return weights[name]

        with torch.no_grad():
            self.norm.copy_(take("model.norm.weight"))
            head = None if self.cfg.tie_word_embeddings else take("lm_head.weight")
            self._set_embeddings(take("model.embed_tokens.weight"), head)
            for i, layer in enumerate(self.layers):
                p = f"model.layers.{i}."
                fused = {"qkv": torch.cat([take(p + f"self_attn.{n}_proj.weight") for n in "qkv"]),
                         "o": take(p + "self_attn.o_proj.weight"),
                         "gate_up": torch.cat([take(p + f"mlp.{n}_proj.weight") for n in ("gate", "up")]),
                         "down": take(p + "mlp.down_proj.weight")}
                self._set_matrices(layer, fused)
                if layer.qkv_bias is not None:
                    layer.qkv_bias.copy_(torch.cat([take(p + f"self_attn.{n}_proj.bias") for n in "qkv"]))
                if layer.o_bias is not None:
                    layer.o_bias.copy_(take(p + "self_attn.o_proj.bias"))
                layer.ln_attn.copy_(take(p + "input_layernorm.weight"))
                layer.ln_mlp.copy_(take(p + "post_attention_layernorm.weight"))

    def use_quantized(self, blocks: dict[str, tuple[str, np.ndarray]]) -> tuple[int, int]:
        """Let each matrix read its GGUF blocks (``blocks``: HF name -> (GGUF type, the file's rows), from
        ``loader.load_quantized``) where they are all of one supported type and hold exactly its values
        (``Linear.use_quantized``). Returns (matrices switched, matrices)."""
        def fused(names: list[str]) -> tuple[str, np.ndarray] | None:
            parts = [blocks[n] for n in names if n in blocks]
            if len(parts) < len(names) or len({p[0] for p in parts}) != 1:
                return None
            return parts[0][0], np.concatenate([p[1] for p in parts])

        plan: list[tuple[Linear, tuple[str, np.ndarray] | None]] = []
        for i, layer in enumerate(self.layers):
            p = f"model.layers.{i}."
            plan += [(layer.qkv, fused([p + f"self_attn.{n}_proj.weight" for n in "qkv"])),
                     (layer.o, fused([p + "self_attn.o_proj.weight"])),
                     (layer.gate_up, fused([p + f"mlp.{n}_proj.weight" for n in ("gate", "up")])),
                     (layer.down, fused([p + "mlp.down_proj.weight"]))]
        head = "model.embed_tokens.weight" if self.cfg.tie_word_embeddings else "lm_head.weight"
        plan.append((self.lm_head, fused([head])))
        switched = sum(1 for lin, q in plan if q is not None and lin.use_quantized(*q))
        return switched, len(plan)

    def init_random(self, seed: int = 0) -> None:
        """Small random weights for tests and simulations."""
        g = torch.Generator().manual_seed(seed)
        cfg = self.cfg

        def rand(shape: tuple[int, int]) -> torch.Tensor:
            return torch.randn(shape, generator=g) * 0.05

        embed = rand((cfg.vocab_size, cfg.hidden_size))
        layers = [{n: rand(layer.shapes[n]) for n in DecoderLayer.MATRICES} for layer in self.layers]
        head = None if cfg.tie_word_embeddings else rand((cfg.vocab_size, cfg.hidden_size))
        self._set_embeddings(embed, head)
        for layer, fused in zip(self.layers, layers):
            self._set_matrices(layer, fused)

    def _matrix(self, w: torch.Tensor, shape: tuple[int, int], name: str, **kw: bool) -> Linear:
        if tuple(w.shape) != shape:
            raise ValueError(f"tensor {name!r} has shape {tuple(w.shape)}, expected {shape}")
        return Linear(w.to(self.device, self.dtype), native_gemm=self.native_gemm, **kw)

    def _set_embeddings(self, embed: torch.Tensor, head: torch.Tensor | None) -> None:
        """The lm_head only multiplies the sampled rows (at most one per sequence): no prefill copy."""
        shape = (self.cfg.vocab_size, self.cfg.hidden_size)
        if head is None:
            self.embed, self.lm_head = None, self._matrix(embed, shape, "embed", lookup=True, prefill_copy=False)
        else:
            self.embed = embed.to(self.device, self.dtype)
            self.lm_head = self._matrix(head, shape, "lm_head", prefill_copy=False)

    def _set_matrices(self, layer: DecoderLayer, fused: dict[str, torch.Tensor]) -> None:
        for name in DecoderLayer.MATRICES:
            setattr(layer, name, self._matrix(fused[name], layer.shapes[name], name))

    def weight_nbytes(self) -> int:
        """Bytes of every matrix form kept (see ``Linear.nbytes``)."""
        embed = 0 if self.embed is None else self.embed.numel() * self.embed.element_size()
        return embed + self.lm_head.nbytes() + sum(getattr(layer, n).nbytes() for layer in self.layers
                                                   for n in DecoderLayer.MATRICES)

    # ---- forward -------------------------------------------------------------------------------------------
    def _rms(self, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        if self.pointwise is not None and x.stride(-1) == 1:
            return native.rms_norm(self.pointwise, x, w, self.cfg.rms_norm_eps)
        return F.rms_norm(x, (x.shape[-1],), w, self.cfg.rms_norm_eps)

    def _silu_mul(self, gu: torch.Tensor, inter: int) -> torch.Tensor:
        if self.pointwise is not None and gu.stride(-1) == 1 and gu.dtype == torch.float32:
            return native.silu_mul(self.pointwise, gu, inter)
        return F.silu(gu[:, :inter]) * gu[:, inter:]

    def _qkv_heads(self, qkv: torch.Tensor, positions: torch.Tensor,
                   rows: tuple[torch.Tensor, torch.Tensor] | None) -> tuple[torch.Tensor, ...]:
        """q, k (rotated) and v ``[T, heads, D]`` out of the fused projection ``qkv``: rotated in place by the C
        kernel, or by torch ops with ``rows``, the cos/sin rows of ``positions``."""
        if rows is None:
            assert self.pointwise is not None  # no cos/sin rows: the C kernel rotates (forward)
            native.rope_(self.pointwise, qkv, self.cfg.num_heads + self.cfg.num_kv_heads, self.cfg.head_dim,
                         self.cos, self.sin, positions)
        q, k, v = (t.reshape(qkv.shape[0], -1, self.cfg.head_dim) for t in qkv.split(self.layers[0].splits, -1))
        if rows is None:
            return q, k, v
        cos, sin = rows
        return q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin, v

    @torch.inference_mode()
    def forward(self, batch: ForwardBatch, kv: DeviceKVPool, attn: AttentionBackend,
                lora: LoRABatch | None = None,
                kv_written: Callable[[int], None] | None = None) -> torch.Tensor:
        """Logits ``[len(batch.sample_idx), vocab]`` (float32); ``batch.hidden`` set to the final hidden states of
        ``batch.hidden_idx``'s rows when it names any. ``lora``: each adapter's low-rank term, added
        to its rows' projections next to the base matmul. ``kv_written(n)``: called on this thread as soon as
        layers ``0 .. n-1`` have written this batch's K/V into ``kv`` (right after layer n-1's attention), so
        a caller can read a layer group out while the later layers compute."""
        cfg = self.cfg
        attn.plan(batch, kv)
        h = self.lm_head.rows(batch.input_ids) if self.embed is None else self.embed.index_select(0, batch.input_ids)
        # the torch path's cos/sin rows, gathered once for all layers
        rope_rows: tuple[torch.Tensor, torch.Tensor] | None = None
        if self.pointwise is None:
            rope_rows = (self.cos.index_select(0, batch.positions)[:, None, :],
                         self.sin.index_select(0, batch.positions)[:, None, :])
        T = h.shape[0]
        inter = cfg.intermediate_size
        for i, layer in enumerate(self.layers):
            x = self._rms(h, layer.ln_attn)
            qkv = layer.qkv(x, layer.qkv_bias)
            if lora is not None:
                lora.add(qkv, x, i, "qkv")
            q, k, v = self._qkv_heads(qkv, batch.positions, rope_rows)
            o = attn.forward(i, q, k, v, kv)
            if kv_written is not None:
                kv_written(i + 1)
            o = o.reshape(T, -1)
            if lora is None:  # the residual add fused into the projection (h is this pass's own tensor)
                h = layer.o(o, layer.o_bias, residual=h)
            else:
                out = layer.o(o, layer.o_bias)
                lora.add(out, o, i, "o")
                h = h + out
            x = self._rms(h, layer.ln_mlp)
            gu = layer.gate_up(x)
            if lora is not None:
                lora.add(gu, x, i, "gate_up")
            act = self._silu_mul(gu, inter)
            if lora is None:
                h = layer.down(act, residual=h)
            else:
                down = layer.down(act)
                lora.add(down, act, i, "down")
                h = h + down
        if batch.hidden_idx is not None:
            batch.hidden = self._rms(h.index_select(0, batch.hidden_idx), self.norm)
        h = self._rms(h.index_select(0, batch.sample_idx), self.norm)
        return self.lm_head(h).float()

    @torch.inference_mode()
    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Logits ``[rows, vocab]`` (float32) of final hidden states a pass kept (``ForwardBatch.hidden``)."""
        return self.lm_head(hidden).float()
