"""Attention over the paged KV pool, behind one interface.

A forward batch mixes sequences in prefill (many query tokens, possibly on top of a cached prefix) and in decode
(one query token). ``plan`` runs once per forward and prepares what every layer reuses (block tables, masks);
``forward`` runs per layer: it stores the new K/V in the pool, then attends.

Backends: ``torch`` (CPU and CUDA, any dtype, always available), ``native`` (CPU: the C decode kernel) and
``flashinfer`` (CUDA, 16-bit compute, imported lazily).
"""

from __future__ import annotations

import logging
from abc import ABC, abstractmethod
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from kvmesh.engine.kv_cache import DeviceKVPool

log = logging.getLogger(__name__)


@dataclass
class SeqSlice:
    start: int            # first query token in the flattened batch
    num_query: int        # tokens computed this step
    kv_len: int           # tokens in the KV after this step (cached prefix + this step)
    block_table: list[int]


@dataclass
class ForwardBatch:
    input_ids: torch.Tensor   # [T]
    positions: torch.Tensor   # [T]
    slots: torch.Tensor       # [T] flat KV slot of each token
    seqs: list[SeqSlice]
    sample_idx: torch.Tensor  # [S] flat indices whose logits are wanted
    # [H] flat indices whose final (normed) hidden states the pass keeps in ``hidden`` (prompt logprobs: their
    # logits are taken a slice at a time, ``Model.logits``, so a long prompt's [H, vocab] never exists at once)
    hidden_idx: torch.Tensor | None = None
    hidden: torch.Tensor | None = None

    @classmethod
    def build(cls, seqs: list[SeqSlice], token_ids: list[list[int]], block_size: int,
              sample_idx: list[int], device: torch.device | str = "cpu") -> ForwardBatch:
        """Flatten per-sequence query tokens; positions and slots follow from each sequence's block table."""
        positions, slots = [], []
        for s in seqs:
            pos = torch.arange(s.kv_len - s.num_query, s.kv_len)
            table = torch.tensor(s.block_table, dtype=torch.long)
            positions.append(pos)
            slots.append(table[pos // block_size] * block_size + pos % block_size)
        flat = [t for ids in token_ids for t in ids]
        return cls(
            input_ids=torch.tensor(flat, dtype=torch.long, device=device),
            positions=torch.cat(positions).to(device),
            slots=torch.cat(slots).to(device),
            seqs=seqs,
            sample_idx=torch.tensor(sample_idx, dtype=torch.long, device=device),
        )


class AttentionBackend(ABC):
    name: str

    @abstractmethod
    def plan(self, batch: ForwardBatch, kv: DeviceKVPool) -> None: ...

    @abstractmethod
    def forward(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                kv: DeviceKVPool) -> torch.Tensor:
        """q ``[T, H, D]``, k/v ``[T, Hkv, D]`` -> ``[T, H, D]``."""


def _pad_tables(tables: list[list[int]], device: torch.device | str) -> torch.Tensor:
    width = max(len(t) for t in tables)
    return torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.long, device=device)


class TorchAttention(AttentionBackend):
    """SDPA. All decode rows go through one batched call over their gathered blocks; each prefill row gets
    its own call (causal on fresh K/V when nothing is cached, an explicit offset mask over the pool otherwise)."""

    name = "torch"

    def plan(self, batch: ForwardBatch, kv: DeviceKVPool) -> None:
        device = kv.k.device
        bs = kv.layout.block_size
        self._slots = batch.slots
        decode = [s for s in batch.seqs if s.num_query == 1 and s.kv_len > 1]
        self.prefill = [s for s in batch.seqs if not (s.num_query == 1 and s.kv_len > 1)]
        self.decode_idx = torch.tensor([s.start for s in decode], dtype=torch.long, device=device)
        if decode:
            self.decode_tables = _pad_tables([s.block_table[:-(-s.kv_len // bs)] for s in decode], device)
            width = self.decode_tables.shape[1] * bs
            self.decode_lens = torch.tensor([s.kv_len for s in decode], device=device)
            self.decode_mask = (torch.arange(width, device=device)[None, :]
                                < self.decode_lens[:, None])[:, None, None, :]
        self._plan_prefill(kv)

    def _plan_prefill(self, kv: DeviceKVPool) -> None:
        device, bs = kv.k.device, kv.layout.block_size
        # (the slice, its block table and mask; both None: nothing cached before it, plain causal attention)
        self.prefill_plan: list[tuple[SeqSlice, torch.Tensor | None, torch.Tensor | None]] = []
        for s in self.prefill:
            if s.kv_len == s.num_query:
                self.prefill_plan.append((s, None, None))
                continue
            nblocks = -(-s.kv_len // bs)
            table = torch.tensor([s.block_table[:nblocks]], dtype=torch.long, device=device)
            q_pos = torch.arange(s.kv_len - s.num_query, s.kv_len, device=device)
            mask = torch.arange(nblocks * bs, device=device)[None, :] <= q_pos[:, None]
            self.prefill_plan.append((s, table, mask))

    def forward(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                kv: DeviceKVPool) -> torch.Tensor:
        kv.write(layer, self._slots, k, v)
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
        if len(self.decode_idx):
            out.index_copy_(0, self.decode_idx, self._decode(layer, q.index_select(0, self.decode_idx), kv))
        if self.prefill:
            self._prefill(layer, q, k, v, kv, out)
        return out

    def _prefill(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv: DeviceKVPool,
                 out: torch.Tensor) -> None:
        """The prefill rows' attention into their rows of ``out``: SDPA per sequence."""
        for s, table, mask in self.prefill_plan:
            qs = q[s.start:s.start + s.num_query].transpose(0, 1).unsqueeze(0)
            if table is None:
                ks = k[s.start:s.start + s.num_query].transpose(0, 1).unsqueeze(0)
                vs = v[s.start:s.start + s.num_query].transpose(0, 1).unsqueeze(0)
                o = F.scaled_dot_product_attention(qs, ks, vs, is_causal=True, enable_gqa=True)
            else:
                kc, vc = kv.gather(layer, table)
                o = F.scaled_dot_product_attention(qs, kc.transpose(1, 2), vc.transpose(1, 2),
                                                   attn_mask=mask, enable_gqa=True)
            out[s.start:s.start + s.num_query] = o.squeeze(0).transpose(0, 1)

    def _decode(self, layer: int, q: torch.Tensor, kv: DeviceKVPool) -> torch.Tensor:
        """One query token per row: q ``[B, H, D]`` -> ``[B, H, D]``."""
        kc, vc = kv.gather(layer, self.decode_tables)
        o = F.scaled_dot_product_attention(q.unsqueeze(2), kc.transpose(1, 2), vc.transpose(1, 2),
                                           attn_mask=self.decode_mask, enable_gqa=True)
        return o.squeeze(2)


class NativeAttention(TorchAttention):
    """CPU: decode rows through the C kernel that reads the paged pool in place (no gather copy, no GQA
    expansion); prefill rows, with or without a cached prefix, through the C prefill kernel over the same pool
    (flash-style tiles, causal blocks skipped) where it builds (AVX-512, fp32, head dim 64 / 128), else SDPA as
    in ``torch``."""

    name = "native"
    MAX_HEAD_DIM, MAX_GROUP = 256, 16

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int) -> None:
        from kvmesh.engine import native

        lib = native.load()
        if lib is None:
            raise RuntimeError("the native decode kernel could not be built (see the log); use 'torch'")
        if head_dim > self.MAX_HEAD_DIM or num_heads // num_kv_heads > self.MAX_GROUP:
            raise RuntimeError(f"native kernel supports head_dim <= {self.MAX_HEAD_DIM} and "
                               f"<= {self.MAX_GROUP} query heads per KV head")
        self.lib, self.kernel = lib, native.paged_decode
        self.prefill_lib = native.load_prefill() if head_dim in native.PREFILL_HEAD_DIMS else None
        self.prefill_kernel = native.paged_prefill
        self.scale = head_dim ** -0.5

    def _decode(self, layer: int, q: torch.Tensor, kv: DeviceKVPool) -> torch.Tensor:
        if kv.dtype not in (torch.float32, torch.bfloat16, torch.float8_e4m3fn) or q.dtype != torch.float32:
            return super()._decode(layer, q, kv)
        return self.kernel(self.lib, q.contiguous(), kv.k[layer], kv.v[layer], self.decode_tables,
                           self.decode_lens, self.scale)

    def _in_place(self, kv: DeviceKVPool) -> bool:
        return self.prefill_lib is not None and kv.dtype == torch.float32 and kv.compute_dtype == torch.float32

    def _plan_prefill(self, kv: DeviceKVPool) -> None:
        if not self._in_place(kv):
            return super()._plan_prefill(kv)
        if not self.prefill:
            return
        bs = kv.layout.block_size
        self.prefill_slices = [torch.tensor([getattr(s, f) for s in self.prefill], dtype=torch.long)
                               for f in ("start", "num_query", "kv_len")]
        self.prefill_tables = _pad_tables([s.block_table[:-(-s.kv_len // bs)] for s in self.prefill], "cpu")

    def _prefill(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv: DeviceKVPool,
                 out: torch.Tensor) -> None:
        lib = self.prefill_lib
        if lib is None or not self._in_place(kv):
            return super()._prefill(layer, q, k, v, kv, out)
        starts, nqs, lens = self.prefill_slices
        self.prefill_kernel(lib, q, kv.k[layer], kv.v[layer], starts, nqs, lens, self.prefill_tables,
                            self.scale, out)


class FlashInferAttention(AttentionBackend):
    """FlashInfer's paged prefill/decode kernels (CUDA only). Needs ``pip install kvmesh[cuda]``. Its paged
    kernels compute in 16 bits: ``dtype`` bf16 or fp16, the KV stored in the same dtype or fp8."""

    name = "flashinfer"
    DTYPES = (torch.bfloat16, torch.float16)

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, device: torch.device,
                 dtype: torch.dtype = torch.float32, kv_dtype: torch.dtype | None = None) -> None:
        if torch.device(device).type != "cuda":
            raise RuntimeError("attention backend 'flashinfer' runs on CUDA only; use 'torch' on CPU")
        kv_dtype = dtype if kv_dtype is None else kv_dtype
        if dtype not in self.DTYPES or kv_dtype not in (dtype, torch.float8_e4m3fn):
            raise RuntimeError(f"attention backend 'flashinfer' computes in 16 bits (compute {dtype}, KV "
                               f"{kv_dtype} given): set dtype=bf16 and kv_dtype=bf16 (or fp8), or attention=torch")
        try:
            import flashinfer
        except ImportError as e:
            raise RuntimeError("attention backend 'flashinfer' needs the optional dependency: "
                               "pip install 'kvmesh[cuda]' (CUDA only)") from e
        self.flashinfer = flashinfer
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.workspace = torch.empty(128 * 1024 * 1024, dtype=torch.uint8, device=device)
        self.wrapper = flashinfer.BatchPrefillWithPagedKVCacheWrapper(self.workspace, "NHD")

    def plan(self, batch: ForwardBatch, kv: DeviceKVPool) -> None:
        device = kv.k.device
        bs = kv.layout.block_size
        qo_indptr, kv_indptr, indices, last_len = [0], [0], [], []
        for s in batch.seqs:
            nblocks = -(-s.kv_len // bs)
            qo_indptr.append(qo_indptr[-1] + s.num_query)
            indices.extend(s.block_table[:nblocks])
            kv_indptr.append(len(indices))
            last_len.append(s.kv_len - (nblocks - 1) * bs)
        def i32(values: list[int]) -> torch.Tensor:
            return torch.tensor(values, dtype=torch.int32, device=device)

        self.wrapper.plan(i32(qo_indptr), i32(kv_indptr), i32(indices), i32(last_len),
                          self.num_heads, self.num_kv_heads, self.head_dim, bs, causal=True,
                          q_data_type=kv.compute_dtype, kv_data_type=kv.dtype)
        self._slots = batch.slots

    def forward(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                kv: DeviceKVPool) -> torch.Tensor:
        kv.write(layer, self._slots, k, v)
        return self.wrapper.run(q, (kv.k[layer], kv.v[layer]))


BACKENDS = ("auto", "torch", "native", "flashinfer")


def make_backend(name: str, num_heads: int, num_kv_heads: int, head_dim: int, device: torch.device | str,
                 dtype: torch.dtype = torch.float32, kv_dtype: torch.dtype | None = None) -> AttentionBackend:
    """``dtype``: what attention computes in; ``kv_dtype``: what the KV pool stores (default: ``dtype``).
    ``auto``: flashinfer on CUDA when installed and the dtypes are its own (16-bit), the native kernel on CPU
    when it builds, else torch. A named backend that cannot run here raises RuntimeError saying what to set."""
    on_cuda = torch.device(device).type == "cuda"
    if name == "auto":
        for candidate in (["flashinfer"] if on_cuda else ["native"]):
            try:
                return make_backend(candidate, num_heads, num_kv_heads, head_dim, device, dtype, kv_dtype)
            except RuntimeError as e:
                log.info("attention auto: %s; using torch", e)
        return TorchAttention()
    if name == "torch":
        return TorchAttention()
    if name == "native":
        if on_cuda:
            raise RuntimeError("attention backend 'native' is CPU only; use 'flashinfer' or 'torch' on CUDA")
        return NativeAttention(num_heads, num_kv_heads, head_dim)
    if name == "flashinfer":
        return FlashInferAttention(num_heads, num_kv_heads, head_dim, torch.device(device), dtype, kv_dtype)
    raise ValueError(f"unknown attention backend {name!r}; choose one of {', '.join(BACKENDS)}")
