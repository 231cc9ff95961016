"""vLLM's paged KV, whatever layout and dtype its attention backend registered, as kvmesh's wire layout.

One descriptor, one converter. ``describe`` reads what vLLM registered for a layer (the tensor's shape, strides,
dtype and device, the attention backend's name and declared ``KVCacheLayout``, the cache dtype and its scales) into
a ``LayerKV``: where K and where V of (block, token, head, dim) sit in that layer's storage, as an offset and four
strides each. Every backend reduces to that, so ``PagedLayout`` reads and writes every one of them with the same
gather (``index_select`` over the block axis of both planes) and scatter (``index_copy_``); nothing is special-cased
past ``describe``. kvmesh's wire layout (``KVLayout``: what the pool stores and a hand-off carries) is, per block of
kvmesh's ``block_size`` tokens, ``[layers, 2 (K|V), block_size, heads, dim]``; a vLLM block of ``per`` times that
size is ``per`` wire blocks.

The packings vLLM 0.32 registers (its ``[B, H, N, C]`` logical page view, RFC #42082, any stride permutation):

- ``content`` (FlashAttention, FlashInfer, Triton, FlexAttention, and every layer-compact or cross-layer
  ``KVCacheLayout``): ``[blocks, heads, tokens, K dim | V dim]``, the physical order in the strides.
- ``head-slots`` (B12X, which keeps K and V as two head slots, ``num_head_slots=2``): ``[blocks, 2, tokens,
  heads * dim]``, told from ``content`` by the backend (with two KV heads both shapes are the same). ROCm's
  backends also use two head slots but pack K inside them their own way: refused.
- ``cpu-vec`` (CPU attention, the ``vec`` kernel): nominally ``[blocks, heads, tokens, 2 * dim]``, but the kernel
  keeps each (block, head) page as K **transposed**, ``[dim][tokens]``, then V, ``[tokens][dim]`` (measured: K and
  V recomputed from the weights match only this reading, in fp32). Other CPU kernels (``amx``, ``neon``,
  ``vec16``) and the vec kernel's 16-bit and fp8 pages are not measured and are refused.

and the layouts older vLLM releases and other connectors hand out, taken by shape: ``kv-first`` (FlashAttention's
``[2, blocks, tokens, heads, dim]``), ``kv-inner`` (FlashInfer / Triton NHD, ``[blocks, 2, tokens, heads, dim]``)
and ``kv-inner-hnd`` (``[blocks, 2, heads, tokens, dim]``).

Dtypes: fp32, bf16, fp16 caches as they are; fp8 caches (vLLM keeps them as ``uint8`` bytes) as e4m3 or e5m2 with
the layer's per-tensor ``k_scale`` / ``v_scale``. The wire dtype is the instance's ``kv_dtype``: where it equals the
cache's (fp8: e4m3 with scales of 1) a block's bytes move unchanged and come back bit-exact; otherwise the
descriptor names the converter (``cast bf16->fp32``, ``fp8 e4m3 x0.5->fp8``), which dequantises with the scales
and casts. What cannot be converted (MLA's latent cache, per-token-head or 4-bit quantised KV, a kernel whose
packing is unknown, strides that disagree with the declared layout) raises ``Unconvertible`` naming what to set.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from kvmesh.contracts.layout import KVLayout
from kvmesh.engines.convert import cast_tensor

TORCH_DTYPES: dict[str, torch.dtype] = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16,
                                        "fp8": torch.float8_e4m3fn}
"""kvmesh's wire dtype names (``KVLayout.dtype``) as torch dtypes (fp8: e4m3 with a scale of 1)."""
_STORED = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}
_FP8 = {"fp8": torch.float8_e4m3fn, "fp8_e4m3": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2}
_FP8_NAME = {torch.float8_e4m3fn: "fp8", torch.float8_e5m2: "fp8_e5m2"}
_MEASURED_CPU = {("vec", torch.float32)}  # CPU kernels (and their dtype) whose page packing was measured
_HEAD_SLOT_BACKENDS = ("B12X",)  # K and V as two head slots, [blocks, 2, tokens, heads * dim] (num_head_slots=2)
PACKINGS = ("content", "head-slots", "cpu-vec", "kv-first", "kv-inner", "kv-inner-hnd")
_VIEW_ORDER = {  # a KVCacheLayout's physical order of the logical per-layer page [B, H, N, C] (vLLM 0.32)
    "LBHNC": (0, 1, 2, 3), "LBNHC": (0, 2, 1, 3), "LHBNC": (1, 0, 2, 3),
    "BLHNC": (0, 1, 2, 3), "BLNHC": (0, 2, 1, 3), "BHLNC": (0, 1, 2, 3)}


class Unconvertible(ValueError):
    """vLLM's KV of this instance cannot be converted to kvmesh's wire layout; the message says what to set."""


