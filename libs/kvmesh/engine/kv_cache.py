"""Paged KV storage: the device pool (L1) and the host pool (L2).

Both pools hold whole blocks of shape ``[num_layers, 2 (k|v), block_size, num_kv_heads, head_dim]`` in the storage
dtype; the device pool is additionally addressable by *slot* (``block_id * block_size + offset``) so a forward pass
writes each new token's K/V with one ``index_copy_`` per layer. Attention always computes in the model dtype: a
narrower storage dtype (bf16, fp8 e4m3) is cast back on read.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np
import torch

from kvmesh.contracts.engine import ImportedKV
from kvmesh.contracts.layout import KVLayout

STORAGE_DTYPES: dict[str, torch.dtype] = {
    "fp32": torch.float32,
    "bf16": torch.bfloat16,
    "fp16": torch.float16,
    "fp8": torch.float8_e4m3fn,
}
FP8_MAX = 448.0


def _movable(t: torch.Tensor) -> torch.Tensor:
    """A view that index ops accept: CPU kernels for index_copy/index_select skip float8, bytes are bytes."""
    return t.view(torch.uint8) if t.dtype == torch.float8_e4m3fn else t


def storage_dtype(name: str) -> torch.dtype:
    """The torch dtype a layout's storage dtype name stands for (the name and its item size are contracts)."""
    try:
        return STORAGE_DTYPES[name]
    except KeyError:
        raise ValueError(f"unknown KV dtype {name!r}; choose one of {sorted(STORAGE_DTYPES)}") from None


def block_bytes(blocks: torch.Tensor) -> memoryview:
    """The raw bytes of blocks as a flat memoryview (what the transfer library and the pool client send):
    a zero-copy view of a contiguous CPU tensor, else of a contiguous CPU copy. fp8 and bf16 included: viewed
    as uint8 first, since numpy knows neither."""
    flat = blocks.detach().to("cpu").contiguous().view(torch.uint8).reshape(-1)
    return flat.numpy().data


def blocks_from_bytes(layout: KVLayout, data: memoryview | bytearray,
                      layers: tuple[int, int] | None = None) -> torch.Tensor:
    """``[n, *layout.block_shape]`` in the layout's storage dtype over the bytes of a writable buffer (what
    the transfer library received), without copying; with ``layers`` (a part of a layer group) each block
    holds only that slice, ``[n, end - first, 2, ...]``."""
    raw = torch.frombuffer(data, dtype=torch.uint8) if len(data) else torch.empty(0, dtype=torch.uint8)
    lo, hi = layers or (0, layout.num_layers)
    return raw.view(storage_dtype(layout.dtype)).view(-1, hi - lo, *layout.block_shape[1:])


class KVPiece(NamedTuple):
    """KV received for blocks ``first_block ..`` of a sequence: ``data`` ``[n, layers, 2, block_size, ...]``,
    whole blocks, or (``layers``, ``(first, end)``) only their slice of those layers (a part pushed in layer
    groups)."""

    first_block: int
    data: torch.Tensor
    layers: tuple[int, int] | None = None


class Landed(NamedTuple):
    """KV received in place for blocks ``first_block ..`` of a sequence: their bytes are already in the device
    blocks reserved under ``lease`` (``BlockManager.reserve``), except for ``pieces`` received elsewhere (e.g.
    before the reservation was made), which the import writes into those blocks."""

    lease: str
    pieces: list[KVPiece]


def received_blocks(kv: ImportedKV, layout: KVLayout) -> list[KVPiece] | Landed:
    """A verified push's blocks as ``BlockManager.import_prefix`` takes them: its buffered parts as tensors over
    their bytes (no copy), and with a reservation the blocks the rest landed in. ValueError when the push is in
    another layout than ``layout`` (the service checked it: a mismatch here would be a bug, never consumed)."""
    if kv.layout != layout:
        raise ValueError("pushed KV is in another layout than this engine's")
    pieces = [KVPiece(p.first_block, blocks_from_bytes(layout, p.data, p.layers), p.layers)
              for p in kv.parts if p.data is not None]
    return pieces if kv.reservation is None else Landed(kv.reservation, pieces)


def _runs(block_ids: list[int]) -> list[tuple[int, int, int]]:
    """``block_ids`` as runs of consecutive ids: ``(position in the list, first id, length)``."""
    runs: list[tuple[int, int, int]] = []
    for pos, b in enumerate(block_ids):
        if runs and runs[-1][1] + runs[-1][2] == b:
            runs[-1] = (runs[-1][0], runs[-1][1], runs[-1][2] + 1)
        else:
            runs.append((pos, b, 1))
    return runs


