"""The explicit converter between vLLM's paged KV on a CPU and kvmesh's wire layout.

vLLM 0.32's CPU attention (the ``vec`` fp32 kernel, ``LBHNC`` cache layout) gives each layer a tensor of nominal
shape ``[num_blocks, kv_heads, block_size, 2 * head_dim]``; inside it, the page of one (block, head) holds that
head's K **transposed**, ``[head_dim][block_size]``, then its V, ``[block_size][head_dim]`` (measured: K and V
recomputed from the weights match only this reading). kvmesh's wire layout (``KVLayout``, what the pool stores and
the hand-off carries) is, per block of kvmesh's ``block_size`` tokens, ``[layers, 2 (K|V), block_size, heads, dim]``,
one block after another. A vLLM block of ``per`` times kvmesh's block size is ``per`` wire blocks.

Equal byte counts prove nothing, so ``PagedLayout`` checks what vLLM registered (dtype, shape, contiguity) against
the model and refuses anything else: another kernel (bf16 on AMX, a GPU) packs its pages its own way.
"""

from __future__ import annotations

import torch

from kvmesh.contracts.layout import KVLayout

TORCH_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


class PagedLayout:
    """``layers``: vLLM's KV tensor of each layer, in layer order; ``wire``: kvmesh's layout of the same model."""

    def __init__(self, layers: list[torch.Tensor], wire: KVLayout, vllm_block_size: int) -> None:
        if not layers or len(layers) != wire.num_layers:
            raise ValueError(f"vLLM registered {len(layers)} KV layers; the model has {wire.num_layers}")
        want = TORCH_DTYPES.get(wire.dtype)
        h, d, bv = wire.num_kv_heads, wire.head_dim, vllm_block_size
        for i, t in enumerate(layers):
            if (t.device.type != "cpu" or t.dtype != want or t.dim() != 4 or tuple(t.shape[1:]) != (h, bv, 2 * d)
                    or not t.is_contiguous()):
                raise ValueError(
                    f"vLLM's KV tensor of layer {i} is {tuple(t.shape)} {t.dtype} on {t.device}: kvmesh converts only "
                    f"the CPU vec kernel's layout, [blocks, {h}, {bv}, {2 * d}] {want} contiguous")
        if bv % wire.block_size:
            raise ValueError(f"vLLM's block size {bv} is not a multiple of kvmesh's {wire.block_size}")
        self.layers, self.wire = layers, wire
        self.heads, self.dim, self.vllm_block_size = h, d, bv
        self.per = bv // wire.block_size
        self.num_blocks = layers[0].shape[0]

    def read(self, block_ids: list[int], layers: tuple[int, int] | None = None) -> torch.Tensor:
        """vLLM blocks ``block_ids`` as ``len(block_ids) * per`` wire blocks ``[n, *wire.block_shape]`` (a copy);
        with ``layers`` (``(first, end)``) only that slice of each, ``[n, end - first, 2, ...]``. Each layer's K and
        V go straight to their wire places (a permute of the whole result afterwards would copy it all again: it
        was two thirds of the read-out's time, which runs on the engine thread)."""
        n, h, d = len(block_ids), self.heads, self.dim
        bv, per, bs = self.vllm_block_size, self.per, self.wire.block_size
        lo, hi = layers or (0, len(self.layers))
        ids = torch.tensor(block_ids, dtype=torch.long)
        out = torch.empty(n, per, hi - lo, 2, bs, h, d, dtype=self.layers[0].dtype)
        for i, kv in enumerate(self.layers[lo:hi]):
            pages = kv.view(self.num_blocks, h, 2, bv * d).index_select(0, ids)
            out[:, :, i, 0] = pages[:, :, 0].view(n, h, d, per, bs).permute(0, 3, 4, 1, 2)  # K^T -> [token][head]
            out[:, :, i, 1] = pages[:, :, 1].view(n, h, per, bs, d).permute(0, 2, 3, 1, 4)
        return out.view(n * per, hi - lo, 2, bs, h, d)

    def write(self, block_ids: list[int], blocks: torch.Tensor) -> None:
        """Inverse of :meth:`read`: ``blocks`` (``len(block_ids) * per`` wire blocks) into vLLM blocks ``block_ids``."""
        n, h, d, bv, per = len(block_ids), self.heads, self.dim, self.vllm_block_size, self.per
        if blocks.shape[0] != n * per:
            raise ValueError(f"{blocks.shape[0]} wire blocks do not fill {n} vLLM blocks of {per}")
        ids = torch.tensor(block_ids, dtype=torch.long)
        w = (blocks.view(n, per, len(self.layers), 2, self.wire.block_size, h, d).permute(0, 2, 3, 1, 4, 5, 6)
             .reshape(n, len(self.layers), 2, bv, h, d))
        for i, kv in enumerate(self.layers):
            k = w[:, i, 0].permute(0, 2, 3, 1).reshape(n, h, bv * d)  # K^T: [head][dim][token]
            v = w[:, i, 1].permute(0, 2, 1, 3).reshape(n, h, bv * d)
            kv.view(self.num_blocks, h, 2 * bv * d).index_copy_(0, ids, torch.cat([k, v], dim=-1))