@dataclass(frozen=True)
class LayerCache:
    """What vLLM registered for one attention layer, and how its backend reads it (``vllm_cache`` reads these off
    vLLM's layer; a test builds them by hand)."""

    tensor: torch.Tensor
    backend: str                 # vLLM's attention backend name: FLASH_ATTN, FLASHINFER, TRITON_ATTN, CPU_ATTN, ...
    cache_dtype: str = "auto"    # the layer's kv_cache_dtype: auto, fp8, fp8_e4m3, fp8_e5m2, ...
    kv_layout: str = ""          # vLLM's resolved KVCacheLayout name (LBHNC, LBNHC, ...); "" when not declared
    isa: str = ""                # the CPU kernel (vec, vec16, amx, neon, ...): CPU_ATTN only
    k_scale: float = 1.0
    v_scale: float = 1.0
    mla: bool = False


@dataclass(frozen=True)
class Plane:
    """Where K (or V) of every (block, token, head, dim) sits in a layer's storage: an offset from the tensor's
    own storage offset, and a stride per logical axis, in elements of the stored dtype."""

    offset: int
    strides: tuple[int, int, int, int]  # block, token, head, dim


@dataclass(frozen=True)
class LayerKV:
    """The descriptor of one layer's paged KV."""

    packing: str
    num_blocks: int
    block_size: int
    heads: int
    dim: int
    stored: torch.dtype        # the values' dtype (an fp8 cache's bytes are read as this)
    k: Plane
    v: Plane
    k_scale: float = 1.0
    v_scale: float = 1.0
    device: str = "cpu"

    def planes(self, t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V of layer tensor ``t`` as ``[blocks, tokens, heads, dim]`` views of its storage (no copy), in a
        dtype the index kernels take (fp8 as its bytes)."""
        raw = t.view(torch.uint8) if self.stored.itemsize == 1 else t.view(self.stored)
        size = (self.num_blocks, self.block_size, self.heads, self.dim)
        return tuple(raw.as_strided(size, p.strides, raw.storage_offset() + p.offset)  # type: ignore[return-value]
                     for p in (self.k, self.v))

    def converter(self, wire_dtype: str) -> str:
        """How a block moves between this cache and a wire block of ``wire_dtype``: ``exact`` (its bytes) or the
        cast that converts it."""
        if self.stored == TORCH_DTYPES[wire_dtype] and self.k_scale == self.v_scale == 1.0:
            return "exact"
        name = _FP8_NAME.get(self.stored) or _STORED[self.stored]
        return f"cast {name}->{wire_dtype}" + ("" if self.k_scale == self.v_scale == 1.0 else " (scaled)")


def describe(layer: LayerCache, heads: int, dim: int, block_size: int) -> LayerKV:
    """The descriptor of one layer's KV; ``Unconvertible`` naming what to set when no converter fits."""
    t, backend = layer.tensor, layer.backend
    if layer.mla or "MLA" in backend.upper():
        raise Unconvertible(f"attention backend {backend} keeps MLA's single latent cache, which kvmesh's wire "
                            "layout (K and V per head) cannot carry: run this model without the pool and PD "
                            "(instance cachesvc_address empty, role both), or a model with per-head KV")
    stored = _stored_dtype(layer)
    shape, s = tuple(t.shape), t.stride()
    packing, k, v = _packing(layer, shape, s, heads, dim, block_size)
    return LayerKV(packing, shape[1] if packing == "kv-first" else shape[0], block_size, heads, dim, stored, k, v,
                   layer.k_scale, layer.v_scale, t.device.type)


def _stored_dtype(layer: LayerCache) -> torch.dtype:
    cache_dtype, t = layer.cache_dtype or "auto", layer.tensor
    if cache_dtype == "auto":
        if t.dtype not in _STORED:
            raise Unconvertible(f"vLLM's KV tensor is {t.dtype} with kv_cache_dtype auto: kvmesh converts fp32, "
                                "bf16 and fp16 caches (and fp8 ones): set the model dtype to one of those")
        return t.dtype
    if cache_dtype not in _FP8:
        raise Unconvertible(f"kv_cache_dtype {cache_dtype!r} (per-token-head, 4-bit or packed quantisation) keeps "
                            "scales or codes inside its pages that kvmesh's wire layout cannot carry: set "
                            "kv_cache_dtype to auto, fp8 or fp8_e5m2 (per-tensor scales)")
    if t.dtype not in (torch.uint8, torch.int8, *_FP8.values()):
        raise Unconvertible(f"kv_cache_dtype {cache_dtype} but the KV tensor is {t.dtype}, not bytes")
    return _FP8[cache_dtype]


def _packing(layer: LayerCache, shape: tuple[int, ...], s: tuple[int, ...], heads: int, dim: int,
             bs: int) -> tuple[str, Plane, Plane]:
    backend, where = layer.backend, f"{layer.backend} registered {list(shape)} strides {list(s)}"
    if layer.tensor.is_cuda and torch.version.hip is not None:
        raise Unconvertible(f"{where}: vLLM's ROCm backends pack K their own way (x-packed or shuffled pages), "
                            "which kvmesh has not measured; run this instance without the pool and PD")
    if len(shape) == 5:
        if shape[0] == 2 and shape[2:] == (bs, heads, dim):
            return "kv-first", Plane(0, (s[1], s[2], s[3], s[4])), Plane(s[0], (s[1], s[2], s[3], s[4]))
        nhd, hnd = shape[1:] == (2, bs, heads, dim), shape[1:] == (2, heads, bs, dim)
        if nhd and hnd and layer.kv_layout not in ("NHD", "HND"):
            raise Unconvertible(f"{where}: with {heads} heads in blocks of {bs} tokens the shape does not tell NHD "
                                "from HND and the backend declared neither; set a vLLM block size other than the "
                                "number of KV heads")
        if nhd and layer.kv_layout != "HND":
            return "kv-inner", Plane(0, (s[0], s[2], s[3], s[4])), Plane(s[1], (s[0], s[2], s[3], s[4]))
        if hnd:
            return "kv-inner-hnd", Plane(0, (s[0], s[3], s[2], s[4])), Plane(s[1], (s[0], s[3], s[2], s[4]))
    if len(shape) == 4 and backend == "CPU_ATTN":
        if shape[1:] != (heads, bs, 2 * dim) or not layer.tensor.is_contiguous():
            raise Unconvertible(f"{where}: CPU attention's pages are [blocks, {heads}, {bs}, {2 * dim}] contiguous")
        isa = layer.isa or "vec"
        if (isa, _stored_dtype(layer)) not in _MEASURED_CPU:
            raise Unconvertible(f"{where}: CPU attention's {isa!r} kernel with {_stored_dtype(layer)} KV packs its "
                                "pages in a way kvmesh has not measured; it converts the vec kernel's fp32 pages: "
                                "set dtype and kv_dtype fp32 and a vLLM block size that is a multiple of 32")
        page = 2 * bs * dim
        return "cpu-vec", Plane(0, (s[0], 1, s[1], bs)), Plane(page // 2, (s[0], dim, s[1], 1))
    if len(shape) == 4 and backend in _HEAD_SLOT_BACKENDS and shape[1:] == (2, bs, heads * dim):
        return "head-slots", Plane(0, (s[0], s[2], dim * s[3], s[3])), Plane(s[1], (s[0], s[2], dim * s[3], s[3]))
    if len(shape) == 4 and backend not in _HEAD_SLOT_BACKENDS and shape[1:] == (heads, bs, 2 * dim):
        _check_declared(layer, s, where)
        return "content", Plane(0, (s[0], s[2], s[1], s[3])), Plane(dim * s[3], (s[0], s[2], s[1], s[3]))
    raise Unconvertible(f"{where}: not a layout kvmesh knows for {heads} KV heads of {dim} in blocks of {bs} "
                        f"tokens ({', '.join(PACKINGS)}); run this instance without the pool and PD, or with "
                        "another attention backend (VLLM_ATTENTION_BACKEND)")


def _check_declared(layer: LayerCache, s: tuple[int, ...], where: str) -> None:
    """The tensor's strides must order the page's axes as the backend's declared ``KVCacheLayout`` says: a
    tensor whose strides and declaration disagree is read by vLLM's kernels one way and would be by kvmesh another.
    Axes of size 1 have no order."""
    order = _VIEW_ORDER.get(layer.kv_layout)
    if order is None:
        return
    shape = layer.tensor.shape
    got = sorted((a for a in range(4) if shape[a] > 1), key=lambda a: -s[a])
    want = [a for a in order if shape[a] > 1]
    if got != want:
        raise Unconvertible(f"{where}: its strides order the page {got}, the declared layout {layer.kv_layout} "
                            f"{want}; leave VLLM_KV_CACHE_LAYOUT unset or let the backend choose")


class PagedLayout:
    """vLLM's paged KV of every layer (``layers``, in layer order, described by ``describe``) read as, and written
    from, kvmesh's wire layout ``wire``. Reads and writes run where the KV lives (a GPU's blocks are gathered on
    the GPU) and the result of a read is on that device: the caller moves it (``kvmesh.vllm.mover``)."""

    def __init__(self, layers: Sequence[LayerCache], wire: KVLayout, vllm_block_size: int) -> None:
        if not layers or len(layers) != wire.num_layers:
            raise Unconvertible(f"vLLM registered {len(layers)} KV layers; the model has {wire.num_layers}")
        if vllm_block_size % wire.block_size:
            raise Unconvertible(f"vLLM's block size {vllm_block_size} is not a multiple of kvmesh's "
                                f"{wire.block_size}")
        self.descs = [describe(layer, wire.num_kv_heads, wire.head_dim, vllm_block_size) for layer in layers]
        kinds = {(d.packing, d.stored, d.device) for d in self.descs}
        if len(kinds) != 1:
            raise Unconvertible(f"vLLM's layers differ in layout or dtype ({sorted(map(str, kinds))}): kvmesh "
                                "converts models whose attention layers share one")
        self.planes = [d.planes(layer.tensor) for d, layer in zip(self.descs, layers, strict=True)]
        self.wire, self.vllm_block_size = wire, vllm_block_size
        self.heads, self.dim = wire.num_kv_heads, wire.head_dim
        self.per = vllm_block_size // wire.block_size
        self.num_blocks = self.descs[0].num_blocks
        self.device = layers[0].tensor.device
        self.wire_dtype = TORCH_DTYPES[wire.dtype]
        converters = {d.converter(wire.dtype) for d in self.descs}
        self.converter = "exact" if converters == {"exact"} else max(converters)

    def describe(self) -> dict[str, Any]:
        """The descriptor in words (logs, the instance's heartbeat and metrics)."""
        d = self.descs[0]
        return {"packing": d.packing, "stored": str(d.stored).removeprefix("torch."), "device": d.device,
                "converter": self.converter, "wire": self.wire.dtype}

    def read(self, block_ids: Sequence[int], layers: tuple[int, int] | None = None) -> torch.Tensor:
        """vLLM blocks ``block_ids`` as ``len(block_ids) * per`` wire blocks ``[n, *wire.block_shape]`` (a copy,
        on the KV's device); with ``layers`` (``(first, end)``) only that slice of each, ``[n, end - first, 2,
        ...]``. Each layer's K and V go straight to their wire places (one gather, one placing copy)."""
        n, h, d, per, bs = len(block_ids), self.heads, self.dim, self.per, self.wire.block_size
        lo, hi = layers or (0, len(self.planes))
        ids = torch.tensor(block_ids, dtype=torch.long, device=self.device)
        out = torch.empty(n, per, hi - lo, 2, bs, h, d, dtype=self.wire_dtype, device=self.device)
        for i in range(lo, hi):
            for j, plane in enumerate(self.planes[i]):
                out[:, :, i - lo, j] = self._to_wire(plane.index_select(0, ids), i, j).view(n, per, bs, h, d)
        return out.view(n * per, hi - lo, 2, bs, h, d)

    def write(self, block_ids: Sequence[int], blocks: torch.Tensor, layers: tuple[int, int] | None = None) -> None:
        """Inverse of :meth:`read`: ``blocks`` (``len(block_ids) * per`` wire blocks, on the KV's device or not)
        into vLLM blocks ``block_ids``; with ``layers`` only that range of layers (``blocks`` holding all)."""
        n, h, d, bv, per = len(block_ids), self.heads, self.dim, self.vllm_block_size, self.per
        if blocks.shape[0] != n * per:
            raise ValueError(f"{blocks.shape[0]} wire blocks do not fill {n} vLLM blocks of {per}")
        lo, hi = layers or (0, len(self.planes))
        ids = torch.tensor(block_ids, dtype=torch.long, device=self.device)
        w = blocks.view(n, per, len(self.planes), 2, self.wire.block_size, h, d)
        for i in range(lo, hi):
            for j, plane in enumerate(self.planes[i]):
                src = w[:, :, i, j].reshape(n, bv, h, d)
                plane.index_copy_(0, ids, self._from_wire(src, i, j).to(self.device, non_blocking=True))

    # ---- the converter -----------------------------------------------------------------------------------------
    def _to_wire(self, x: torch.Tensor, layer: int, kv: int) -> torch.Tensor:
        desc = self.descs[layer]
        if desc.stored.itemsize == 1:
            x = x.view(desc.stored)
        scale = (desc.k_scale, desc.v_scale)[kv]
        if desc.stored == self.wire_dtype and scale == 1.0:
            return x
        y = x.float() * scale if scale != 1.0 else x
        return cast_tensor(y, self.wire_dtype)

    def _from_wire(self, x: torch.Tensor, layer: int, kv: int) -> torch.Tensor:
        desc = self.descs[layer]
        scale = (desc.k_scale, desc.v_scale)[kv]
        if desc.stored != self.wire_dtype or scale != 1.0:
            x = cast_tensor(x.float() / scale if scale != 1.0 else x, desc.stored)
        return x.view(torch.uint8) if desc.stored.itemsize == 1 else x