class DeviceKVPool:
    """The engine's paged KV tensor. Owns the bytes only; which block belongs to whom is the BlockManager's job."""

    def __init__(self, layout: KVLayout, num_blocks: int, compute_dtype: torch.dtype = torch.float32,
                 device: str | torch.device = "cpu") -> None:
        self.layout = layout
        self.num_blocks = num_blocks
        self.compute_dtype = compute_dtype
        self.dtype = storage_dtype(layout.dtype)
        shape = (layout.num_layers, num_blocks, layout.block_size, layout.num_kv_heads, layout.head_dim)
        self.k = torch.zeros(shape, dtype=self.dtype, device=device)
        self.v = torch.zeros(shape, dtype=self.dtype, device=device)

    def landing_arrays(self) -> tuple[np.ndarray, np.ndarray] | None:
        """K and V as ``uint8`` arrays ``[layers, blocks, bytes of one layer's K (or V) of a block]`` over the
        pool's own memory (no copy), where a transfer lands a push in place; None when the pool is not in
        process memory (CUDA: such pushes are received into a buffer and copied in)."""
        if self.k.device.type != "cpu":
            return None
        shape = (self.layout.num_layers, self.num_blocks, -1)
        return (self.k.view(torch.uint8).reshape(shape).numpy(), self.v.view(torch.uint8).reshape(shape).numpy())

    def write(self, layer: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store K/V ``[tokens, kv_heads, head_dim]`` at flat ``slots``."""
        heads, dim = self.layout.num_kv_heads, self.layout.head_dim
        if self.dtype == torch.float8_e4m3fn:  # out-of-range values would become NaN, not saturate
            k, v = k.clamp(-FP8_MAX, FP8_MAX), v.clamp(-FP8_MAX, FP8_MAX)
        _movable(self.k[layer]).view(-1, heads, dim).index_copy_(0, slots, _movable(k.to(self.dtype)))
        _movable(self.v[layer]).view(-1, heads, dim).index_copy_(0, slots, _movable(v.to(self.dtype)))

    def gather(self, layer: int, block_tables: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """K/V of each row's blocks, ``[batch, blocks * block_size, kv_heads, head_dim]`` in the compute dtype."""
        batch, nblocks = block_tables.shape
        shape = (batch, nblocks * self.layout.block_size, self.layout.num_kv_heads, self.layout.head_dim)
        k = _movable(self.k[layer]).index_select(0, block_tables.reshape(-1)).view(self.dtype).view(shape)
        v = _movable(self.v[layer]).index_select(0, block_tables.reshape(-1)).view(self.dtype).view(shape)
        return k.to(self.compute_dtype), v.to(self.compute_dtype)

    def read_blocks(self, block_ids: list[int], layers: tuple[int, int] | None = None) -> torch.Tensor:
        """Whole blocks as ``[n, num_layers, 2, block_size, kv_heads, head_dim]`` (storage dtype, a copy); with
        ``layers`` (``(first, end)``) only that slice of each block, ``[n, end - first, 2, ...]``.

        One copy of the bytes: each block's K and V (strided across layers in the pool) are copied straight
        into their place in the block-major result (gathering with ``index_select`` and then stacking and
        transposing copied every byte three times)."""
        lo, hi = layers or (0, self.layout.num_layers)
        out = torch.empty((len(block_ids), hi - lo, *self.layout.block_shape[1:]), dtype=self.dtype,
                          device=self.k.device)
        dst, k, v = _movable(out), _movable(self.k[lo:hi]), _movable(self.v[lo:hi])
        for i, b, m in _runs(block_ids):
            dst[i:i + m, :, 0].copy_(k[:, b:b + m].transpose(0, 1))
            dst[i:i + m, :, 1].copy_(v[:, b:b + m].transpose(0, 1))
        return out

    def write_blocks(self, block_ids: list[int], data: torch.Tensor, layers: tuple[int, int] | None = None) -> None:
        """Inverse of :meth:`read_blocks` (``layers``: ``data`` holds only that slice of each block): one strided
        copy of the bytes into the pool per run of consecutive block ids (``data`` may be a zero-copy view of
        received bytes; it is never made contiguous first)."""
        lo, hi = layers or (0, self.layout.num_layers)
        data = _movable(data.to(device=self.k.device, dtype=self.dtype))
        k, v = _movable(self.k[lo:hi]), _movable(self.v[lo:hi])
        for i, b, m in _runs(block_ids):
            k[:, b:b + m].copy_(data[i:i + m, :, 0].transpose(0, 1))
            v[:, b:b + m].copy_(data[i:i + m, :, 1].transpose(0, 1))

    def copy_tokens(self, src_block: int, dst_block: int, num_tokens: int) -> None:
        """Copy the first ``num_tokens`` of a block (a partial prefix match is copied, never shared)."""
        self.k[:, dst_block, :num_tokens] = self.k[:, src_block, :num_tokens]
        self.v[:, dst_block, :num_tokens] = self.v[:, src_block, :num_tokens]


class HostKVPool:
    """L2: a bounded pool of whole blocks in host memory, indexed by slot."""

    def __init__(self, layout: KVLayout, num_blocks: int) -> None:
        self.layout = layout
        self.num_blocks = num_blocks
        dtype = storage_dtype(layout.dtype)
        self.data = torch.zeros((num_blocks, *layout.block_shape), dtype=dtype,
                                pin_memory=torch.cuda.is_available())
        self.free_slots = list(range(num_blocks - 1, -1, -1))

    def store(self, blocks: torch.Tensor) -> list[int]:
        slots = [self.free_slots.pop() for _ in range(blocks.shape[0])]
        _movable(self.data).index_copy_(0, torch.tensor(slots, dtype=torch.long), _movable(blocks.to("cpu")))
        return slots

    def load(self, slots: list[int]) -> torch.Tensor:
        return _movable(self.data).index_select(0, torch.tensor(slots, dtype=torch.long)).view(self.data.dtype)

    def release(self, slot: int) -> None:
        self.free_slots.append(slot)
